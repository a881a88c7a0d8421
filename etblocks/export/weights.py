"""Weight quantization of XNNPACK programs: etblocks' recipes for real models, and torchao's schemes the way
ExecuTorch's own LLM export applies them.

- Linears, `"8da4w"` / `"8da8w"`: torchao's `Int8DynamicActivationIntxWeightConfig` (ExecuTorch's `quantize(qmode=
  "8da4w")`): activations quantized at run time to int8 per token (asymmetric), weights to int4 with one scale per
  `group_size` inputs or to int8 with one scale per output channel, scales chosen by HQQ (ExecuTorch's default,
  `use_hqq`). torch.export writes the weight's tensor subclass out as `torchao.choose_qparams_affine /
  quantize_affine / dequantize_affine` around each linear, the pattern XNNPACK's partitioner turns into one
  dynamically quantized GEMM. One departure: XNNPACK stores int4 group scales as bf16, so 8da4w scales are made
  bf16 here (torchao's `weight_scale_dtype`, which re-rounds the integers to them) and the program computes what
  torchao's eager model computes; ExecuTorch's export keeps fp32 scales that XNNPACK then rounds.
- Recipes, `"4bit"` / `"8bit"` (the defaults that keep a real model, measured on SmolLM2 in
  `benchmarks/accuracy.py`): `"4bit"` makes every linear asymmetric int4 per group (`etblocks.export.int4`: a
  weight already on int4 groups, as a GGUF file's Q4_0 / Q4_1 / Q4_K blocks dequantized, keeps its values; other
  weights get GGUF Q4_1's min-max rounding), `"8bit"` makes them int8 per output row (`Int8RowsLinear`, the scale
  at each row's largest magnitude, int8 activations as 8da8w) unless they are on int4 groups (kept as in `"4bit"`).
  Both make the output layer such int8 rows and the embedding int8: a tied output layer and embedding hold the
  same rows and scales, which a program with its weights in a `.ptd` stores once.
- Embedding, `"int8"`: one int8 row and one scale per token (torchao's `IntxWeightOnlyConfig`, per row), looked
  up by `quantized_decomposed::embedding_byte` on CPU (XNNPACK has no embedding): ExecuTorch's
  `EmbeddingQuantHandler` / `QuantizedGroupEmbedding`.

Quantization lasts only while the program is exported (`quantized_weights`): the model keeps its float weights.
Only modules the program calls are quantized; a block that reads a linear's weight itself (MLA's absorbed
`kv_b_proj`) keeps it float, as do LoRA slots and MoE experts held as 3-D parameters. With `"8da4w"` / `"8da8w"`
the lm_head of a model with tied embeddings gets its own quantized weight (the embedding stays float unless
quantized itself).
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from etblocks.backends import Backend, backends
from etblocks.errors import ConfigError
from etblocks.export.int4 import AsymmetricInt4Linear, intx_tensor, min_max_groups, on_grid
from etblocks.options import OPTIONS, WEIGHT_RECIPES, check

GROUP_MULTIPLE = 32  # XNNPACK's blockwise int4 GEMM takes groups of a multiple of 32 inputs
GROUPED = ("8da4w", *WEIGHT_RECIPES)  # the linear schemes with int4 groups of `group_size` inputs


@dataclass(frozen=True)
class WeightQuantization:
    """What `quantized_weights` applies: a linear scheme (a recipe, `"4bit"` / `"8bit"`, or `"8da4w"` with
    `group_size`, `"8da8w"`) and/or an embedding scheme (`"int8"`)."""

    linear: str | None = None
    group_size: int | None = None
    embedding: str | None = None

    @property
    def recipe(self) -> bool:
        """Whether the linears follow a recipe (`"4bit"`, `"8bit"`: its own output layer and int4 groups)."""
        return self.linear in WEIGHT_RECIPES

    def __str__(self) -> str:
        parts = []
        if self.recipe:
            parts.append(f"{self.linear} recipe (int4 groups of {self.group_size}, int8 output layer)")
        elif self.linear is not None:
            parts.append(f"{self.linear}-g{self.group_size}" if self.group_size else self.linear)
        if self.embedding is not None:
            parts.append(f"{self.embedding} embedding")
        return ", ".join(parts)

    def linear_config(self):
        """The torchao config of the linears (also what a reference quantizes an upstream model with)."""
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerAxis, PerGroup

        if self.group_size:
            return Int8DynamicActivationIntxWeightConfig(
                weight_dtype=torch.int4,
                weight_granularity=PerGroup(self.group_size),
                weight_scale_dtype=torch.bfloat16,
                intx_choose_qparams_algorithm="hqq_scale_only",
            )
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int8, weight_granularity=PerAxis(0), intx_choose_qparams_algorithm="hqq_scale_only"
        )

    def embedding_config(self):
        """The torchao config of the embedding: int8, one scale per row."""
        from torchao.quantization import IntxWeightOnlyConfig, PerAxis

        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0), intx_choose_qparams_algorithm="hqq_scale_only")


def weight_quantization(
    backend: Backend, linear: str | None, group_size: int, embedding: str | None
) -> WeightQuantization | None:
    """The weight quantization `export` was asked for (None: none), checked against what `backend`'s kernels run
    before any work."""
    linear, embedding = check(OPTIONS["quantize_weights"], linear), check(OPTIONS["quantize_embedding"], embedding)
    for name, value, runs in (
        ("quantize_weights", linear, backend.weight_schemes),
        ("quantize_embedding", embedding, backend.embedding_schemes),
    ):
        if value is not None and value not in runs:
            able = sorted(b.name for b in backends() if value in (b.weight_schemes + b.embedding_schemes))
            raise ConfigError(f"{name}={value!r}: backend={backend.name!r} has no kernels for it; backends that run it: {able}")
    if linear in WEIGHT_RECIPES:
        embedding = embedding or "int8"  # a recipe quantizes the embedding too
    if linear in GROUPED and not (isinstance(group_size, int) and group_size > 0 and group_size % GROUP_MULTIPLE == 0):
        raise ConfigError(f"group_size={group_size!r} is not accepted; give a positive multiple of {GROUP_MULTIPLE} (XNNPACK's int4 groups)")
    if linear is None and embedding is None:
        return None
    return WeightQuantization(linear, group_size if linear in GROUPED else None, embedding)


def called_modules(
    model: nn.Module, program: nn.Module, example_inputs: tuple, types: tuple[type, ...]
) -> list[tuple[str, nn.Module]]:
    """The modules of `model` of `types` that one forward of `program` (which runs `model`) calls, by their
    names in `model`."""
    called: set[nn.Module] = set()
    with ExitStack() as hooks:
        for module in model.modules():
            if isinstance(module, types):
                hooks.callback(module.register_forward_pre_hook(lambda m, args: called.add(m)).remove)
        with torch.no_grad():
            program(*example_inputs)
    return [(name, module) for name, module in model.named_modules() if module in called]


def check_group_size(linears: list[tuple[str, nn.Linear]], group_size: int) -> None:
    """Every linear's in_features must split into whole groups; the error lists the group sizes that fit all."""
    for name, linear in linears:
        if linear.in_features % group_size:
            widths = sorted({m.in_features for _, m in linears})
            fits = [g for g in range(GROUP_MULTIPLE, min(widths) + 1, GROUP_MULTIPLE) if all(w % g == 0 for w in widths)]
            raise ConfigError(
                f"group_size={group_size} does not divide {name}'s in_features={linear.in_features}; group sizes that "
                f"divide every quantized linear's in_features ({widths}) and XNNPACK takes: {fits or 'none'}"
                + ("" if fits else "; use quantize_weights='8da8w' (one scale per channel)")
            )


