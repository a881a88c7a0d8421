"""Weight quantization of XNNPACK programs with torchao, the way ExecuTorch's own LLM export does it.

- Linears, `"8da4w"` / `"8da8w"`: torchao's `Int8DynamicActivationIntxWeightConfig` (ExecuTorch's `quantize(qmode=
  "8da4w")`): activations quantized at run time to int8 per token (asymmetric), weights to int4 with one scale per
  `group_size` inputs or to int8 with one scale per output channel, scales chosen by HQQ (ExecuTorch's default,
  `use_hqq`). torch.export writes the weight's tensor subclass out as `torchao.choose_qparams_affine /
  quantize_affine / dequantize_affine` around each linear, the pattern XNNPACK's partitioner turns into one
  dynamically quantized GEMM. One departure: XNNPACK stores int4 group scales as bf16, so 8da4w scales are made
  bf16 here (torchao's `weight_scale_dtype`, which re-rounds the integers to them) and the program computes what
  torchao's eager model computes; ExecuTorch's export keeps fp32 scales that XNNPACK then rounds.
- Embedding, `"int8"`: one int8 row and one scale per token (torchao's `IntxWeightOnlyConfig`, per row), looked
  up by `quantized_decomposed::embedding_byte` on CPU (XNNPACK has no embedding): ExecuTorch's
  `EmbeddingQuantHandler` / `QuantizedGroupEmbedding`.

Quantization lasts only while the program is exported (`quantized_weights`): the model keeps its float weights.
Only modules the program calls are quantized; a block that reads a linear's weight itself (MLA's absorbed
`kv_b_proj`) keeps it float, as do LoRA slots and MoE experts held as 3-D parameters. The lm_head of a model with
tied embeddings gets its own quantized weight (the embedding stays float unless quantized itself).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from etblocks.backends import Backend, backends
from etblocks.errors import ConfigError
from etblocks.options import OPTIONS, check

GROUP_MULTIPLE = 32  # XNNPACK's blockwise int4 GEMM takes groups of a multiple of 32 inputs


@dataclass(frozen=True)
class WeightQuantization:
    """What `quantized_weights` applies: a linear scheme (`"8da4w"` with `group_size`, `"8da8w"`) and/or an
    embedding scheme (`"int8"`)."""

    linear: str | None = None
    group_size: int | None = None
    embedding: str | None = None

    def __str__(self) -> str:
        parts = []
        if self.linear is not None:
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
    if linear == "8da4w" and not (isinstance(group_size, int) and group_size > 0 and group_size % GROUP_MULTIPLE == 0):
        raise ConfigError(f"group_size={group_size!r} is not accepted; give a positive multiple of {GROUP_MULTIPLE} (XNNPACK's int4 groups)")
    if linear is None and embedding is None:
        return None
    return WeightQuantization(linear, group_size if linear == "8da4w" else None, embedding)


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


@contextmanager
def quantized_weights(
    model: nn.Module, program: nn.Module, example_inputs: tuple, plan: WeightQuantization | None
) -> Iterator[list[str]]:
    """Quantize the linears (and embeddings) of `model` that one forward of `program` (`model` seen through a
    program contract) calls while the block runs; yields their names. On exit every module and parameter is the
    float original again (the same objects).

    `ConfigError` (nothing changed) if `group_size` does not divide a linear's in_features, or if the program
    calls no module a requested scheme applies to.
    """
    if plan is None:
        yield []
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
        if linears:
            restore.enter_context(_quantized_linears(model, [m for _, m in linears], plan.linear_config()))
        for name, embedding in embeddings:
            restore.enter_context(_replaced(model, name, QuantizedEmbedding.from_embedding(embedding, plan.embedding_config())))
        yield [name for name, _ in modules]


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
