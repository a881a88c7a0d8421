"""Hybrid LLMs (Qwen3.5, LFM2, Gemma 4) to ExecuTorch/XNNPACK: etblocks against ExecuTorch's own examples and
transformers.

Models: random weights, fp32, built by transformers from a config at the shape of ExecuTorch's examples
(`--family qwen3_5`: Qwen3.5-0.8B, 24 layers, 3 Gated DeltaNet then 1 gated attention; `--family lfm2`: LFM2-350M,
16 layers of short conv and attention; `--family gemma4`: Gemma 4 E2B's text decoder, 35 layers of sliding and full
attention of which the last 20 read an earlier layer's keys and values, per-layer inputs, with a 32768-token vocabulary
for both embedding tables instead of 262144, which would take 11 GB in fp32 and no cache depends on; all 35 layers
do not export in 24 GB, `--layers 20` does); `--layers N` keeps the first N layer types (a cut without attention gets
one as its last layer; Gemma 4 keeps E2B's share of KV-shared layers, `kv_shared_layers`). Rows (`--rows`), each
exported for fp32 and 8da4w (`--quantize`, groups of `--group-size`): (a) etblocks (swap + export); (b) the family's
ExecuTorch example as its README exports it (`export_llama` with the example's yaml; for Gemma 4 the text decoder of
`export_gemma4.export_single_pte`, which loads the transformers checkpoint as it is); (c) transformers'
`ExecutorchExporter().export_for_generation`; (d) (b) with dynamic shapes (qwen3_5 only); (e) transformers'
`TorchExportableModuleForDecoderOnlyLM`; (f) (a) with `delta_rule="chunked"`: DeltaNet's recurrence in matmuls (the
form of the other backends) instead of the fused kernel (qwen3_5 only).

Timing (`harness`): every row exported in a process of its own, then timed in a fresh process per prompt length
(`--prompts`) in `--rounds` interleaved rounds (an untimed warm prefill, a timed prefill, `--decode-steps` greedy
steps); medians [min-max]; rows take turns in memory when they would not fit together (`--load`). Tokens: every
row's greedy tokens against the eager transformers model's `generate()` on the same weights (8da4w rows against the
eager model quantized as the row quantizes, `build_reference_model`): fp32 rows must agree on all, 8da4w rows on the
first `--quantized-min-match` (XNNPACK's dynamic int8 activations round differently from torchao's eager ones);
otherwise the script exits 1. Also printed: fp32 state bytes per layer against a full-attention K/V cache
(`state_table`). Results: benchmarks/results/hybrid.json, one entry per family and layer count (a later run of the
same entry replaces the quantization settings it measures).

    python benchmarks/hybrid.py --family lfm2                       # 16 layers, fp32 and 8da4w
    python benchmarks/hybrid.py --family qwen3_5 --quantize none    # 24 layers, fp32
    python benchmarks/hybrid.py --family gemma4 --layers 20 --rows a,b --quantize none   # etblocks vs the example
    python benchmarks/hybrid.py --smoke                             # tiny qwen3_5, 2 layers, rows f and g, fp32
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import gc
import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    RESULTS_DIR,
    Bench,
    Checks,
    Deferred,
    Driver,
    EagerDriver,
    PathSpec,
    RebuiltWhenPickled,
    Row,
    Shape,
    TokensPosDriver,
    Unavailable,
    add_run_args,
    aligned_table,
    args_record,
    check_tokens,
    argmax_last,
    argument_parser,
    export_hf_static,
    describe_run,
    eager_reference_tokens,
    export_with_etblocks,
    host_key,
    format_table,
    load_method,
    linear_bytes,
    matching_prefix,
    parse_with_smoke,
    pte_megabytes,
    prepare_path,
    quantize_like_example,
    quantized_reference,
    reset_driver,
    run_method,
    run_info,
    select_paths,
    spread_record,
    time_in_fresh_process,
    write_results,
)

RESULTS = RESULTS_DIR / "hybrid.json"
STATE_CONTEXTS = (256, 2048, 8192)
_STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[hybrid bench {time.perf_counter() - _STARTED:5.0f} s] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Families


@dataclass(frozen=True)
class Family:
    """One model family: its transformers config at the full size, and how ExecuTorch's example exports it (`example`