class QuantizedEmbedding(nn.Module):
    """`forward(indices [...]) -> [..., D]` from int8 rows `weight [V, D]` times one `scales [V]` per row, by
    `quantized_decomposed::embedding_byte` (ExecuTorch's `QuantizedGroupEmbedding` at one group per row)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        import executorch.exir.passes  # noqa: F401  defines quantized_decomposed::embedding_byte

        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.dtype = dtype

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, config) -> QuantizedEmbedding:
        """Quantized as torchao's `quantize_(embedding, config)` would, so an upstream reference matches exactly."""
        from torchao.quantization import quantize_

        copy = nn.Embedding(*embedding.weight.shape, _weight=embedding.weight.detach(), _freeze=True)
        quantize_(copy, config, filter_fn=lambda module, fqn: isinstance(module, nn.Embedding))
        return cls(copy.weight.qdata, copy.weight.scale.reshape(-1), embedding.weight.dtype)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        qmin, qmax = torch.iinfo(torch.int8).min, torch.iinfo(torch.int8).max
        return torch.ops.quantized_decomposed.embedding_byte.dtype(self.weight, self.scales, None, qmin, qmax, indices, dtype=self.dtype)


class Int8RowsLinear(nn.Module):
    """`forward(x [..., in]) -> [..., out]`: a linear of int8 rows `q [out, in]` times one `scales [out]` each, with
    int8 dynamically quantized activations (8da8w), from the same tensors as a tied `QuantizedEmbedding`."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(intx_tensor(q, scales[:, None], torch.int8, q.shape[1]), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q [out, in] int8, scales [out] float32)`: each row symmetric int8 at its largest magnitude (as GGUF's Q8_0
    per block)."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(-1) / torch.iinfo(torch.int8).max).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.clamp(torch.round(weight / scales[:, None]), -torch.iinfo(torch.int8).max, torch.iinfo(torch.int8).max)
    return q.to(torch.int8), scales


KEPT = "int4 groups, kept"  # what the record says of a weight that was on int4 groups already
QUANTIZATION_METHOD = "etblocks_quantization"  # the program's record of its weight quantization (JSON bytes)


def quantization_constant(scheme: str, record: dict[str, str]) -> torch.Tensor:
    """What a program records of its quantization: the scheme and what each module holds, as a uint8 tensor of
    the UTF-8 bytes of a JSON object (a tensor: a list of ints costs an EValue of tens of bytes per character)."""
    text = json.dumps({"scheme": scheme, "modules": record}, separators=(",", ":"))
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).clone()


def read_quantization(value: torch.Tensor) -> dict:
    """`quantization_constant`'s object back: `{"scheme": ..., "modules": {name: what it holds}}`."""
    return json.loads(bytes(value.tolist()).decode())


