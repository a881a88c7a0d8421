"""What the benchmarks share: settings, timing, statistics, token checks, the CPU, tables and results files.

Timing: rows are exported first, then loaded anew in a fresh process (`time_in_fresh_process` says why) and timed
there in interleaved rounds (a, b, c, a, b, c, ...); a figure is the median of its rounds with the range [min-max],
a ratio the median of per-round ratios (`paired_median`). Correctness: `check_tokens` / `check_values` compare a
row's outputs with the script's reference and `Checks` makes the script exit 1 when one disagrees (printing the
row and the first differing index); `ETBLOCKS_BENCH_BREAK_ROW=<key>[,<key>]` corrupts those rows' outputs inside
the check, so that the failure path can be tested. Results: `write_results` records one entry per run setting in
`benchmarks/results/<script>.json` (`run_info`: git commit, package versions, CPU and its vector flags), which
`render.py` turns into the tables of docs/benchmarks.md.

Not a benchmark: the scripts import it (`benchmarks/` is not a package; Python puts a script's folder first on
sys.path).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from etblocks.export.runner import run_method
from etblocks.export.sampling import greedy_token
from etblocks.ops import load_kernels
from etblocks.threads import BLAS_THREADS_ENV, prefer_single_threaded_blas
from sweeps import git_commit

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BREAK_ROW_ENV = "ETBLOCKS_BENCH_BREAK_ROW"
GROUP_SIZE = 32  # 8da4w's group size in quant.py, decode_profile.py and step_breakdown.py

# --------------------------------------------------------------------------------------------------
# Shape, settings and results


@dataclass(frozen=True)
class Shape:
    """The model shape (SmolLM2-135M by default) and the context length."""

    name: str = "SmolLM2-135M"
    layers: int = 30
    hidden: int = 576
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    intermediate: int = 1536
    vocab: int = 49152
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 100000.0

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(out, in) features of each linear in one decoder layer: q, k, v, o, gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(q, self.hidden), (kv, self.hidden), (kv, self.hidden), (self.hidden, q),
                (self.intermediate, self.hidden), (self.intermediate, self.hidden), (self.hidden, self.intermediate)]

    def weight_bytes_per_token(self, bytes_per_param: int = 4) -> int:
        """Weight bytes one decoded token reads: every linear plus the lm_head (the tied embedding counts once,
        as lm_head; the embedding row gather, norms and KV cache are left out)."""
        linears = sum(out_features * in_features for out_features, in_features in self.linear_shapes())
        return (linears * self.layers + self.vocab * self.hidden) * bytes_per_param


# `--shape`: the benchmark's model, or a tiny one whose exports take seconds (`--smoke`: to show the script works)
SHAPES = {"smollm2-135m": Shape(), "tiny": Shape(name="tiny", hidden=64, heads=4, kv_heads=2, head_dim=16,
                                                 intermediate=128, vocab=512)}


def add_shape_arg(parser: argparse.ArgumentParser, choices: Sequence[str] = tuple(SHAPES)) -> None:
    """`--shape`: the first of `choices` by default; "tiny" (hidden 64, vocab 512) is what `--smoke` uses."""
    parser.add_argument("--shape", choices=choices, default=choices[0],
                        help="model shape: " + ", ".join(choices) + " (tiny: hidden 64, vocab 512, for quick runs)")


def make_shape(args: argparse.Namespace, **changes: Any) -> Shape:
    """`--shape` with `changes` (e.g. `layers`, `max_seq_len`) applied."""
    return dataclasses.replace(SHAPES[args.shape], **changes)


@dataclass
class Bench:
    """Settings shared by every row."""

    shape: Shape
    prompt: list[int]
    decode_steps: int
    rounds: int
    out_dir: Path
    seed: int
    init_range: float


class Unavailable(Exception):
    """A path that cannot run here (e.g. not implemented yet); the row shows the reason."""


@dataclass
class Row:
    """One row of the table, filled in by its path function; `status` is "ok" or why it has no numbers."""

    key: str
    name: str
    status: str = "ok"
    export_s: float | None = None
    pte_mb: float | None = None
    decode_runs: list[float] = field(default_factory=list)  # tok/s, one per round
    prefill_runs: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    note: str = ""
    extras: dict[str, str] = field(default_factory=dict)  # more table cells, by column header (`format_table`)

    @property
    def decode_tps(self) -> float | None:
        """Median decode tok/s over the rounds."""
        return statistics.median(self.decode_runs) if self.decode_runs else None

    @property
    def prefill_tps(self) -> float | None:
        """Median prefill tok/s over the rounds."""
        return statistics.median(self.prefill_runs) if self.prefill_runs else None


class Driver(Protocol):
    """Runs a loaded model one greedy step at a time; both calls return the argmax next token. A driver whose
    model cannot start a new sequence by itself (e.g. its KV cache appends at a write position it keeps) may also
    define `reset()`, which `reset_driver` calls, untimed, before every prefill."""

    def prefill(self, prompt: list[int]) -> int: ...

    def decode(self, token: int, pos: int) -> int: ...


def reset_driver(driver: Driver) -> None:
    """Call the driver's optional `reset()` (see `Driver`)."""
    reset = getattr(driver, "reset", None)
    if reset is not None:
        reset()


# --------------------------------------------------------------------------------------------------
# Shared helpers


def llama_config(bench: Bench, rope_parameters: dict[str, Any] | None = None, max_positions: int = 8192) -> Any:
    """A transformers LlamaConfig with the benchmark shape; rope: default with the shape's theta unless given."""
    from transformers import LlamaConfig

    s = bench.shape
    return LlamaConfig(
        num_hidden_layers=s.layers,
        hidden_size=s.hidden,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate,
        vocab_size=s.vocab,
        tie_word_embeddings=True,
        rms_norm_eps=s.norm_eps,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": s.rope_theta},
        max_position_embeddings=max_positions,
        initializer_range=bench.init_range,
        pad_token_id=0,
    )


def build_hf_model(bench: Bench) -> torch.nn.Module:
    """A transformers LlamaForCausalLM with the benchmark shape and seeded random weights (fp32, eval)."""
    from transformers import LlamaForCausalLM

    config = llama_config(bench)
    torch.manual_seed(bench.seed)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def pte_megabytes(*paths: Path) -> float:
    """Total size of the given files in MB (1e6 bytes)."""
    return sum(Path(p).stat().st_size for p in paths) / 1e6


def argmax_last(logits: torch.Tensor) -> int:
    """Greedy token from logits shaped [..., vocab] (the last position if there are several), as etblocks' Runner
    picks it (numpy's argmax: torch's costs ~3% of a 4-bit decode step at this shape)."""
    return greedy_token(logits.reshape(-1, logits.shape[-1])[-1])