is None for a family ExecuTorch has no example of: rows (b) and (d) are then unavailable)."""

    key: str
    label: str
    config_class: str  # in transformers
    model_class: str
    config: Mapping[str, Any]  # transformers config fields besides the layers
    layer_types: tuple[str, ...]
    tiny: Mapping[str, Any]  # `--shape tiny`: config fields that make the model small enough for a smoke run
    example: str | None = None  # executorch.examples.models.<example>
    example_model_class: str = ""  # export_llm's base.model_class
    example_yamls: Mapping[str | None, str] = dataclasses.field(default_factory=dict)  # config file per quantization
    example_dynamic: bool = True  # whether the example's yaml exports a dynamic prompt length
    example_resets_state: bool = True  # whether the example's program clears its state at input_pos 0
    shares_kv: bool = False  # Gemma 3n/4: the last layers read an earlier layer's keys and values
    min_context: int = 0  # the shortest `--max-seq-len` the example exports at
    context: int = 512  # `--max-seq-len` by default


QWEN3_5 = Family(
    key="qwen3_5",
    label="Qwen3.5-0.8B",
    config_class="Qwen3_5TextConfig",
    model_class="Qwen3_5ForCausalLM",
    config=dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
    layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention") * 6,
    example="qwen3_5",
    example_model_class="qwen3_5_0_8b",
    example_yamls={None: "qwen3_5_xnnpack_fp32.yaml", "8da4w": "qwen3_5_xnnpack_fp32.yaml"},
    example_dynamic=False,
    example_resets_state=True,
    tiny=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
              linear_num_value_heads=4),
)

LFM2 = Family(
    key="lfm2",
    label="LFM2-350M",
    config_class="Lfm2Config",
    model_class="Lfm2ForCausalLM",
    config=dict(
        vocab_size=65536, hidden_size=1024, intermediate_size=6656, block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0, block_multiple_of=256, num_attention_heads=16, num_key_value_heads=8,
        norm_eps=1e-5, conv_L_cache=3, conv_bias=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    layer_types=("conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv", "full_attention",
                 "conv", "full_attention", "conv", "full_attention", "conv", "full_attention", "conv"),
    example="lfm2",
    example_model_class="lfm2_350m",
    example_yamls={None: "lfm2_xnnpack_fp32.yaml", "8da4w": "lfm2_xnnpack_q8da4w.yaml"},
    example_dynamic=True,
    example_resets_state=False,
    tiny=dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
)

GEMMA4 = Family(
    key="gemma4",
    label="Gemma-4-E2B text decoder",
    config_class="Gemma4TextConfig",
    model_class="Gemma4ForCausalLM",
    config=dict(
        vocab_size=32768, vocab_size_per_layer_input=32768, hidden_size=1536, intermediate_size=6144,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
        hidden_size_per_layer_input=256, use_double_wide_mlp=True, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}},
    ),
    layer_types=(("sliding_attention",) * 4 + ("full_attention",)) * 7,
    example="gemma4",
    example_model_class="",  # not an export_llm model: `export_gemma4_example`
    example_yamls={},
    example_dynamic=True,
    example_resets_state=True,
    tiny=dict(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64, intermediate_size=128,
              num_attention_heads=4, head_dim=16, global_head_dim=32, sliding_window=8, hidden_size_per_layer_input=16),
    shares_kv=True,
    min_context=772,  # export_gemma4 traces a 770-token example with the prompt length dynamic below the context
    context=1024,  # export_gemma4's default
)

# Granite 4.0-H-Micro: sizes from the Granite 4.0 model card (3B dense; 36 Mamba2 and 4 attention layers, hidden
# 2048, 32/8 heads of 64, Mamba2 state 128 over 64 heads, MLP 8192, NoPE); layers in groups of nine Mamba2 then one
# attention, as IBM describes the stack; the multipliers are Granite 4.0's (with random weights they only scale).
GRANITE4H = Family(
    key="granitemoehybrid",
    label="Granite-4.0-H-Micro",
    config_class="GraniteMoeHybridConfig",
    model_class="GraniteMoeHybridForCausalLM",
    config=dict(
        vocab_size=100352, hidden_size=2048, shared_intermediate_size=8192, num_local_experts=0, num_experts_per_tok=0,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, position_embedding_type="nope",
        mamba_n_heads=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
        mamba_conv_bias=True, mamba_proj_bias=False, embedding_multiplier=12.0, logits_scaling=8.0,
        residual_multiplier=0.22, attention_multiplier=0.015625, tie_word_embeddings=True,
    ),
    layer_types=(("linear_attention",) * 9 + ("full_attention",)) * 4,
    tiny=dict(vocab_size=512, hidden_size=64, shared_intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, mamba_n_heads=4, mamba_d_state=16),
)

FAMILIES = {f.key: f for f in (QWEN3_5, LFM2, GEMMA4, GRANITE4H)}
E2B_KV_SHARED = (20, 35)  # Gemma 4 E2B: the last 20 of 35 layers read an earlier layer's keys and values


def kv_shared_layers(layer_types: Sequence[str]) -> int:
    """How many of the last layers share keys and values when a Gemma 4 stack is cut to `layer_types`: E2B's
    share, fewer when the layers left with a cache would miss a kind that a shared layer needs as its source."""
    shared = round(len(layer_types) * E2B_KV_SHARED[0] / E2B_KV_SHARED[1])
    while shared and not set(layer_types[-shared:]) <= set(layer_types[:-shared]):
        shared -= 1
    return shared


def cut_layer_types(family: Family, layers: int | None) -> tuple[tuple[str, ...], bool]:
    """The first `layers` layer types of the family (all by default), and whether the last was made
    `full_attention` because the cut had none."""
    full = family.layer_types
    if layers is None:
        return full, False
    if not 1 <= layers <= len(full):
        raise SystemExit(f"--layers must be 1..{len(full)} for {family.key}")
    types = list(full[:layers])
    if "full_attention" in types:
        return tuple(types), False
    types[-1] = "full_attention"
    return tuple(types), True


@dataclass
class HybridBench(Bench):
    """decode.py's settings plus the family, its layers, the weight quantization and every prompt by length
    (`prompt` is one of them)."""

    family: str = "lfm2"
    tiny: bool = False  # `--shape tiny`
    layer_types: tuple[str, ...] = ()
    quantize: str | None = None
    group_size: int = 32
    prompts: Mapping[int, list[int]] = dataclasses.field(default_factory=dict)


def config_fields(bench: HybridBench) -> dict[str, Any]:
    """The family's config fields at the bench's size (`--shape tiny` or full), besides the layers."""
    family = FAMILIES[bench.family]
    return {**family.config, **(family.tiny if bench.tiny else {})}


def hf_config(bench: HybridBench) -> Any:
    import transformers

    family = FAMILIES[bench.family]
    config_class = getattr(transformers, family.config_class)
    shared = {"num_kv_shared_layers": kv_shared_layers(bench.layer_types)} if family.shares_kv else {}
    return config_class(
        **config_fields(bench), **shared, num_hidden_layers=len(bench.layer_types),
        layer_types=list(bench.layer_types), initializer_range=bench.init_range, bos_token_id=None, eos_token_id=None,
        pad_token_id=0,
    )


def model_class(bench: HybridBench) -> type:
    import transformers

    return getattr(transformers, FAMILIES[bench.family].model_class)


def build_model(bench: HybridBench) -> torch.nn.Module:
    """The family's transformers model with the bench's layers and seeded random weights (fp32, eval)."""
    config = hf_config(bench)
    torch.manual_seed(bench.seed)
    return model_class(bench)(config).to(torch.float32).eval()


# how each row quantizes, when not as ExecuTorch's example ("example")
REFERENCE_SCHEMES = {"a": "etblocks", "f": "etblocks", "g": "etblocks"}


def reference_scheme(key: str, quantize: str | None) -> str:
    """Which eager reference row `key` is compared with: "fp32", or how the row quantizes its weights."""
    return "fp32" if quantize is None else REFERENCE_SCHEMES.get(key, "example")


def build_reference_model(bench: HybridBench, scheme: str) -> torch.nn.Module:
    """The eager model a row's tokens are compared with: `build_model`, quantized as the row quantizes
    (`harness.quantized_reference`)."""
    model = build_model(bench)
    return model if scheme == "fp32" else quantized_reference(model, scheme, bench.quantize, bench.group_size)


def quantize_for_transformers_export(model: torch.nn.Module, bench: HybridBench) -> torch.nn.Module:
    """`quantize_like_example`, then the torchao tensor subclasses unwrapped into plain tensors and
    parametrizations: transformers' exporter moves the model with `model.to()`, which cannot swap them."""
    model = quantize_like_example(model, bench.quantize, bench.group_size)
    if bench.quantize is not None:
        from torchao.utils import unwrap_tensor_subclass

        unwrap_tensor_subclass(model)
    return model


def build_export_model(bench: HybridBench) -> torch.nn.Module:
    """What the transformers exporters get: `build_model` quantized for them."""
    return quantize_for_transformers_export(build_model(bench), bench)