@contextmanager
def quantized_weights(
    model: nn.Module, program: nn.Module, example_inputs: tuple, plan: WeightQuantization | None
) -> Iterator[dict[str, str]]:
    """Quantize the linears (and embeddings) of `model` that one forward of `program` (`model` seen through a
    program contract) calls while the block runs; yields what became of each module, by name (`KEPT` for a
    weight kept on the int4 groups it had). On exit every module and parameter is the float original again (the
    same objects).

    `ConfigError` (nothing changed) if `group_size` does not divide a linear's in_features, or if the program
    calls no module a requested scheme applies to.
    """
    if plan is None:
        yield {}
        return
    requested = {nn.Linear: ("quantize_weights", plan.linear), nn.Embedding: ("quantize_embedding", plan.embedding)}
    requested = {kind: option for kind, option in requested.items() if option[1] is not None}
    modules = called_modules(model, program, example_inputs, tuple(requested))
    linears = [(name, m) for name, m in modules if isinstance(m, nn.Linear)]
    embeddings = [(name, m) for name, m in modules if isinstance(m, nn.Embedding)]
    for kind, (option, scheme) in requested.items():
        if not any(isinstance(m, kind) for _, m in modules):
            raise ConfigError(f"{option}={scheme!r} quantizes nn.{kind.__name__} modules; the program calls none")
    if plan.group_size:
        check_group_size(linears, plan.group_size)
    with ExitStack() as restore:
        if plan.recipe:
            replacements = _recipe_modules(model, linears, embeddings, plan)
            for name, (replacement, _) in replacements.items():
                restore.enter_context(_replaced(model, name, replacement))
            yield {name: how for name, (_, how) in replacements.items()}
            return
        if linears:
            restore.enter_context(_quantized_linears(model, [m for _, m in linears], plan.linear_config()))
        for name, embedding in embeddings:
            restore.enter_context(_replaced(model, name, QuantizedEmbedding.from_embedding(embedding, plan.embedding_config())))
        yield {name: plan.linear if isinstance(m, nn.Linear) else f"{plan.embedding} rows" for name, m in modules}


def _recipe_modules(
    model: nn.Module, linears: list[tuple[str, nn.Linear]], embeddings: list[tuple[str, nn.Embedding]], plan: WeightQuantization
) -> dict[str, tuple[nn.Module, str]]:
    """The module that replaces each of `linears` and `embeddings` under a recipe, and what it holds. A tied output
    layer and embedding share one quantization of their weight."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def rows_of(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if id(weight) not in rows:
            rows[id(weight)] = int8_rows(weight)
        return rows[id(weight)]

    replacements: dict[str, tuple[nn.Module, str]] = {}
    for name, linear in linears:
        groups = None if linear is output else on_grid(linear.weight, plan.group_size)
        if groups is not None:
            replacements[name] = (AsymmetricInt4Linear(groups, linear.bias), KEPT)
        elif linear is output or plan.linear == "8bit":
            what = "int8 rows" + (" (output layer)" if linear is output else "")
            replacements[name] = (Int8RowsLinear(*rows_of(linear.weight), linear.bias), what)
        else:
            replacements[name] = (AsymmetricInt4Linear(min_max_groups(linear.weight, plan.group_size), linear.bias), "int4 groups, min-max")
    for name, embedding in embeddings:
        q, scales = rows_of(embedding.weight)
        replacements[name] = (QuantizedEmbedding(q, scales, embedding.weight.dtype), "int8 rows (embedding)")
    return replacements


@contextmanager
def _quantized_linears(model: nn.Module, linears: list[nn.Linear], config) -> Iterator[None]:
    """torchao's `quantize_` on `linears`; their parameters put back on exit (`quantize_` also patches each
    module's `extra_repr`, which goes too)."""
    from torchao.quantization import quantize_

    saved = [(linear, dict(linear._parameters), "extra_repr" in linear.__dict__) for linear in linears]
    targets = set(linears)
    try:
        quantize_(model, config, filter_fn=lambda module, fqn: module in targets)
        yield
    finally:
        for linear, parameters, had_repr in saved:
            for name, parameter in parameters.items():
                setattr(linear, name, parameter)
            if not had_repr:
                linear.__dict__.pop("extra_repr", None)


@contextmanager
def _replaced(model: nn.Module, name: str, replacement: nn.Module) -> Iterator[None]:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    original = getattr(parent, attr)
    setattr(parent, attr, replacement)
    try:
        yield
    finally:
        setattr(parent, attr, original)