def load_runtime_program(path: Path, **program_options: Any) -> Any:
    """A .pte loaded by the Python ExecuTorch runtime, with its weights' data file (`<stem>.ptd`, where `export`
    writes a tied model's weights) when there is one. `program_options` go to `Runtime.load_program`."""
    from executorch.runtime import Runtime

    from etblocks.export.external import weights_file

    data = weights_file(path)
    if data.is_file():
        program_options = {"data_path": str(data), **program_options}
    return Runtime.get().load_program(Path(path), **program_options)


def load_method(path: Path, name: str = "forward", **program_options: Any) -> Any:
    """Load one method of a .pte with the Python ExecuTorch runtime (with the kernels etblocks' Runner registers).
    The method keeps a reference to its program: a method whose program was freed fails intermittently at run
    time. `program_options` go to `Runtime.load_program` (e.g. `enable_etdump=True`)."""
    load_kernels()
    program = load_runtime_program(Path(path), **program_options)
    method = program.load_method(name)
    method.etblocks_program = program
    return method


def lower_to_xnnpack(exported: Any, path: Path, inspect: Callable[[Any], Any] | None = None,
                     **to_executorch_kwargs: Any) -> Any:
    """Lower an ExportedProgram to XNNPACK and write the .pte. `inspect`, when given, is called with the lowered
    EdgeProgramManager before `to_executorch` (which rewrites its graphs in place), and its result is returned
    (e.g. `lambda edge: summarize(edge.exported_program().graph_module)`)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    inspected = inspect(edge) if inspect is not None else None
    program = edge.to_executorch(**to_executorch_kwargs)
    with open(path, "wb") as f:
        program.write_to_file(f)
    return inspected


def lower_llm_manager(manager: Any, partitioners: list[Any], path: Path, passes: list[Any] | None = None,
                      inspect: Callable[[Any], Any] | None = None) -> Any:
    """Take an ExecuTorch `LLMEdgeManager` through the steps export_llama_lib runs for XNNPACK: strict export,
    canonical optimizations, `to_edge_transform_and_lower(partitioners)`, `to_executorch(passes)`; write the .pte.
    `inspect` as in `lower_to_xnnpack`, called with the lowered EdgeProgramManager; its result is returned."""
    manager.export()
    manager.run_canonical_optimizations()
    manager.to_edge_transform_and_lower(partitioners)
    inspected = inspect(manager.edge_manager) if inspect is not None else None
    manager.to_executorch(passes=passes)
    with open(path, "wb") as f:
        manager.export_program.write_to_file(f)
    return inspected


def warm_up(driver: Driver, bench: Bench) -> None:
    """One untimed prefill and two decode steps."""
    reset_driver(driver)
    token = driver.prefill(bench.prompt)
    for i in range(2):
        token = driver.decode(token, len(bench.prompt) + i)


def time_round(driver: Driver, bench: Bench, warm_prefill: bool = False) -> tuple[float, float, list[int]]:
    """One timed prefill of the prompt, then `bench.decode_steps` timed greedy decode steps. Returns (prefill
    tok/s, decode tok/s, tokens): the prefill's next token and one per decode step. `warm_prefill` runs one untimed
    prefill first: the first ExecuTorch prefill after other work (the bandwidth sample, another program, even a short
    sleep) can run markedly slower, which otherwise lands on the round's first row."""
    n = len(bench.prompt)
    if warm_prefill:
        reset_driver(driver)
        driver.prefill(bench.prompt)
    reset_driver(driver)
    start = time.perf_counter()
    tokens = [driver.prefill(bench.prompt)]
    prefill_tps = n / (time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(bench.decode_steps):
        tokens.append(driver.decode(tokens[-1], n + i))
    return prefill_tps, bench.decode_steps / (time.perf_counter() - start), tokens


# --------------------------------------------------------------------------------------------------
# Drivers


class RebuiltWhenPickled:
    """Base of the drivers that pickle as their constructor call (the files to load, or a seeded model builder),
    so that `time_in_fresh_process` builds them anew in its own process instead of copying loaded programs."""

    def __new__(cls, *args: Any, **kwargs: Any):
        driver = super().__new__(cls)
        driver._construction = (args, kwargs)
        return driver

    def __reduce__(self):
        args, kwargs = self._construction
        return _construct, (type(self), args, kwargs)


def _construct(cls: type, args: tuple, kwargs: dict) -> Any:
    return cls(*args, **kwargs)


class Deferred:
    """A driver's constructor call (`RebuiltWhenPickled.__reduce__`), kept in place of the driver: pickles as that
    call, so a fresh process (`in_fresh_process`) builds the driver in its process while this one holds no program."""

    def __init__(self, construction: tuple[Callable[..., Any], tuple]):
        self.construction = construction

    def __reduce__(self):
        return self.construction


class TokensPosDriver(RebuiltWhenPickled):
    """A program with `forward(tokens int64 [1,T], input_pos int64 [1]) -> logits` and its KV cache as
    mutable buffers; prefill is one call when T is dynamic, else token by token (`token_by_token`)."""

    def __init__(self, path: Path, token_by_token: bool = False, **program_options: Any):
        self.method = load_method(path, **program_options)
        self.token_by_token = token_by_token

    def _step(self, tokens: list[int], pos: int) -> int:
        ids = torch.tensor([tokens], dtype=torch.long)
        (logits,) = run_method(self.method, [ids, torch.tensor([pos], dtype=torch.long)])
        return argmax_last(logits)

    def prefill(self, prompt: list[int]) -> int:
        if not self.token_by_token:
            return self._step(prompt, 0)
        for pos, token in enumerate(prompt):
            next_token = self._step([token], pos)
        return next_token

    def decode(self, token: int, pos: int) -> int:
        return self._step([token], pos)


class EagerDriver(RebuiltWhenPickled):
    """The transformers model in eager PyTorch with its default cache (a reference row, nothing exported),
    `build_model(bench)`."""

    def __init__(self, build_model: Callable[[Bench], torch.nn.Module], bench: Bench):
        self.model = build_model(bench)
        self.cache: Any = None

    @torch.no_grad()
    def prefill(self, prompt: list[int]) -> int:
        out = self.model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        self.cache = out.cache
        return argmax_last(out.logits)

    @torch.no_grad()
    def decode(self, token: int, pos: int) -> int:
        out = self.model(input_ids=torch.tensor([[token]]), cache=self.cache, position_ids=torch.tensor([[pos]]))
        self.cache = out.cache
        return argmax_last(out.logits)


# --------------------------------------------------------------------------------------------------
# Shared builders: etblocks' export, transformers' static-cache export, ExecuTorch's llama example


def export_with_etblocks(bench: Bench, row: Row, build_model: Callable[[Bench], torch.nn.Module],
                         filename: str, swap_options: Mapping[str, Any] | None = None,
                         export_options: Mapping[str, Any] | None = None) -> tuple[Driver, Any]:
    """Build a model, swap its blocks for XNNPACK, export `forward(tokens, input_pos)` to `bench.out_dir /
    filename` (timed: swap + export + lowering) and load it; returns the driver and etblocks' ExportResult.
    `swap_options` / `export_options`: more keyword arguments of `etblocks.swap` / `etblocks.export`."""
    try:
        from etblocks import export, swap
    except ImportError as e:
        raise Unavailable(str(e)) from e
    model = build_model(bench)
    path = bench.out_dir / filename
    start = time.perf_counter()
    with torch.no_grad():
        model = swap(model, backend="xnnpack", max_seq_len=bench.shape.max_seq_len, **(swap_options or {})) or model
        result = export(model, backend="xnnpack", out=path, max_seq_len=bench.shape.max_seq_len,
                        **(export_options or {}))
    row.export_s = time.perf_counter() - start
    del model
    gc.collect()
    row.pte_mb = pte_megabytes(result.path, *([result.data_path] if result.data_path else []))
    return TokensPosDriver(Path(result.path)), result


def export_hf_static(bench: Bench, row: Row, build_model: Callable[[Bench], torch.nn.Module] = build_hf_model,
                     filename: str = "b_hf_static.pte") -> Driver:
    """transformers' `TorchExportableModuleForDecoderOnlyLM` (StaticCache buffers, strict export, static shapes
    [1,1]) lowered to XNNPACK; prefill feeds the prompt one token at a time (decode.py's row b)."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    row.note = "prefill token by token (static [1,1] shapes)"
    model = build_model(bench)
    model.generation_config.cache_implementation = "static"
    path = bench.out_dir / filename
    start = time.perf_counter()
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=bench.shape.max_seq_len)
    with torch.no_grad():
        exported = wrapper.export(
            input_ids=torch.tensor([[1]], dtype=torch.long),
            cache_position=torch.tensor([0], dtype=torch.long),
            strict=True,
        )
        lower_to_xnnpack(exported, path)
    row.export_s = time.perf_counter() - start
    del model, wrapper, exported
    gc.collect()
    row.pte_mb = pte_megabytes(path)
    return TokensPosDriver(path, token_by_token=True)


def llama_example_model(bench: Bench) -> torch.nn.Module:
    """ExecuTorch's llama `Transformer` with the benchmark shape, holding the same weights as `build_hf_model`
    (HF rope layout, so q/k rows need no permutation)."""
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs

    s = bench.shape
    args = ModelArgs(
        dim=s.hidden,
        n_layers=s.layers,
        n_heads=s.heads,
        n_kv_heads=s.kv_heads,
        head_dim=s.head_dim,
        hidden_dim=s.intermediate,
        vocab_size=s.vocab,
        norm_eps=s.norm_eps,
        rope_theta=s.rope_theta,
        use_hf_rope=True,
        max_batch_size=1,
        max_seq_len=s.max_seq_len,
        max_context_len=s.max_seq_len,
        use_kv_cache=True,
        enable_dynamic_shape=True,
        generate_full_logits=False,
    )
    model = construct_transformer(args).eval()
    hf = build_hf_model(bench).state_dict()
    state = {
        "tok_embeddings.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "output.weight": hf["lm_head.weight"],
    }
    names = {
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w2": "mlp.down_proj",
        "feed_forward.w3": "mlp.up_proj",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    for i in range(s.layers):
        for et_name, hf_name in names.items():
            state[f"layers.{i}.{et_name}.weight"] = hf[f"model.layers.{i}.{hf_name}.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any("kv_cache" not in k for k in missing):
        raise RuntimeError(f"weight mapping mismatch: missing {missing}, unexpected {unexpected}")
    return model


def export_llama_example(bench: Bench, row: Row, filename: str, quantize: str | None = None,
                         group_size: int | None = None, quantize_kv_cache: bool = False) -> Driver:
    """`path_llama_example`'s export to `bench.out_dir / filename`; `quantize` (e.g. "8da4w") adds ExecuTorch's
    weight quantization first, as export_llama_lib's `-qmode` / `--group_size` do (its `quantize()`, HQQ scales);
    `quantize_kv_cache` its int8 KV cache (`--quantize_kv_cache`: asymmetric int8 with a float32 scale and an int8
    zero point per token and head, read by `llama::custom_quantized_sdpa`)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.examples.models.llama.source_transformation.custom_kv_cache import (
        replace_kv_cache_with_custom_kv_cache,
        replace_kv_cache_with_quantized_kv_cache,
    )
    from executorch.examples.models.llama.source_transformation.quantize import get_quant_weight_transform
    from executorch.examples.models.llama.source_transformation.sdpa import (
        replace_sdpa_with_custom_op,
        replace_sdpa_with_quantized_sdpa,
    )
    from executorch.extension.llm.export.builder import DType, LLMEdgeManager

    s = bench.shape
    model = llama_example_model(bench)
    path = bench.out_dir / filename
    start = time.perf_counter()
    manager = LLMEdgeManager(
        model=model,
        modelname="llama",
        max_seq_len=s.max_seq_len,
        dtype=DType.fp32,
        use_kv_cache=True,
        example_inputs=(torch.tensor([[2, 3, 4]]), {"input_pos": torch.tensor([0])}),
        enable_dynamic_shape=True,  # tokens [1, T], T in [1, max_seq_len - 1]
        metadata={
            "get_max_context_len": s.max_seq_len,
            "get_n_layers": s.layers,
            "get_vocab_size": s.vocab,
            "use_kv_cache": True,
            "use_sdpa_with_kv_cache": True,
            "enable_dynamic_shape": True,
        },
    )
    # Same order as export_llama_lib._get_source_transforms: weights, then SDPA, then the KV cache, then (with
    # `quantize_kv_cache`) the int8 cache in place of the custom one and the quantized SDPA in place of the custom one
    # (it replaces only a custom SDPA over an int8 cache).
    weights = [get_quant_weight_transform(quantize, group_size, DType.fp32)] if quantize else []
    int8_cache = ([replace_kv_cache_with_quantized_kv_cache, replace_sdpa_with_quantized_sdpa]
                  if quantize_kv_cache else [])
    manager.source_transform([*weights, replace_sdpa_with_custom_op, replace_kv_cache_with_custom_kv_cache,
                              *int8_cache])
    lower_llm_manager(manager, [XnnpackPartitioner()], path)
    row.export_s = time.perf_counter() - start
    del model, manager
    gc.collect()
    row.pte_mb = pte_megabytes(path)
    return TokensPosDriver(path)


@dataclass(frozen=True)
class PathSpec:
    """A row: its key on the command line, its label, and the function that exports and loads it."""

    key: str
    name: str
    fn: Callable[[Bench, Row], Driver]
    default: bool = True


# --------------------------------------------------------------------------------------------------
# Roofline, reference tokens, report


# What `measure_read_bandwidth` reads, for the lines that print its figure.
BANDWIDTH_PROBE = ("the best of torch.mv and torch.sum over 1 GB of random fp32, on 1 thread and on ExecuTorch's "
                   "thread count")


def measure_read_bandwidth(gigabytes: float = 1.0, reps: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of two streaming reads of a random fp32 matrix, `torch.mv` (a
    matrix-vector product, as a decode step's linears are) and `torch.sum`, `reps` times each on as many threads as
    ExecuTorch's pool runs the programs with, and on one. Not torch's own count: the timing processes start with
    MKL on one thread, which leaves torch one too. `torch.sum` alone can be bound by its reduction rather than the
    memory (on AVX-512 hosts). Random data: a constant-filled array can read far faster than weights do."""
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    matrix = torch.rand(4096, int(gigabytes * 1e9) // (4 * 4096))
    vector, flat = torch.rand(matrix.shape[1]), matrix.view(-1)
    threads, best = torch.get_num_threads(), float("inf")
    try:
        for num_threads in (_threadpool_get_thread_count(), 1):
            torch.set_num_threads(num_threads)
            for read in (lambda: torch.mv(matrix, vector), flat.sum):
                for _ in range(reps):
                    start = time.perf_counter()
                    read()
                    best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return matrix.numel() * 4 / best


def quantize_like_example(model: torch.nn.Module, quantize: str | None, group_size: int) -> torch.nn.Module:
    """ExecuTorch's `quantize()` as export_llama applies it (`-qmode`; torchao `Int8DynamicActivationIntxWeightConfig`,
    HQQ scales, every linear whose input width the group size divides), in place; `quantize=None` leaves it fp32."""
    if quantize is None:
        return model
    from executorch.examples.models.llama.source_transformation.quantize import quantize as example_quantize
    from executorch.extension.llm.export.builder import DType

    with torch.no_grad():
        return example_quantize(model, qmode=quantize, computation_dtype=DType.fp32, group_size=group_size)


@torch.no_grad()
def quantized_reference(model: torch.nn.Module, scheme: str, quantize: str | None, group_size: int = GROUP_SIZE,
                        quantize_embedding: str | None = None) -> torch.nn.Module:
    """`model` (in place) quantized as a row's program quantizes its weights: the eager reference the row's tokens
    are compared with (quantized rows part from the fp32 model within a few tokens on random weights).
    "etblocks": torchao with the configs `etblocks.export` uses (`WeightQuantization`: bf16 scales chosen by HQQ,
    the integers rounded to them; the lm_head of a tied embedding gets its own weight, the embedding is quantized
    only when `quantize_embedding`). "example": `quantize_like_example`, its int4 group scales then rounded to bf16
    as XNNPACK stores them. int8 KV caches are not part of it."""
    if scheme == "example":
        model = quantize_like_example(model, quantize, group_size)
        for module in model.modules():
            scale = getattr(getattr(module, "weight", None), "scale", None)
            if isinstance(module, torch.nn.Linear) and isinstance(scale, torch.Tensor):
                scale.copy_(scale.to(torch.bfloat16).to(scale.dtype))
        return model
    if scheme != "etblocks":
        raise ValueError(f"scheme={scheme!r}: expected 'etblocks' or 'example'")
    from torchao.quantization import quantize_

    from etblocks.export.weights import WeightQuantization

    plan = WeightQuantization(quantize, group_size if quantize == "8da4w" else None, quantize_embedding)
    if quantize is not None:
        quantize_(model, plan.linear_config(), filter_fn=lambda module, fqn: isinstance(module, torch.nn.Linear))
    if quantize_embedding is not None:
        quantize_(model, plan.embedding_config(), filter_fn=lambda module, fqn: isinstance(module, torch.nn.Embedding))
    return model


@torch.no_grad()
def eager_reference_tokens(bench: Bench, build_model: Callable[[Bench], torch.nn.Module] = build_hf_model) -> list[int]:
    """Greedy tokens of the eager transformers model (`build_model`'s): the prefill's token and one per decode
    step."""
    model = build_model(bench)
    ids = torch.tensor([bench.prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=bench.decode_steps + 1,
                         do_sample=False)
    return out[0, len(bench.prompt):].tolist()


def fmt(value: float | None, spec: str) -> str:
    """`value` formatted, or "-" when there is none."""
    return "-" if value is None else format(value, spec)


def spread(runs: list[float], spec: str) -> str:
    """Median and [min-max] of per-round figures."""
    if not runs:
        return "-"
    return f"{format(statistics.median(runs), spec)} [{format(min(runs), spec)}-{format(max(runs), spec)}]"


def ratio(value: float | None, ref: float | None) -> str:
    """value / ref as "1.23x", or "-"."""
    return "-" if value is None or not ref else f"{value / ref:.2f}x"


def matching_prefix(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """How many leading tokens agree."""
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n


def format_table(rows: list[Row], roofline_tps: float | Mapping[str, float],
                 reference: list[int] | Mapping[str, list[int]], ref_key: str = "a", reference_label: str = "eager",
                 extra_headers: Sequence[str] = ()) -> str:
    """The results as one aligned text table; `roofline_tps` is one for all rows or one per row key (rows that
    read different bytes per token), `extra_headers` adds columns (before the tokens) filled from each row's
    `extras`, and `reference_label` names what the tokens are compared with (`reference`: one token list for all
    rows or one per row key)."""
    ref = next((r for r in rows if r.key == ref_key and r.status == "ok"), None)
    headers = ["row", "decode tok/s", "prefill tok/s", "export+lower s", ".pte MB", f"decode/({ref_key})",
               f"prefill/({ref_key})", f"export/({ref_key})", f"pte/({ref_key})", "decode %roof", *extra_headers,
               f"tokens={reference_label}"]
    lines = []
    for r in rows:
        label = f"({r.key}) {r.name}"
        roofline = roofline_tps[r.key] if isinstance(roofline_tps, Mapping) else roofline_tps
        tokens = reference[r.key] if isinstance(reference, Mapping) else reference
        if r.status != "ok":
            lines.append([label, r.status])
            continue
        lines.append([
            label, spread(r.decode_runs, ".1f"), spread(r.prefill_runs, ".0f"), fmt(r.export_s, ".0f"),
            fmt(r.pte_mb, ".0f"),
            ratio(r.decode_tps, ref and ref.decode_tps), ratio(r.prefill_tps, ref and ref.prefill_tps),
            ratio(r.export_s, ref and ref.export_s), ratio(r.pte_mb, ref and ref.pte_mb),
            fmt(100 * r.decode_tps / roofline if r.decode_tps else None, ".0f") + "%",
            *(r.extras.get(header, "-") for header in extra_headers),
            f"{matching_prefix(r.tokens, tokens)}/{len(tokens)}",
        ])
    return aligned_table(headers, lines)


def aligned_table(headers: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """Lines of cells under their headers, the first column left-aligned and the others right-aligned; in a table
    of more than two columns, a line of two cells (label, status) is a row without figures, its status written out
    in full."""
    status_lines = len(headers) > 2
    widths = [max([len(headers[i]), *(len(l[i]) for l in lines if len(l) > 2 or not status_lines)])
              for i in range(len(headers))]
    out = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for l in lines:
        if len(l) == 2 and status_lines:
            out.append(f"{l[0].ljust(widths[0])}  {l[1]}")
        else:
            out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(l, widths))))
    return "\n".join(out)


def paired_median(numerators: list[float], denominators: list[float]) -> float | None:
    """Median of per-round ratios: rows of one round run back to back, so they share the host's load."""
    if not numerators or len(numerators) != len(denominators):
        return None
    return statistics.median(n / d for n, d in zip(numerators, denominators))


def rows_ratio(row: Row | None, other: Row | None, runs: str) -> float | None:
    """`paired_median` of two rows' `runs` ("decode_runs" or "prefill_runs"); None unless both rows ran."""
    return paired_median(getattr(row, runs), getattr(other, runs)) if row and other else None


def target_line(label: str, value: float | None, goal: float, unit: str = "x") -> str:
    """One line of a script's targets: PASS or FAIL of `value >= goal` (both in `unit`), n/a without a value (the
    rows it compares did not run)."""
    if value is None:
        return f"  n/a   {label} (needs the rows it compares)"
    return f"  {'PASS' if value >= goal else 'FAIL'}  {label}: {value:.2f}{unit} (goal >= {goal}{unit})"


# --------------------------------------------------------------------------------------------------
# Main


def argument_parser(paths: Sequence[PathSpec], description: str | None,
                    shapes: Sequence[str] = tuple(SHAPES)) -> argparse.ArgumentParser:
    """The benchmark's options; `paths`, `description` and `shapes` (the `--shape` choices) let another script over
    other rows and models share them (and add its own options to the parser)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(p.key for p in paths if p.default),
                        help="comma-separated row keys: " + ", ".join(f"{p.key}={p.name}" for p in paths))
    add_shape_arg(parser, shapes)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed greedy decode steps")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (prefill)")
    parser.add_argument("--max-seq-len", type=int, default=256, help="context / KV cache length")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved timed rounds of prefill + decode per row; medians are reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-range", type=float, default=0.1,
                        help="weight init std; 0.02 (the default of transformers) makes greedy repeat one token")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the .pte files go (kept); default: a temp dir, deleted at the end")
    return parser


def parse_args(argv: Sequence[str] | None, paths: Sequence[PathSpec], description: str | None, script: str,
               smoke: Mapping[str, Any]) -> argparse.Namespace:
    """The benchmark's options parsed (see `argument_parser`), with `--smoke` and `--out` (`add_run_args`)."""
    parser = argument_parser(paths, description)
    add_run_args(parser, script, smoke)
    return parse_with_smoke(parser, argv, smoke)


def prepare_path(spec: PathSpec, bench: Bench) -> tuple[Row, Driver | None]:
    """Export and load one path; a failure or an unavailable path becomes the row's status."""
    print(f"[decode bench] ({spec.key}) {spec.name}: export ...", file=sys.stderr, flush=True)
    row = Row(spec.key, spec.name)
    start = time.perf_counter()
    driver = None
    try:
        driver = spec.fn(bench, row)
        warm_up(driver, bench)
    except Unavailable as e:
        row.status = f"unavailable: {e}"
    except Exception as e:  # one broken path must not hide the others
        traceback.print_exc()
        row.status = f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        driver = None
    gc.collect()
    print(f"[decode bench] ({spec.key}) ready in {time.perf_counter() - start:.0f} s: {row.status}", file=sys.stderr,
          flush=True)
    return row, driver


def time_rows(prepared: list[tuple[Row, Driver | None]], bench: Bench, warm_prefill: bool = False) -> list[float]:
    """Time the loaded rows in interleaved rounds, appending to each row's runs; returns the read bandwidth
    samples (bytes/s), one per round. Each round starts one row later (a, b, c; b, c, a; ...): no row is always
    the first after the bandwidth sample. `warm_prefill` as in `time_round`."""
    bandwidths = []
    for round_index in range(bench.rounds):
        shift = round_index % max(1, len(prepared))
        for row, driver in prepared[shift:] + prepared[:shift]:
            if driver is None or row.status != "ok":
                continue
            try:
                prefill_tps, decode_tps, tokens = time_round(driver, bench, warm_prefill)
            except Exception as e:
                traceback.print_exc()
                row.status = f"failed while timing: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
                continue
            if row.tokens and tokens != row.tokens:
                row.status = f"failed: greedy tokens differ between rounds ({row.tokens} vs {tokens})"
                continue
            row.tokens = tokens
            row.prefill_runs.append(prefill_tps)
            row.decode_runs.append(decode_tps)
            print(f"[decode bench] round {round_index + 1}/{bench.rounds} ({row.key}): decode {decode_tps:.2f} tok/s,"
                  f" prefill {prefill_tps:.1f} tok/s", file=sys.stderr, flush=True)
        bandwidths.append(measure_read_bandwidth(reps=2))
        print(f"[decode bench] round {round_index + 1}/{bench.rounds}: read bandwidth {bandwidths[-1] / 1e9:.1f} GB/s",
              file=sys.stderr, flush=True)
    return bandwidths


def select_paths(rows: str, paths: Sequence[PathSpec]) -> list[PathSpec]:
    """The paths named by `--rows` (comma-separated keys), in that order; exits on an unknown key."""
    keys = [k.strip() for k in rows.split(",") if k.strip()]
    specs = {p.key: p for p in paths}
    unknown = [k for k in keys if k not in specs]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {list(specs)}")
    return [specs[key] for key in keys]


def make_bench(args: argparse.Namespace) -> Bench:
    """Settings from the parsed options: the shape, the seeded prompt, the output directory (created; a temp
    dir unless `--out-dir`)."""
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="etblocks_decode_bench_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = make_shape(args, layers=args.layers, max_seq_len=args.max_seq_len)
    prompt = torch.randint(1, shape.vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed))
    return Bench(shape, prompt.tolist(), args.decode_steps, args.rounds, out_dir, args.seed, args.init_range)


def time_in_fresh_process(prepared: list[tuple[Row, Driver | None]], bench: Bench,
                          warm_prefill: bool = False) -> tuple[list[Row], list[float]]:
    """`time_rows` in a new Python process that loads every program anew from its files (`RebuiltWhenPickled`), as
    a device's runtime does. A program loaded into a process after exports (gigabytes of graphs allocated and
    freed) decoded slower than the same .pte loaded in a fresh process, the more so the more exports came before
    it, which skewed the rows of one run against each other. This process's drivers are released first; returns
    the timed rows and the bandwidths."""
    payload = [(row, Deferred(driver.__reduce__()) if driver is not None else None) for row, driver in prepared]
    prepared.clear()
    gc.collect()
    return in_fresh_process(_time_loaded, payload, bench, warm_prefill)


def in_fresh_process(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a newly spawned Python process (function, arguments and result pickled), with torch's
    MKL on one thread unless `MKL_NUM_THREADS` says otherwise (`etblocks.threads`: ExecuTorch's attention kernel calls
    MKL from inside its own thread pool; `etblocks run` does the same)."""
    added = prefer_single_threaded_blas(os.environ, {})  # for the new process, which loads torch anew
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(function, args)
    finally:
        if added:
            del os.environ[BLAS_THREADS_ENV]


def timing_mkl_threads() -> str:
    """MKL's thread count in the processes `in_fresh_process` starts."""
    return os.environ.get(BLAS_THREADS_ENV, "1")


def _time_loaded(prepared: list[tuple[Row, Driver | None]], bench: Bench,
                 warm_prefill: bool) -> tuple[list[Row], list[float]]:
    """The fresh process's side of `time_in_fresh_process`: the drivers arrive built anew from their constructor
    calls; warm up, time."""
    for _, driver in prepared:
        if driver is not None:
            warm_up(driver, bench)
    return [row for row, _ in prepared], time_rows(prepared, bench, warm_prefill)


def run_paths(specs: Sequence[PathSpec], bench: Bench, keep_files: bool,
              warm_prefill: bool = False) -> tuple[list[Row], list[float]]:
    """Export and load every path, then time them in interleaved rounds in a fresh process
    (`time_in_fresh_process`; `warm_prefill` as in `time_round`); returns the rows and the read bandwidth
    samples. The output directory is deleted at the end unless `keep_files`."""
    try:
        return time_in_fresh_process([prepare_path(spec, bench) for spec in specs], bench, warm_prefill)
    finally:
        if not keep_files:
            shutil.rmtree(bench.out_dir, ignore_errors=True)


# The vector extensions XNNPACK picks its int8 / int4 GEMM kernels by, as /proc/cpuinfo names them.
KERNEL_FLAGS = {"flags": ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"), "Features": ("asimddp", "i8mm", "sve")}


def describe_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU and which of `KERNEL_FLAGS` it has: XNNPACK picks its int8 / int4 GEMM kernels by them, so
    quantized decode figures depend on them more than on anything else about the host."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return f"CPU: {platform.machine()} (no {cpuinfo})"
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", platform.machine())
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    for key, wanted in KERNEL_FLAGS.items():
        if key in fields:
            have = set(fields[key].split())
            return f"CPU: {name}; " + ", ".join(f"{flag} {'yes' if flag in have else 'no'}" for flag in wanted)
    return f"CPU: {name}"


def describe_run(title: str, bench: Bench, bandwidths: list[float], model: str | None = None,
                 weight_bytes: float | None = None) -> str:
    """The lines above the table: shape, weights, settings, threads and the roofline. Another script's model
    replaces the `--shape`: `model` describes it, `weight_bytes` is what one token reads of its fp32 linears."""
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    s = bench.shape
    gb = [b / 1e9 for b in bandwidths]
    weight_bytes = s.weight_bytes_per_token() if weight_bytes is None else weight_bytes
    roofline_tps = statistics.median(bandwidths) / weight_bytes
    threads = torch.get_num_threads()
    model = model or (
        f"{s.name} shape: {s.layers} layers, hidden {s.hidden}, {s.heads}/{s.kv_heads} heads (head_dim "
        f"{s.head_dim}), intermediate {s.intermediate}, vocab {s.vocab}, tied embedding, fp32, random weights (seed "
        f"{bench.seed}, init std {bench.init_range})")
    return "\n".join([
        f"\n{title}, {model}",
        f"context {s.max_seq_len}, prompt {len(bench.prompt)} tokens (prefill), {bench.decode_steps} greedy decode "
        f"steps; figures are medians of {bench.rounds} interleaved rounds [min-max]; torch {torch.__version__}, "
        f"{threads} torch threads, {_threadpool_get_thread_count()} ExecuTorch threads",
        describe_cpu(),
        f"roofline: read bandwidth {statistics.median(gb):.1f} GB/s [{min(gb):.1f}-{max(gb):.1f}] ({BANDWIDTH_PROBE}, "
        f"sampled every round) / {weight_bytes / 1e6:.1f} MB "
        f"fp32 weights per token (linears + lm_head) = {roofline_tps:.1f} tok/s\n",
    ])


def add_run_args(parser: argparse.ArgumentParser, script: str, smoke: Mapping[str, Any]) -> None:
    """`--smoke` (the settings `smoke` gives, under any option given explicitly) and `--out` (the results file,
    default benchmarks/results/<script>.json)."""
    described = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in smoke.items())
    parser.add_argument("--smoke", action="store_true", help=f"a quick run that checks the script works: {described}")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / f"{script}.json", help="results file (JSON)")


def parse_with_smoke(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                     smoke: Mapping[str, Any]) -> argparse.Namespace:
    """Parse `argv`; with `--smoke`, `smoke`'s values become the defaults (explicit options still win)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in argv:
        parser.set_defaults(**smoke)
    args = parser.parse_args(argv)
    args.argv = argv
    return args


# --------------------------------------------------------------------------------------------------
# Weight quantization options and the bytes a decode step reads (quant.py's count)


@dataclass(frozen=True)
class Option:
    """One quantization choice, as the keyword arguments it adds to `etblocks.swap` and `etblocks.export`."""

    key: str
    name: str
    quantize: str | None = None  # export(quantize_weights=...): the linear weights
    kv_quantize: str | None = None  # swap(kv_quantize=...)
    quantize_embedding: str | None = None  # export(quantize_embedding=...)

    def swap_options(self) -> dict[str, Any]:
        return {"kv_quantize": self.kv_quantize}

    def export_options(self) -> dict[str, Any]:
        return {"quantize_weights": self.quantize, "group_size": GROUP_SIZE, "quantize_embedding": self.quantize_embedding}

    @property
    def exact(self) -> bool:
        """Whether the option's program should give the fp32 model's greedy tokens exactly (no quantization)."""
        return self.quantize is None and self.kv_quantize is None and self.quantize_embedding is None


def linear_bytes(out_features: int, in_features: int, quantize: str | None, group_size: int = GROUP_SIZE) -> float:
    """Bytes of one linear's weight as XNNPACK reads it (quant.py's docstring); `group_size`: 8da4w's groups."""
    if quantize is None:
        return 4 * out_features * in_features
    if quantize == "8da8w":
        return out_features * in_features + 4 * out_features
    if quantize == "8da4w":
        return out_features * in_features / 2 + 2 * out_features * in_features / group_size
    raise ValueError(f"no byte count for quantize={quantize!r}")


def weight_bytes_per_token(shape: Shape, quantize: str | None, group_size: int = GROUP_SIZE) -> float:
    """Linear weights (every layer) plus the lm_head, quantized as `quantize` (`group_size`: 8da4w's groups) says."""
    layer = sum(linear_bytes(out_features, in_features, quantize, group_size) for out_features, in_features in
                shape.linear_shapes())
    return shape.layers * layer + linear_bytes(shape.vocab, shape.hidden, quantize, group_size)


@torch.no_grad()
def kv_bytes_per_position(bench: Bench, option: Option) -> float:
    """Bytes all layers' caches hold per position: every declared state tensor (keys, values, scales, zero points)
    of a one-layer model swapped with the option, divided by its rows, times the layers."""
    import etblocks
    from etblocks.state import find_states

    one_layer = dataclasses.replace(bench, shape=dataclasses.replace(bench.shape, layers=1))
    model = etblocks.swap(build_hf_model(one_layer), backend="xnnpack", max_seq_len=bench.shape.max_seq_len,
                          **option.swap_options())
    per_layer = sum(spec.zeros().nbytes / spec.rows for state in find_states(model) for spec in state.specs())
    return per_layer * bench.shape.layers


def bytes_per_token(bench: Bench, option: Option) -> float:
    """What one timed decode step reads on average: weights plus the cached positions (quant.py's docstring)."""
    mean_positions = len(bench.prompt) + (bench.decode_steps + 1) / 2
    return weight_bytes_per_token(bench.shape, option.quantize) + kv_bytes_per_position(bench, option) * mean_positions


# --------------------------------------------------------------------------------------------------
# Correctness checks


@dataclass
class Check:
    """One comparison of a row's outputs with the script's reference. `compared`: outputs compared; `matching`:
    how many agree from the start; `required`: how many must (all unless the script allows fewer, e.g. a quantized
    row against an fp32 reference); `first_difference`: the index of the first that disagrees, None if none."""

    row: str
    reference: str
    compared: int
    matching: int
    required: int
    first_difference: int | None
    outputs: list[Any] = field(default_factory=list)
    expected: list[Any] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.matching >= self.required

    def describe(self) -> str:
        where = "" if self.first_difference is None else (
            f"first differing index {self.first_difference} (row {_at(self.outputs, self.first_difference)} vs "
            f"{self.reference} {_at(self.expected, self.first_difference)}), ")
        return (f"({self.row}) vs {self.reference}: {where}{self.matching}/{self.compared} agree, {self.required} "
                f"required{'; ' + self.note if self.note else ''}")

    def record(self) -> dict[str, Any]:
        return {"row": self.row, "reference": self.reference, "compared": self.compared, "matching": self.matching,
                "required": self.required, "first_difference": self.first_difference, "ok": self.ok,
                "outputs": self.outputs, "expected": self.expected, "note": self.note}


def _at(values: Sequence[Any], index: int) -> Any:
    return values[index] if index < len(values) else "-"


def broken_rows() -> set[str]:
    """The row keys `ETBLOCKS_BENCH_BREAK_ROW` names (comma-separated): their outputs are corrupted in the check."""
    return {k.strip() for k in os.environ.get(BREAK_ROW_ENV, "").split(",") if k.strip()}


def tokens_as_checked(row: str, tokens: Sequence[int]) -> list[int]:
    """A row's tokens as its check sees them: with the first made negative (no vocabulary holds one) when
    `ETBLOCKS_BENCH_BREAK_ROW` names the row."""
    tokens = [int(t) for t in tokens]
    if row in broken_rows() and tokens:
        tokens[0] = -1 - tokens[0]
    return tokens


def check_tokens(row: str, tokens: Sequence[int], reference: Sequence[int], reference_label: str = "reference",
                 required: int | None = None, note: str = "") -> Check:
    """Compare a row's greedy tokens with the reference's, over the reference's length; `required`: how many leading
    tokens must agree (default: all). A row named in `ETBLOCKS_BENCH_BREAK_ROW` has its first token corrupted."""
    tokens = tokens_as_checked(row, tokens)
    reference = list(reference)
    matching = matching_prefix(tokens, reference)
    first = None if matching >= len(reference) else matching
    required = len(reference) if required is None else min(required, len(reference))
    return Check(row, reference_label, len(reference), matching, required, first, tokens, reference, note)


def check_values(row: str, values: Sequence[float], reference: Sequence[float], reference_label: str = "reference",
                 tolerance: float = 0.0, note: str = "") -> Check:
    """Compare numbers (all must agree within `tolerance`, absolute). A row named in `ETBLOCKS_BENCH_BREAK_ROW` has
    its first value corrupted."""
    values = [float(v) for v in values]
    if row in broken_rows() and values:
        values[0] = values[0] + 1.0 + 10 * abs(values[0]) + 10 * tolerance
    reference = [float(v) for v in reference]
    bad = [i for i, (v, r) in enumerate(zip(values, reference)) if not abs(v - r) <= tolerance]
    if len(values) != len(reference):
        bad.append(min(len(values), len(reference)))
    first = min(bad) if bad else None
    matching = len(reference) if first is None else first
    return Check(row, reference_label, len(reference), matching, len(reference), first, values, reference, note)


def check_members(row: str, values: Sequence[int], allowed: Iterable[int], reference_label: str,
                  note: str = "") -> Check:
    """Every value must be one of `allowed` (e.g. sampled tokens inside the nucleus); `matching` counts the values
    before the first that is not. `ETBLOCKS_BENCH_BREAK_ROW` corrupts the first value."""
    values = [int(v) for v in values]
    if row in broken_rows() and values:
        values[0] = -1
    allowed = set(allowed)
    first = next((i for i, v in enumerate(values) if v not in allowed), None)
    matching = len(values) if first is None else first
    return Check(row, reference_label, len(values), matching, len(values), first, values, [], note)


@torch.no_grad()
def check_ranks(row: str, tokens: Sequence[int], model: torch.nn.Module, prompt: Sequence[int], top_k: int,
                reference_label: str = "eager", note: str = "") -> Check:
    """Every greedy token of a row must be among `model`'s `top_k` at its position, the model fed the prompt and
    the row's own earlier tokens (teacher-forced). For a quantized row against an eager model quantized the same
    way: their roundings differ, so on random weights' flat logits the free-running tokens part early, while a
    broken program picks tokens the model ranks far down. `expected` holds the model's top-1 at each position,
    `note` the ranks. `ETBLOCKS_BENCH_BREAK_ROW` corrupts the first token."""
    tokens = tokens_as_checked(row, tokens)
    ids = torch.tensor([list(prompt) + [max(t, 0) for t in tokens[:-1]]])
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:]
    vocab = logits.shape[-1]
    ranks = [int((step > step[t]).sum()) if 0 <= t < vocab else vocab for step, t in zip(logits, tokens)]
    first = next((i for i, rank in enumerate(ranks) if rank >= top_k), None)
    matching = len(tokens) if first is None else first
    ranks_note = f"ranks in the {reference_label} model's logits {ranks}, each must be < {top_k}"
    return Check(row, reference_label, len(tokens), matching, len(tokens), first, tokens,
                 logits.argmax(-1).tolist(), "; ".join(filter(None, [note, ranks_note])))