def linear_shapes(bench: HybridBench) -> list[tuple[int, int]]:
    """(out, in) of every linear one token runs through, the lm_head included (built on the meta device)."""
    with torch.device("meta"):
        model = model_class(bench)(hf_config(bench))
    return [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def weight_bytes_per_token(bench: HybridBench, quantize: str | None) -> float:
    """What one decode step reads of the linear weights (quant.py's byte counts; an 8da4w linear whose input width
    the group size does not divide stays fp32, as the quantizer leaves it)."""
    total = 0.0
    for out_features, in_features in linear_shapes(bench):
        scheme = quantize if quantize is None or in_features % bench.group_size == 0 else None
        total += linear_bytes(out_features, in_features, scheme, bench.group_size)
    return total


# --------------------------------------------------------------------------------------------------
# State bytes per layer


def layer_kinds(bench: HybridBench) -> list[str]:
    """Each layer's kind of state: its layer type, with ", kv shared" for a layer that reads an earlier layer's keys
    and values (and keeps none)."""
    shared = kv_shared_layers(bench.layer_types) if FAMILIES[bench.family].shares_kv else 0
    return [kind + (", kv shared" if i >= len(bench.layer_types) - shared else "")
            for i, kind in enumerate(bench.layer_types)]


def kv_widths(bench: HybridBench) -> dict[str, int]:
    """K values per position of each attention layer type (`k_proj`'s outputs), read off the model built on the meta
    device: transformers keeps per-layer head sizes (Gemma 4's wider full-attention heads) in the layers."""
    with torch.device("meta"):
        model = model_class(bench)(hf_config(bench))
    return {kind: layer.self_attn.k_proj.out_features for kind, layer in zip(bench.layer_types, model.model.layers)
            if hasattr(getattr(layer, "self_attn", None), "k_proj")}


def state_bytes(config: Any, kind: str, context: int, kv_width: int = 0, bytes_per_value: int = 4) -> int:
    """fp32 bytes one layer of `kind` keeps for a sequence of `context` tokens (`kv_width`: an attention layer's K
    values per position, `kv_widths`):

      full_attention    2 * ctx * kv_width                                   (K and V)
      sliding_attention 2 * min(ctx, window) * kv_width                      (K and V in a ring of the window)
      ..., kv shared    0                                                    (reads an earlier layer's)
      conv (LFM2)       (L_cache - 1) * hidden                               (the short conv's window)
      linear_attention  (conv_kernel - 1) * (2 * key_dim + value_dim)        (the conv window over q, k, v)
       (DeltaNet)       + v_heads * k_head_dim * v_head_dim                  (the DeltaNet recurrent matrix)
      linear_attention  (d_conv - 1) * (expand * hidden + 2 * groups * d_state)   (the conv window over x, B, C)
       (Mamba2)         + n_heads * d_head * d_state                               (the SSM state)

    Programs may keep more: transformers and ExecuTorch's Qwen3.5 example keep conv_kernel rows, not
    conv_kernel - 1 (Mamba2 too); ExecuTorch's LFM2 example keeps L_cache - 1; ExecuTorch's Gemma 4 example keeps
    the whole context for sliding layers too."""
    if kind.endswith(", kv shared"):
        return 0
    if kind == "full_attention":
        return 2 * context * kv_width * bytes_per_value
    if kind == "sliding_attention":
        return 2 * min(context, config.sliding_window) * kv_width * bytes_per_value
    if kind == "conv":
        return (config.conv_L_cache - 1) * config.hidden_size * bytes_per_value
    if kind == "linear_attention" and hasattr(config, "mamba_d_state"):
        channels = config.mamba_expand * config.hidden_size + 2 * config.mamba_n_groups * config.mamba_d_state
        recurrent = config.mamba_n_heads * config.mamba_d_head * config.mamba_d_state
        return ((config.mamba_d_conv - 1) * channels + recurrent) * bytes_per_value
    if kind == "linear_attention":
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        window = (config.linear_conv_kernel_dim - 1) * (2 * key_dim + value_dim)
        recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
        return (window + recurrent) * bytes_per_value
    raise ValueError(f"no state size for layer type {kind!r}")


def _bytes(n: float) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def state_table(bench: HybridBench) -> tuple[str, dict[str, Any]]:
    """The text table of state bytes per layer and per model at `STATE_CONTEXTS`, and the same figures for the
    results file; at the full size of the family."""
    family = FAMILIES[bench.family]
    full_size = dataclasses.replace(bench, layer_types=family.layer_types)
    config, widths, layer_kind = hf_config(full_size), kv_widths(full_size), layer_kinds(full_size)
    kinds = list(dict.fromkeys(layer_kind))
    counts = {kind: layer_kind.count(kind) for kind in kinds}
    per_layer = {kind: {c: state_bytes(config, kind, c, widths.get(kind.split(",")[0], 0)) for c in STATE_CONTEXTS}
                 for kind in kinds}
    full_layer = {c: state_bytes(config, "full_attention", c, widths["full_attention"]) for c in STATE_CONTEXTS}
    model = {c: sum(counts[k] * per_layer[k][c] for k in kinds) for c in STATE_CONTEXTS}
    all_full = {c: len(family.layer_types) * full_layer[c] for c in STATE_CONTEXTS}
    headers = ["layer (fp32 state)", "layers", *(f"ctx {c}" for c in STATE_CONTEXTS),
               *(f"vs full attn @{c}" for c in STATE_CONTEXTS)]
    mixer = " (Mamba2)" if hasattr(config, "mamba_d_state") else " (DeltaNet)"
    lines = [[kind + mixer * (kind == "linear_attention"), str(counts[kind]), *(_bytes(per_layer[kind][c]) for c in STATE_CONTEXTS),
              *(f"{per_layer[kind][c] / full_layer[c]:.3f}x" for c in STATE_CONTEXTS)]
             for kind in kinds]
    lines.append([f"{family.label} (all {len(family.layer_types)} layers)", str(len(family.layer_types)),
                  *(_bytes(model[c]) for c in STATE_CONTEXTS),
                  *(f"{model[c] / all_full[c]:.3f}x" for c in STATE_CONTEXTS)])
    lines.append(["same layers, all full attention", str(len(family.layer_types)),
                  *(_bytes(all_full[c]) for c in STATE_CONTEXTS), *("1.000x" for _ in STATE_CONTEXTS)])
    figures = {"contexts": list(STATE_CONTEXTS), "layers": counts,
               "bytes_per_layer": {k: {str(c): v for c, v in per.items()} for k, per in per_layer.items()},
               "model_bytes": {str(c): v for c, v in model.items()},
               "all_full_attention_bytes": {str(c): v for c, v in all_full.items()}}
    return aligned_table(headers, lines), figures


# --------------------------------------------------------------------------------------------------
# Drivers


class ReloadingDriver(TokensPosDriver):
    """`TokensPosDriver` for a program that keeps state it does not clear at input_pos 0 (ExecuTorch's LFM2 example):
    `reset()` loads the program anew, which starts it from zeroed buffers."""

    def __init__(self, path: Path, token_by_token: bool = False):
        super().__init__(path, token_by_token)
        self.path = path

    def reset(self) -> None:
        self.method = None
        gc.collect()
        self.method = load_method(self.path)


class ExporterDriver(RebuiltWhenPickled):
    """transformers' `export_for_generation` programs of a hybrid model, one saved export per prompt length (`dirs`):
    `prefill` (static at its prompt length, loaded the first time a prompt of that length comes) and `decode` (from
    the first export). Inputs follow each program's recorded kwargs: `None` for a mask the layer type does not take
    (the programs keep those slots), the cache's tensors flattened; the prefill takes each attention layer's write
    position, both return logits and the whole cache, which the next call takes back."""

    def __init__(self, dirs: Mapping[int, Path], max_cache_len: int):
        from transformers.exporters.metadata import load_treespec

        self.dirs = {int(n): Path(d) for n, d in dirs.items()}
        self.max_cache_len = max_cache_len
        self.meta = {n: json.loads((d / "export.json").read_text())["components"] for n, d in self.dirs.items()}
        self.leaves = {n: {name: load_treespec(c["metadata"]["out_spec"]).num_leaves for name, c in meta.items()}
                       for n, meta in self.meta.items()}
        first = min(self.dirs)
        self.decode_method = load_method(self.dirs[first] / "decode.pte")
        self.decode_layout = self._layout(self.meta[first]["decode"])
        self.prefill_methods: dict[int, Any] = {}
        self.cache: list[torch.Tensor] = []

    @staticmethod
    def _layout(component: Mapping[str, Any]) -> list[str]:
        """Each graph input's source: a kwarg name, "none", or "cache" (all the cache's tensors)."""
        layout = []
        for name, meta in component["metadata"]["kwargs"].items():
            if "leaves" in meta:
                layout += ["none" if leaf.get("container") == "NoneType" else name for leaf in meta["leaves"].values()]
            elif meta.get("container") == "NoneType":
                layout.append("none")
            else:
                layout.append(name)
        return layout

    @staticmethod
    def _inputs(layout: Sequence[str], values: Mapping[str, Any], cache: Sequence[torch.Tensor]) -> list[Any]:
        inputs: list[Any] = []
        for source in layout:
            inputs += cache if source == "cache" else [None if source == "none" else values[source]]
        return inputs

    def prefill(self, prompt: list[int]) -> int:
        n = len(prompt)
        if n not in self.dirs:
            raise ValueError(f"no prefill program for a {n}-token prompt (exported for {sorted(self.dirs)})")
        if n not in self.prefill_methods:
            self.prefill_methods[n] = load_method(self.dirs[n] / "prefill.pte")
        method, layout = self.prefill_methods[n], self._layout(self.meta[n]["prefill"])
        write_positions = method.metadata.num_inputs() - len([s for s in layout if s != "cache"])
        values = {"input_ids": torch.tensor([prompt], dtype=torch.long),
                  "position_ids": torch.arange(n, dtype=torch.long)[None]}
        outputs = run_method(method, self._inputs(layout, values, [torch.tensor(0)] * write_positions))
        logits, *self.cache = outputs[-self.leaves[n]["prefill"]:]
        return argmax_last(logits)

    def decode(self, token: int, pos: int) -> int:
        values = {"input_ids": torch.tensor([[token]], dtype=torch.long),
                  "attention_mask": (torch.arange(self.max_cache_len) <= pos)[None, None, None],
                  "position_ids": torch.tensor([[pos]], dtype=torch.long)}
        outputs = run_method(self.decode_method, self._inputs(self.decode_layout, values, self.cache))
        logits, *self.cache = outputs[-self.leaves[min(self.dirs)]["decode"]:]
        return argmax_last(logits)


class OneAtATime(RebuiltWhenPickled):
    """A driver loaded only for its turn: `reset()` (untimed, before every prefill) builds it from its constructor
    call if it is not loaded, dropping whichever `OneAtATime` driver of this process was, so that one program at a
    time is in memory while the rows still take turns within each round."""

    _loaded: OneAtATime | None = None

    def __init__(self, construction: tuple[Callable[..., Any], tuple]):
        self.construction = construction
        self.inner: Driver | None = None

    def reset(self) -> None:
        if self.inner is None:
            current = OneAtATime._loaded
            if current is not None and current is not self:
                current.inner = None
                gc.collect()
            function, args = self.construction
            self.inner = function(*args)  # a program just loaded starts from zeroed state
            OneAtATime._loaded = self
            return
        reset_driver(self.inner)

    def prefill(self, prompt: list[int]) -> int:
        return self.inner.prefill(prompt)

    def decode(self, token: int, pos: int) -> int:
        return self.inner.decode(token, pos)


# --------------------------------------------------------------------------------------------------
# Paths: one function per row, `(bench, row) -> Driver`


def one_line(error: BaseException) -> str:
    """`Type: first line` of an exception and of the errors it was raised from."""
    parts = []
    while error is not None and len(parts) < 4:
        parts.append(f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
        error = error.__cause__
    return " <- ".join(parts)


def tag(bench: HybridBench) -> str:
    return bench.quantize or "fp32"


def etblocks_driver(bench: HybridBench, row: Row, filename: str, swap_options: Mapping[str, Any] | None = None) -> Driver:
    """Swap the transformers model's blocks, export to XNNPACK (`forward(tokens, input_pos)`) and load it;
    `UnsupportedModelError` shows as unavailable."""
    from etblocks.errors import UnsupportedModelError

    export_options = {"quantize_weights": bench.quantize, "group_size": bench.group_size} if bench.quantize else {}
    try:
        driver, _ = export_with_etblocks(bench, row, build_model, filename, swap_options=swap_options,
                                         export_options=export_options)
    except UnsupportedModelError as e:
        raise Unavailable(one_line(e)) from e
    return driver


def path_etblocks(bench: HybridBench, row: Row) -> Driver:
    """(a) etblocks with the xnnpack recipe's defaults (the fused delta rule for DeltaNet layers)."""
    return etblocks_driver(bench, row, f"a_etblocks_{tag(bench)}.pte")


def path_etblocks_chunked(bench: HybridBench, row: Row) -> Driver:
    """(f) (a) with `delta_rule="chunked"`: gated DeltaNet's recurrence in matmuls (the form every other backend
    runs) instead of ExecuTorch's fused `llama::gated_delta_rule` kernel, measured against it on XNNPACK."""
    if bench.family != QWEN3_5.key or "linear_attention" not in bench.layer_types:
        raise Unavailable(f"{bench.family} has no gated DeltaNet layer: no delta rule to choose")
    return etblocks_driver(bench, row, f"f_etblocks_chunked_{tag(bench)}.pte", {"delta_rule": "chunked"})


def example_params(bench: HybridBench, model: torch.nn.Module) -> dict[str, Any]:
    """The example's params.json for the transformers model (the keys of its config/*.json)."""
    config = model.config
    rope = config.rope_parameters
    common = dict(dim=config.hidden_size, n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
                  n_layers=config.num_hidden_layers, rope_theta=rope["rope_theta"], use_scaled_rope=False,
                  vocab_size=config.vocab_size, use_hf_rope=True, use_qk_norm=True, qk_norm_before_rope=True)
    if bench.family == "qwen3_5":
        return dict(
            common, hidden_dim=config.intermediate_size, head_dim=config.head_dim, norm_eps=config.rms_norm_eps,
            partial_rotary_factor=rope["partial_rotary_factor"], attention_qkv_bias=config.attention_bias,
            attention_type="mha", use_q_gate=True, rms_norm_add_unit_offset=True,
            linear_conv_kernel_dim=config.linear_conv_kernel_dim, linear_key_head_dim=config.linear_key_head_dim,
            linear_value_head_dim=config.linear_value_head_dim, linear_num_key_heads=config.linear_num_key_heads,
            linear_num_value_heads=config.linear_num_value_heads, layer_types=list(config.layer_types),
        )
    ffn = next(m for m in model.modules() if type(m).__name__ == "Lfm2MLP").w1.out_features  # after auto-adjust
    return dict(common, ffn_dim_multiplier=1, hidden_dim=ffn, norm_eps=config.norm_eps,
                layer_types=list(config.layer_types))


def export_example(bench: HybridBench, row: Row, filename: str, dynamic: bool | None = None) -> tuple[Path, bool]:
    """Export the family's ExecuTorch example on the transformers model's weights; returns the .pte and whether it
    takes a dynamic prompt length. `dynamic` overrides the example's `model.enable_dynamic_shape`."""
    import importlib

    from executorch.examples.models.llama.export_llama_lib import export_llama
    from executorch.extension.llm.export.config.llm_config import LlmConfig
    from omegaconf import OmegaConf

    family = FAMILIES[bench.family]
    example = importlib.import_module(f"executorch.examples.models.{family.example}")
    # No "8da4w" or "int8" in the checkpoint's path: the example's Llama2Model takes such a checkpoint for a
    # pre-quantized one (and swaps every linear for a quantized module before loading it).
    work = Path(tempfile.mkdtemp(prefix=f"{row.key}_example_", dir=bench.out_dir))
    model = build_model(bench)
    (work / "params.json").write_text(json.dumps(example_params(bench, model), indent=1))
    with contextlib.redirect_stdout(sys.stderr):
        model.save_pretrained(work / "hf")  # safetensors, without the tied lm_head: what convert_weights reads
        del model
        gc.collect()
        start = time.perf_counter()
        example.convert_weights(str(work / "hf"), str(work / "checkpoint.pth"))
        convert_s = time.perf_counter() - start
    overrides: dict[str, Any] = {
        "base": {"model_class": family.example_model_class, "params": str(work / "params.json"),
                 "checkpoint": str(work / "checkpoint.pth")},
        "export": {"max_seq_length": bench.shape.max_seq_len, "max_context_length": bench.shape.max_seq_len,
                   "output_dir": str(work), "output_name": str(bench.out_dir / filename)},
    }
    if bench.quantize:
        overrides["quantization"] = {"qmode": bench.quantize, "group_size": bench.group_size}
    if dynamic is not None:
        overrides["model"] = {"enable_dynamic_shape": dynamic}
    yaml = Path(example.__file__).parent / "config" / family.example_yamls[bench.quantize]
    merged = OmegaConf.merge(OmegaConf.structured(LlmConfig), OmegaConf.load(yaml), OmegaConf.create(overrides))
    llm_config = OmegaConf.to_object(merged)  # as export_llm's hydra_main builds it
    dynamic_shape = llm_config.model.enable_dynamic_shape
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        path = Path(export_llama(llm_config))
    row.export_s = time.perf_counter() - start
    row.pte_mb = pte_megabytes(path)
    shutil.rmtree(work / "hf", ignore_errors=True)  # the checkpoint copies are as large as the model
    (work / "checkpoint.pth").unlink(missing_ok=True)
    overridden = [f"qmode={bench.quantize}, group_size={bench.group_size}"] if bench.quantize else []
    overridden += [] if dynamic is None else [f"enable_dynamic_shape={dynamic}"]
    notes = [" + ".join([yaml.name, *overridden]), f"convert_weights {convert_s:.0f} s not in export s"]
    if not dynamic_shape:
        notes.append("static [1,1] shapes: prefill token by token")
    if not family.example_resets_state:
        notes.append("state not cleared at input_pos 0: each sequence on a newly loaded program")
    row.note = "; ".join(notes)
    return path, dynamic_shape


def example_driver(bench: HybridBench, path: Path, dynamic_shape: bool) -> Driver:
    if FAMILIES[bench.family].example_resets_state:
        return TokensPosDriver(path, token_by_token=not dynamic_shape)
    return ReloadingDriver(path, token_by_token=not dynamic_shape)


def gemma4_example_config(bench: HybridBench) -> Any:
    """The example's `Gemma4Config` for the transformers model of `bench` (the fields its `from_json` reads)."""
    from executorch.examples.models.gemma4.text_decoder.gemma4_config import Gemma4Config

    config, fields = hf_config(bench), config_fields(bench)
    rope = config.rope_parameters
    return Gemma4Config(
        hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=fields["head_dim"], global_head_dim=fields["global_head_dim"], vocab_size=config.vocab_size,
        intermediate_size=config.intermediate_size, use_double_wide_mlp=config.use_double_wide_mlp,
        rms_norm_eps=config.rms_norm_eps, rope_theta=rope["full_attention"]["rope_theta"],
        rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
        partial_rotary_factor=rope["full_attention"]["partial_rotary_factor"], sliding_window=config.sliding_window,
        layer_types=list(config.layer_types), final_logit_softcapping=config.final_logit_softcapping,
        hidden_size_per_layer_input=config.hidden_size_per_layer_input,
        vocab_size_per_layer_input=config.vocab_size_per_layer_input,
        num_kv_shared_layers=config.num_kv_shared_layers, tie_word_embeddings=True,
    )


def export_gemma4_example(bench: HybridBench, row: Row, filename: str) -> Path:
    """ExecuTorch's Gemma 4 example (`export_gemma4.export_single_pte`, text decoder only) on the transformers
    model's weights, saved as the multimodal checkpoint its `convert_weights` reads (`model.language_model.*`). The
    example takes its config from a file of its own per variant, which the installed package does not ship:
    `Gemma4Config.from_config` is pointed at `gemma4_example_config` instead."""
    from unittest import mock

    from executorch.examples.models.gemma4 import export_gemma4
    from executorch.examples.models.gemma4.text_decoder.gemma4_config import Gemma4Config
    from safetensors.torch import save_file

    if bench.shape.max_seq_len < FAMILIES[bench.family].min_context:
        raise Unavailable(f"export_gemma4 traces a 770-token example: needs --max-seq-len >= "
                          f"{FAMILIES[bench.family].min_context}, got {bench.shape.max_seq_len}")
    work = Path(tempfile.mkdtemp(prefix=f"{row.key}_example_", dir=bench.out_dir))
    model = build_model(bench)
    state = {("model.language_model." + k.removeprefix("model.")): v.contiguous()
             for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: the example copies the embedding
    save_file(state, str(work / "model.safetensors"))
    del model, state
    gc.collect()
    config = gemma4_example_config(bench)
    path = bench.out_dir / filename
    start = time.perf_counter()
    with mock.patch.object(Gemma4Config, "from_config", classmethod(lambda cls, variant="e2b": config)), \
            contextlib.redirect_stdout(sys.stderr):
        export_gemma4.export_single_pte(
            str(work), str(path), text_quantize=bench.quantize or "none", max_seq_len=bench.shape.max_seq_len,
            group_size=bench.group_size, include_audio=False, include_vision=False,
        )
    row.export_s = time.perf_counter() - start
    row.pte_mb = pte_megabytes(path)
    shutil.rmtree(work, ignore_errors=True)
    quantized = f" + text_quantize={bench.quantize}, group_size={bench.group_size}" if bench.quantize else ""
    row.note = (f"export_single_pte(include_audio=False, include_vision=False){quantized}: method text_decoder, "
                "custom SDPA, a full-context cache for sliding layers too")
    return path


class Gemma4ExampleDriver(RebuiltWhenPickled):
    """The `text_decoder` method of ExecuTorch's Gemma 4 example: `(input_ids [1, T], input_pos [T],
    inputs_embeds [1, T, hidden])` -> the last position's logits, zero embeddings for text (run_gemma4.py's call)."""

    def __init__(self, path: Path, hidden_size: int):
        self.method = load_method(path, "text_decoder")
        self.hidden_size = hidden_size

    def _step(self, tokens: list[int], pos: int) -> int:
        n = len(tokens)
        inputs = [torch.tensor([tokens], dtype=torch.long), torch.arange(pos, pos + n, dtype=torch.long),
                  torch.zeros(1, n, self.hidden_size)]
        (logits,) = run_method(self.method, inputs)
        return argmax_last(logits)

    def prefill(self, prompt: list[int]) -> int:
        return self._step(prompt, 0)

    def decode(self, token: int, pos: int) -> int:
        return self._step([token], pos)


def example_family(bench: HybridBench) -> Family:
    """The bench's family, when ExecuTorch has an example of it (else the row is unavailable)."""
    family = FAMILIES[bench.family]
    if family.example is None:
        from executorch.version import __version__

        raise Unavailable(f"ExecuTorch {__version__} has no example of {family.label} (no {family.key} model)")
    return family


def path_example(bench: HybridBench, row: Row) -> Driver:
    """(b) ExecuTorch's example of the family, as its README's export_llm command exports it (module docstring);
    Gemma 4's as its export script does (`export_gemma4_example`)."""
    example_family(bench)
    if bench.family == GEMMA4.key:
        path = export_gemma4_example(bench, row, f"b_example_{tag(bench)}.pte")
        return Gemma4ExampleDriver(path, bench.shape.hidden)
    path, dynamic_shape = export_example(bench, row, f"b_example_{tag(bench)}.pte")
    return example_driver(bench, path, dynamic_shape)


def path_example_dynamic(bench: HybridBench, row: Row) -> Driver:
    """(d) (b) with `model.enable_dynamic_shape=True`, for an example whose config exports static shapes."""
    family = example_family(bench)
    if family.example_dynamic:
        raise Unavailable(f"{family.key}'s example already exports a dynamic prompt length: row (b)")
    path, dynamic_shape = export_example(bench, row, f"d_example_dynamic_{tag(bench)}.pte", dynamic=True)
    return example_driver(bench, path, dynamic_shape)


def path_hf_exporter(bench: HybridBench, row: Row) -> Driver:
    """(c) transformers `ExecutorchExporter().export_for_generation`, one export per prompt length (its prefill is
    static); decode.py's row (d) with the hybrid's inputs (`ExporterDriver`)."""
    from transformers import GenerationConfig
    from transformers.exporters import ExecutorchExporter
    from transformers.exporters.configs import ExecutorchConfig

    model = build_model(bench)
    dirs, start = {}, time.perf_counter()
    model = quantize_for_transformers_export(model, bench)  # once, for every prompt length
    for n, prompt in sorted(bench.prompts.items()):
        ids = torch.tensor([prompt], dtype=torch.long)
        out = bench.out_dir / f"c_hf_exporter_{tag(bench)}_{n}"
        try:
            with contextlib.redirect_stdout(sys.stderr):
                exported = ExecutorchExporter().export_for_generation(
                    model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                    config=ExecutorchConfig(backend="xnnpack"),
                    generation_config=GenerationConfig(cache_implementation="static",
                                                       max_cache_len=bench.shape.max_seq_len),
                )
                exported.save_pretrained(out)
        except Exception as e:  # the row says why it does not export, in one line
            raise Unavailable(one_line(e)) from e
        dirs[n] = out
        del exported
        gc.collect()
    del model
    row.export_s = time.perf_counter() - start
    first = min(dirs)
    row.pte_mb = pte_megabytes(dirs[first] / "prefill.pte", dirs[first] / "decode.pte")
    exports = f"{len(dirs)} export{'s' * (len(dirs) > 1)}"
    row.note = (f"prefill.pte per prompt length ({exports}, all in export s; .pte MB: one prefill + decode, each with "
                f"all weights); full prefill logits; state passed in and out")
    if bench.quantize:
        row.note += "; torchao weights unwrapped (unwrap_tensor_subclass) for its model.to()"
    return ExporterDriver(dirs, bench.shape.max_seq_len)


def path_hf_static_cache(bench: HybridBench, row: Row) -> Driver:
    """(e) transformers `TorchExportableModuleForDecoderOnlyLM` (decode.py's row b). Its StaticCache wrapper is tried
    on the fp32 model first: when transformers cannot build it for these layers, nothing is quantized for nothing."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    try:
        probe = build_model(bench)
        probe.generation_config.cache_implementation = "static"
        TorchExportableModuleForDecoderOnlyLM(probe, batch_size=1, max_cache_len=bench.shape.max_seq_len)
        del probe
        return export_hf_static(bench, row, build_export_model, "e_hf_static.pte")
    except Exception as e:  # the row says why it does not export, in one line
        raise Unavailable(one_line(e)) from e


def build_eager_model(bench: HybridBench) -> torch.nn.Module:
    """Row (g)'s model: the eager reference model of the setting (quantized as etblocks quantizes for 8da4w)."""
    return build_reference_model(bench, reference_scheme("g", bench.quantize))


def path_eager(bench: HybridBench, row: Row) -> Driver:
    """(g) the transformers model in eager PyTorch with its own cache (nothing exported): the speed a user of plain
    transformers gets on this CPU."""
    row.note = "no export" + (f"; torchao {bench.quantize} tensors in eager PyTorch" if bench.quantize else "")
    return EagerDriver(build_eager_model, bench)


PATHS: list[PathSpec] = [
    PathSpec("a", "etblocks xnnpack", path_etblocks),
    PathSpec("b", "ExecuTorch example", path_example),
    PathSpec("c", "transformers ExecutorchExporter", path_hf_exporter),
    PathSpec("d", "ExecuTorch example, dynamic shape", path_example_dynamic),
    PathSpec("e", "transformers static-cache export", path_hf_static_cache),
    PathSpec("f", "etblocks xnnpack, chunked delta rule", path_etblocks_chunked),
    PathSpec("g", "transformers eager", path_eager, default=False),
]


# --------------------------------------------------------------------------------------------------
# One quantization setting: references, exports, timing per prompt length


def memory_available() -> float:
    """MemAvailable of /proc/meminfo in bytes (inf when unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def in_own_process(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a newly spawned process that ends with it. Exports run so: what one leaves allocated
    (the parent process held 13.6 GB after the Qwen3.5 exports of a 2-layer run made in it) goes with its process,
    and a process killed for memory raises here (`BrokenProcessPool`) where a `multiprocessing.Pool` would wait."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def _prepare(key: str, bench: HybridBench) -> tuple[Row, tuple | None]:
    """`prepare_path` of row `key` (export, load, warm up); returns the row and its driver's constructor call."""
    row, driver = prepare_path(next(p for p in PATHS if p.key == key), bench)
    return row, (driver.__reduce__() if driver is not None else None)


def prepare_in_own_process(spec: PathSpec, bench: HybridBench) -> tuple[Row, tuple | None]:
    try:
        return in_own_process(_prepare, spec.key, bench)
    except Exception as e:  # the export's process died (out of memory?) or could not start
        return Row(spec.key, spec.name, status=f"failed: export process: {one_line(e)}"), None


def reference_tokens(bench: HybridBench, schemes: Sequence[str]) -> dict[str, dict[int, list[int]]]:
    """The eager reference model's greedy tokens (`build_reference_model`) per scheme and prompt length; each model
    is built (and quantized: minutes for a 248k-row lm_head) once for every prompt."""
    tokens = {}
    for scheme in schemes:
        model = build_reference_model(bench, scheme)
        tokens[scheme] = {n: eager_reference_tokens(dataclasses.replace(bench, prompt=p), lambda _, m=model: m)
                          for n, p in sorted(bench.prompts.items())}
        del model
        gc.collect()
    return tokens


@dataclass
class Outcome:
    """One quantization setting's results: rows and bandwidths per prompt length, reference tokens per scheme and
    prompt length."""

    quantize: str | None
    rows: dict[int, list[Row]]
    bandwidths: dict[int, list[float]]
    references: dict[str, dict[int, list[int]]]
    one_at_a_time: bool
    program_mb: float

    def reference(self, key: str, n: int) -> list[int]:
        """The tokens row `key` is compared with for the `n`-token prompt."""
        return self.references[reference_scheme(key, self.quantize)][n]

    def reference_by_row(self, n: int) -> dict[str, list[int]]:
        return {row.key: self.reference(row.key, n) for row in self.rows[n]}


def run_setting(bench: HybridBench, specs: Sequence[PathSpec], keep_files: bool, load: str) -> Outcome:
    """Reference tokens, every row's export (each in its own process, loaded and warmed up once there), then each
    prompt length timed in its own fresh process. `load`: "together", "one-at-a-time" or "auto" (one at a time when
    the programs would take more than half the available memory)."""
    log(f"{tag(bench)}: eager reference tokens")
    schemes = sorted({reference_scheme(spec.key, bench.quantize) for spec in specs})
    references = in_own_process(reference_tokens, bench, schemes)
    deferred: list[tuple[Row, Any]] = []
    for spec in specs:
        log(f"{tag(bench)}: ({spec.key}) {spec.name}")
        row, construction = prepare_in_own_process(spec, bench)
        deferred.append((row, Deferred(construction) if construction is not None else None))
    program_mb = sum(row.pte_mb or 0 for row, d in deferred if d is not None)
    one_at_a_time = load == "one-at-a-time" or (load == "auto" and program_mb * 1e6 * 1.3 > 0.5 * memory_available())
    rows, bandwidths = {}, {}
    try:
        for n, prompt in sorted(bench.prompts.items()):
            log(f"{tag(bench)}: timing the {n}-token prompt in a fresh process"
                f"{' (one program at a time)' if one_at_a_time else ''}")
            prepared = [(copy.deepcopy(row), (OneAtATime(d.construction) if one_at_a_time else d) if d else None)
                        for row, d in deferred]
            rows[n], bandwidths[n] = time_in_fresh_process(prepared, dataclasses.replace(bench, prompt=prompt),
                                                           warm_prefill=True)
    finally:
        if not keep_files:
            shutil.rmtree(bench.out_dir, ignore_errors=True)
    return Outcome(bench.quantize, rows, bandwidths, references, one_at_a_time, program_mb)


# --------------------------------------------------------------------------------------------------
# Report


def check_outcome(outcome: Outcome, min_match: int, checks: Checks) -> None:
    """A token check per row and prompt (fp32: every token must agree; 8da4w: the first `min_match`), and a failure
    per failed row."""
    for n, rows in outcome.rows.items():
        for row in rows:
            reference = outcome.reference(row.key, n)
            required = len(reference) if outcome.quantize is None else min(min_match, len(reference))
            where = f"({row.key}) {row.name}, {tag_of(outcome.quantize)}, {n}-token prompt"
            if row.status.startswith("failed"):
                checks.fail(f"{where}: {row.status}")
                continue
            if row.status != "ok":
                continue
            label = "eager" if outcome.quantize is None else f"eager {outcome.quantize}"
            check = checks.add(check_tokens(row.key, row.tokens, reference, label, required, note=where))
            if check.ok and check.first_difference is not None:
                print(f"  differs after the required {required}: {check.describe()}")


def tag_of(quantize: str | None) -> str:
    return quantize or "fp32"


def format_outcome(outcome: Outcome, bench: HybridBench, title: str, model_line: str) -> tuple[str, float]:
    """describe_run's header and format_table's table for one quantization setting (first prompt length in the main
    columns, the others as extra columns); returns the text and the roofline tok/s."""
    lengths = sorted(outcome.rows)
    first = lengths[0]
    rows = outcome.rows[first]
    extra_headers = []
    for n in lengths[1:]:
        headers = (f"decode@{n} tok/s", f"prefill@{n} tok/s", f"tokens@{n}")
        extra_headers += headers
        by_key = {r.key: r for r in outcome.rows[n]}
        for row in rows:
            other = by_key[row.key]
            if other.status != "ok":
                row.extras.update(dict.fromkeys(headers, "failed" if other.status.startswith("failed") else "-"))
                continue
            row.extras[headers[0]] = f"{statistics.median(other.decode_runs):.1f}"
            row.extras[headers[1]] = f"{statistics.median(other.prefill_runs):.0f}"
            reference = outcome.reference(row.key, n)
            row.extras[headers[2]] = f"{matching_prefix(other.tokens, reference)}/{len(reference)}"
    fp32_bytes = weight_bytes_per_token(bench, None)
    quantized_bytes = weight_bytes_per_token(bench, outcome.quantize)
    bandwidths = outcome.bandwidths[first]
    roofline = statistics.median(bandwidths) / quantized_bytes if bandwidths else float("nan")
    header = describe_run(title, dataclasses.replace(bench, prompt=bench.prompts[first]), bandwidths or [float("nan")],
                          model=model_line, weight_bytes=fp32_bytes).rstrip("\n")
    lines = [header]
    if outcome.quantize:
        lines.append(f"this table's roofline: the same bandwidth / {quantized_bytes / 1e6:.1f} MB of "
                     f"{outcome.quantize} linears (group {bench.group_size}, bf16 scales) = {roofline:.1f} tok/s")
    lines.append(f"programs: {outcome.program_mb:.0f} MB in all, "
                 + ("loaded one at a time (each before its turn in a round, untimed)" if outcome.one_at_a_time
                    else "all loaded together"))
    if len(lengths) > 1:
        other_bandwidth = statistics.median(outcome.bandwidths[lengths[-1]] or [float("nan")]) / 1e9
        lines.append(f"main columns: the {first}-token prompt; @N columns: the N-token prompt (its own fresh process, "
                     f"bandwidth {other_bandwidth:.1f} GB/s)")
    ref_key = next((r.key for r in rows if r.key == "a" and r.status == "ok"),
                   next((r.key for r in rows if r.status == "ok"), "a"))
    label = "eager" if outcome.quantize is None else f"eager {outcome.quantize}"
    lines.append("")
    lines.append(format_table(rows, roofline, outcome.reference_by_row(first), ref_key=ref_key, reference_label=label,
                              extra_headers=extra_headers))
    notes = [f"  ({r.key}) {r.note}" for r in rows if r.note and r.status == "ok"]
    if outcome.quantize:
        schemes = {"etblocks": "etblocks' torchao config", "example": "ExecuTorch's quantize(), scales rounded to bf16"}
        by_scheme = {}
        for row in rows:
            by_scheme.setdefault(reference_scheme(row.key, outcome.quantize), []).append(f"({row.key})")
        notes.append(f"  tokens={label}: the eager transformers model quantized as the row quantizes: "
                     + "; ".join(f"{' '.join(keys)} {schemes[s]}" for s, keys in by_scheme.items()))
    if notes:
        lines.append("notes:\n" + "\n".join(notes))
    return "\n".join(lines), roofline


def row_record(outcome: Outcome, key: str) -> dict:
    rows_by_prompt = outcome.rows
    first = next(r for r in rows_by_prompt[min(rows_by_prompt)] if r.key == key)
    record = {"key": key, "name": first.name, "status": first.status, "export_s": first.export_s,
              "pte_mb": first.pte_mb, "note": first.note, "prompts": {}}
    for n, rows in rows_by_prompt.items():
        row = next(r for r in rows if r.key == key)
        record["prompts"][str(n)] = {
            "status": row.status, "decode_tps": row.decode_tps, "prefill_tps": row.prefill_tps,
            "decode_runs": row.decode_runs, "prefill_runs": row.prefill_runs, "tokens": row.tokens,
            "reference": reference_scheme(key, outcome.quantize),
            "tokens_agreeing": matching_prefix(row.tokens, outcome.reference(key, n)) if row.tokens else None,
            "timings": {"decode_tps": spread_record(row.decode_runs), "prefill_tps": spread_record(row.prefill_runs)},
        }
    return record


# --------------------------------------------------------------------------------------------------
# Main


SMOKE = {"family": "qwen3_5", "shape": "tiny", "layers": 2, "rows": "f,g", "quantize": "none", "rounds": 1,
         "prompts": "8", "decode_steps": 4, "max_seq_len": 32}


def parse_args(argv: Sequence[str] | None) -> Any:
    parser = argument_parser(PATHS, __doc__, shapes=("family", "tiny"))
    parser.add_argument("--family", choices=sorted(FAMILIES), default=None, help="required (--smoke: qwen3_5)")
    parser.add_argument("--prompts", default="64,256", help="comma-separated prompt lengths, each timed")
    parser.add_argument("--quantize", default="none,8da4w", help="comma-separated: none (fp32), 8da4w")
    parser.add_argument("--group-size", type=int, default=32, help="8da4w's group size (every row)")
    parser.add_argument("--quantized-min-match", type=int, default=1,
                        help="leading greedy tokens an 8da4w row must share with the eager 8da4w model")
    parser.add_argument("--load", choices=("auto", "together", "one-at-a-time"), default="auto",
                        help="the timing process holds every row's program, or one at a time (auto: one at a time when "
                             "they would take more than half the available memory)")
    parser.set_defaults(layers=None, max_seq_len=None, prompt_len=None)
    add_run_args(parser, "hybrid", SMOKE)
    args = parse_with_smoke(parser, argv, SMOKE)
    if args.family is None:
        parser.error("--family is required")
    args.max_seq_len = args.max_seq_len or FAMILIES[args.family].context
    args.prompt_lengths = [args.prompt_len] if args.prompt_len else [int(p) for p in args.prompts.split(",") if p]
    args.quantize_modes = [None if q.strip() == "none" else q.strip() for q in args.quantize.split(",") if q.strip()]
    unknown = [q for q in args.quantize_modes if q not in (None, "8da4w")]
    if unknown:
        raise SystemExit(f"unknown --quantize {unknown}: none, 8da4w")
    if max(args.prompt_lengths) + args.decode_steps + 3 > args.max_seq_len:
        raise SystemExit(f"--max-seq-len {args.max_seq_len} is too short for a {max(args.prompt_lengths)}-token "
                         f"prompt and {args.decode_steps} decode steps")
    return args


def make_hybrid_bench(args: Any) -> tuple[HybridBench, bool]:
    """The settings, every prompt (prefixes of one seeded random prompt), and whether the cut of the layers made
    its last one full_attention."""
    family = FAMILIES[args.family]
    layer_types, made_full = cut_layer_types(family, args.layers)
    generator = torch.Generator().manual_seed(args.seed)
    bench = HybridBench(Shape(), [], args.decode_steps, args.rounds, Path(), args.seed, args.init_range,
                        family=family.key, tiny=args.shape == "tiny", layer_types=layer_types, group_size=args.group_size)
    config = hf_config(bench)
    longest = torch.randint(1, config.vocab_size, (max(args.prompt_lengths),), generator=generator).tolist()
    prompts = {n: longest[:n] for n in sorted(set(args.prompt_lengths))}
    # from the fields, not the config: Gemma 4's config keeps head_dim per layer and raises for one value
    head_dim = config_fields(bench).get("head_dim") or config.hidden_size // config.num_attention_heads
    shape = Shape(layers=len(layer_types), hidden=config.hidden_size, heads=config.num_attention_heads,
                  kv_heads=config.num_key_value_heads, head_dim=head_dim, intermediate=config.intermediate_size,
                  vocab=config.vocab_size, max_seq_len=args.max_seq_len)
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="etblocks_hybrid_bench_"))
    bench = dataclasses.replace(bench, shape=shape, prompt=prompts[args.prompt_lengths[0]], prompts=prompts,
                                out_dir=out_dir)
    return bench, made_full


def describe_model(bench: HybridBench, made_full: bool) -> str:
    family = FAMILIES[bench.family]
    config = hf_config(bench)
    counts = {k: bench.layer_types.count(k) for k in dict.fromkeys(bench.layer_types)}
    layers = ", ".join(f"{v} {k}" for k, v in counts.items())
    cut = ""
    if len(bench.layer_types) < len(family.layer_types):
        cut = f", the first {len(bench.layer_types)} of {len(family.layer_types)}"
        cut += " (the last made full_attention)" if made_full else ""
    s = bench.shape
    label = f"tiny {family.key}" if bench.tiny else f"{family.label} shape"
    return (f"{label} ({config.model_type}): {s.layers} layers ({layers}{cut}), hidden {s.hidden}, "
            f"{s.heads}/{s.kv_heads} heads (head_dim {s.head_dim}), vocab {s.vocab}, tied embedding, fp32, random "
            f"weights (seed {bench.seed}, init std {bench.init_range})")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    specs = select_paths(args.rows, PATHS)
    bench, made_full = make_hybrid_bench(args)
    model_line = describe_model(bench, made_full)
    table, state_figures = state_table(bench)
    print(f"\nState per layer, {FAMILIES[bench.family].label}, fp32, against a full-attention K/V cache "
          f"(from the config, `state_bytes`)\n{table}\n", flush=True)

    outcomes, texts, checks = [], {}, Checks()
    for quantize in args.quantize_modes:
        setting = dataclasses.replace(bench, quantize=quantize,
                                      out_dir=bench.out_dir / ("fp32" if quantize is None else "quantized"))
        setting.out_dir.mkdir(parents=True, exist_ok=True)
        outcome = run_setting(setting, specs, keep_files=args.out_dir is not None, load=args.load)
        title = f"Hybrid decode paths, XNNPACK, {tag_of(quantize)}"
        title += f" (group {args.group_size})" if quantize else ""
        text, roofline = format_outcome(outcome, setting, title, model_line)
        print(text, flush=True)
        texts[tag_of(quantize)] = text
        setting_checks = Checks()
        check_outcome(outcome, args.quantized_min_match, setting_checks)
        checks.items += setting_checks.items
        checks.failures += setting_checks.failures
        outcomes.append((outcome, roofline, setting_checks))
    if args.out_dir is None:
        shutil.rmtree(bench.out_dir, ignore_errors=True)

    wall_s = time.perf_counter() - _STARTED
    entry = {
        "family": bench.family, "layers": len(bench.layer_types), "layer_types": list(bench.layer_types),
        "model": model_line, "config": hf_config(bench).to_dict(), "context": bench.shape.max_seq_len,
        "prompts": sorted(bench.prompts), "decode_steps": bench.decode_steps, "rounds": bench.rounds,
        "group_size": args.group_size, "rows": args.rows, **run_info(), "args": args_record(args),
        "state_bytes": state_figures, "wall_s": wall_s, "checks": checks.records(), "problems": checks.problems(),
        "ok": checks.ok,
        "settings": {
            tag_of(o.quantize): {
                "roofline_tps": roofline, "one_at_a_time": o.one_at_a_time, "program_mb": o.program_mb,
                "bandwidths_gbs": {str(n): [b / 1e9 for b in bw] for n, bw in o.bandwidths.items()},
                "reference_tokens": {scheme: {str(n): tokens for n, tokens in per.items()}
                                     for scheme, per in o.references.items()},
                "rows": [row_record(o, r.key) for r in o.rows[min(o.rows)]],
                "checks": c.records(), "problems": c.problems(),
            } for o, roofline, c in outcomes
        },
        "tables": texts,
    }
    full = len(bench.layer_types) == len(FAMILIES[bench.family].layer_types)
    key = bench.family if full else f"{bench.family} ({len(bench.layer_types)} layers)"
    key = f"tiny {key}" if bench.tiny else key
    key = f"smoke {key}" if args.smoke else host_key(key)
    # Runs of one entry merge: `--quantize none`, then `--quantize 8da4w`, fill one entry.
    write_results(args.out, key, entry, merge=("settings", "tables"))
    print(f"\nresults: {args.out} (entry {key!r}); wall time {wall_s / 60:.1f} min")
    print(checks.report())
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