class Checks:
    """The checks of one run: `add` them, `report` prints the failures, `ok` decides the exit code."""

    def __init__(self) -> None:
        self.items: list[Check] = []
        self.failures: list[str] = []  # rows whose path failed (no outputs to compare)

    def add(self, check: Check) -> Check:
        self.items.append(check)
        return check

    def fail(self, message: str) -> None:
        self.failures.append(message)

    @property
    def ok(self) -> bool:
        return not self.failures and all(c.ok for c in self.items)

    def problems(self) -> list[str]:
        return [*(f"FAILED    {m}" for m in self.failures), *(f"DISAGREES {c.describe()}" for c in self.items if not c.ok)]

    def report(self) -> str:
        """The summary line(s) to print last."""
        if self.ok:
            return f"output check: {len(self.items)} comparisons, every one agrees as required"
        return "output check FAILED:\n  " + "\n  ".join(self.problems())

    def records(self) -> list[dict[str, Any]]:
        return [c.record() for c in self.items]


def check_rows(checks: Checks, rows: Sequence[Row], reference: Sequence[int] | Mapping[str, Sequence[int]],
               reference_label: str, required: Mapping[str, int] | None = None, notes: Mapping[str, str] | None = None,
               strict_failures: bool = True) -> None:
    """Add a token check for every timed row (`reference`: one list or one per row key; `required`: leading tokens
    a row must match, all by default); a failed row is a failure when `strict_failures` (an unavailable one never)."""
    def compare(row: Row) -> Check:
        expected = reference[row.key] if isinstance(reference, Mapping) else reference
        return check_tokens(row.key, row.tokens, expected, reference_label, (required or {}).get(row.key),
                            (notes or {}).get(row.key, ""))

    check_each_row(checks, rows, compare, strict_failures)


def check_each_row(checks: Checks, rows: Sequence[Row], compare: Callable[[Row], Check],
                   strict_failures: bool = True) -> None:
    """Add `compare(row)` for every timed row; a failed row is a failure when `strict_failures` (an unavailable one
    never)."""
    for row in rows:
        if row.status.startswith("failed"):
            if strict_failures:
                checks.fail(f"({row.key}) {row.name}: {row.status}")
        elif row.status == "ok":
            checks.add(compare(row))


# --------------------------------------------------------------------------------------------------
# Results files

VERSION_PACKAGES = ("torch", "executorch", "torchao", "transformers", "etblocks", "llama_cpp_python")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "amx_int8")


def package_versions() -> dict[str, str | None]:
    """The installed versions of `VERSION_PACKAGES` (None when one is missing)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in VERSION_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, bool | None]:
    """Which of `CPU_FLAGS` the CPU has (None each when /proc/cpuinfo has no x86 flags)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                have = set(value.split())
                return {flag: flag in have for flag in CPU_FLAGS}
    except OSError:
        pass
    return dict.fromkeys(CPU_FLAGS)


def run_info() -> dict[str, Any]:
    """What a results entry records about where it ran."""
    import etblocks

    git = git_commit()
    return {"git_commit": git["commit"], "git_dirty": git["dirty"], "etblocks_path": str(Path(etblocks.__file__).parent),
            "versions": package_versions(), "cpu": describe_cpu(), "cpu_flags": cpu_flags(),
            "timing_mkl_threads": timing_mkl_threads(),
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def spread_record(runs: Sequence[float]) -> dict[str, Any]:
    """Every round's figure, their median and their range."""
    runs = [float(r) for r in runs]
    if not runs:
        return {"runs": [], "median": None, "min": None, "max": None}
    return {"runs": runs, "median": statistics.median(runs), "min": min(runs), "max": max(runs)}


def row_record(row: Row, **extra: Any) -> dict[str, Any]:
    """A `Row` as JSON: its status, export figures, every round's decode and prefill tok/s (median, min-max)."""
    return {"key": row.key, "name": row.name, "status": row.status, "export_s": row.export_s, "pte_mb": row.pte_mb,
            "note": row.note, "extras": dict(row.extras), "tokens": row.tokens,
            "timings": {"decode_tps": spread_record(row.decode_runs), "prefill_tps": spread_record(row.prefill_runs)},
            **extra}


# The host kind every results entry ran on until an AVX2-only host came: its entries carry no host in their key.
USUAL_HOST = "AVX-512 VNNI"


def host_kind(flags: Mapping[str, bool | None] | None = None) -> str:
    """The kind of host by the vector extensions XNNPACK's kernels are picked by: "AVX-512 VNNI", "AVX2-only",
    "x86 without AVX2", or the machine's architecture where /proc/cpuinfo has no x86 flags."""
    flags = cpu_flags() if flags is None else flags
    if flags.get("avx512_vnni"):
        return USUAL_HOST
    if flags.get("avx2"):
        return "AVX2-only"
    if flags.get("avx2") is False:
        return "x86 without AVX2"
    return platform.machine()


def host_key(key: str, flags: Mapping[str, bool | None] | None = None) -> str:
    """`key` with the host kind appended unless the host is of `USUAL_HOST`'s kind, so that a run on another
    kind of host sits beside the usual one's entry instead of replacing it."""
    kind = host_kind(flags)
    return key if kind == USUAL_HOST else f"{key} ({kind} host)"


def entry_key(args: argparse.Namespace) -> str:
    """The results entry a run writes: "smoke", "default" (no options) or the options given, with `host_key`'s
    host kind (smoke runs excepted: they are the suite's, never rendered)."""
    argv = [a for a in getattr(args, "argv", []) if a != "--smoke"]
    out_index = [i for i, a in enumerate(argv) if a == "--out"]
    for i in reversed(out_index):
        del argv[i:i + 2]
    argv = [a for a in argv if not a.startswith("--out=")]
    if getattr(args, "smoke", False):
        return "smoke" + (" " + " ".join(argv) if argv else "")
    return host_key(" ".join(argv) or "default")


def args_record(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed options as JSON values."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def write_results(path: Path, key: str, entry: Mapping[str, Any], merge: Sequence[str] = ()) -> None:
    """Write one run's entry into the results file `{"runs": {key: entry}}`, keeping the other entries; the
    dictionaries named in `merge` keep the earlier entry's items that this run did not write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        results = {}
    entry = dict(entry)
    earlier = results.setdefault("runs", {}).get(key) or {}
    for name in merge:
        if isinstance(earlier.get(name), dict) and isinstance(entry.get(name), dict):
            entry[name] = {**earlier[name], **entry[name]}
    results["runs"][key] = entry
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")


def finish(script: str, args: argparse.Namespace, checks: Checks, tables: Mapping[str, str],
           started: float, **entry: Any) -> int:
    """Write the results entry (run_info, the options, `entry`, the checks, `tables`: the printed tables by name),
    print the check's summary; returns the exit code: 1 when an output disagrees or a row failed."""
    record = {"script": script, **run_info(), "args": args_record(args), **entry, "checks": checks.records(),
              "problems": checks.problems(), "ok": checks.ok, "tables": dict(tables),
              "wall_s": time.perf_counter() - started}
    write_results(args.out, entry_key(args), record)
    print(f"\nresults: {args.out} (entry {entry_key(args)!r}); wall time {record['wall_s']:.0f} s")
    print(checks.report())
    return 0 if checks.ok else 1
