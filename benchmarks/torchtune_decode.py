"""A torchtune model to ExecuTorch/XNNPACK, side by side, on the SmolLM2-135M shape (fp32, random weights).

The model is torchtune's `llama3_2(...)` builder at that shape (Llama3ScaledRoPE). Rows: (a) etblocks on the
torchtune model; (b) etblocks on the same weights as a transformers Llama (`tune_to_hf`, logits checked first); (c)
ExecuTorch's torchtune replacement (`replace_mha_with_inference_mha`, exported as its llama3_2_vision text decoder
is); (c2) (c) with the linears inside the attention's torch.cond branches decomposed so that lowering succeeds; (d)
torchtune eager with its KV cache. Found with it (ExecuTorch 1.5.1): (c) does not lower (shown as an expected
failure) and (c2)'s program is right on its first call only, so (c2) must agree on the first token and every other
row on all of them, against `torchtune.generation.generate(top_k=1)`; otherwise the script exits 1. Timing is
decode.py's (`harness`: fresh process, interleaved rounds, each row's prefill warmed right before its timed one),
medians [min-max], ratios to (a), plus XNNPACK-delegated ops per row. Results:
benchmarks/results/torchtune_decode.json.

    python benchmarks/torchtune_decode.py            # 30 layers
    python benchmarks/torchtune_decode.py --smoke    # 1 layer, rows a, b, d, 1 round
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from harness import (  # benchmarks/ is not a package: Python puts this script's folder first on sys.path
    Bench,
    Checks,
    check_rows,
    finish,
    row_record,
    spread_record,
    Driver,
    PathSpec,
    RebuiltWhenPickled,
    Row,
    argmax_last,
    describe_run,
    export_with_etblocks,
    format_table,
    llama_config,
    load_method,
    lower_llm_manager,
    make_bench,
    parse_args,
    pte_megabytes,
    run_paths,
    select_paths,
)

from etblocks.export.delegation import DelegationSummary, summarize  # noqa: E402
from etblocks.export.runner import run_method  # noqa: E402
from etblocks.torchtune_compat import import_torchtune  # noqa: E402

import_torchtune()  # torchtune 0.6.1 needs the torchao NF4 alias in place before anything imports it

REFERENCE_TOKENS = 32
# (c2) is known wrong after its first call (module docstring): it is timed as the workaround it is, and must agree
# on the prefill's token only.
REQUIRED = {"c2": 1}
SMOKE = {"shape": "tiny", "layers": 1, "rows": "a,b,d", "rounds": 1, "decode_steps": 4, "prompt_len": 8, "max_seq_len": 32}
DELEGATION = "XNNPACK ops/all (partitions)"
LOGITS_TOLERANCE = 1e-4  # max abs error / max abs logit, as etblocks' swap probe
LLAMA3_2_MAX_POSITIONS = 131072  # as Llama 3.2's HF config: above the rope's original 8192, as transformers wants


# --------------------------------------------------------------------------------------------------
# Models


def build_tune_model(bench: Bench) -> torch.nn.Module:
    """torchtune's llama3_2 decoder at the benchmark shape with seeded weights: every linear and the (tied)
    embedding N(0, bench.init_range), norm scales left at 1; fp32, eval."""
    from torchtune.models.llama3_2._component_builders import llama3_2

    s = bench.shape
    torch.manual_seed(bench.seed)
    model = llama3_2(vocab_size=s.vocab, num_layers=s.layers, num_heads=s.heads, num_kv_heads=s.kv_heads,
                     embed_dim=s.hidden, max_seq_len=s.max_seq_len, intermediate_dim=s.intermediate,
                     norm_eps=s.norm_eps, rope_base=int(s.rope_theta), tie_word_embeddings=True)
    if model.head_dim != s.head_dim:
        raise ValueError(f"llama3_2 derives head_dim {model.head_dim} from the shape, expected {s.head_dim}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, bench.init_range)
    return model.eval()


def llama3_rope_parameters(model: torch.nn.Module) -> dict[str, Any]:
    """transformers' `rope_parameters` for the decoder's Llama3ScaledRoPE (the same frequencies)."""
    rope = model.layers[0].attn.pos_embeddings
    return {"rope_type": "llama3", "rope_theta": float(rope.base), "factor": float(rope.scale_factor),
            "low_freq_factor": float(rope.low_freq_factor), "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": rope.old_context_len}


def hf_from_tune(bench: Bench) -> torch.nn.Module:
    """A transformers LlamaForCausalLM holding the torchtune model's weights (`tune_to_hf` permutes the q/k rows
    from torchtune's interleaved rope to HF's rotate-half); raises unless its logits for the prompt equal
    torchtune's within LOGITS_TOLERANCE."""
    from torchtune.models.convert_weights import tune_to_hf
    from transformers import LlamaForCausalLM

    s = bench.shape
    tune = build_tune_model(bench)
    hf = LlamaForCausalLM(llama_config(bench, llama3_rope_parameters(tune), LLAMA3_2_MAX_POSITIONS)).eval()
    state = tune_to_hf(tune.state_dict(), num_heads=s.heads, num_kv_heads=s.kv_heads, dim=s.hidden, head_dim=s.head_dim)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or missing != ["lm_head.weight"]:  # lm_head is tied to the embedding
        raise RuntimeError(f"tune_to_hf mapping mismatch: missing {missing}, unexpected {unexpected}")
    ids = torch.tensor([bench.prompt])
    with torch.no_grad():
        expected, got = tune(ids), hf(ids).logits
    error = float((expected - got).abs().max() / expected.abs().max())
    if error > LOGITS_TOLERANCE:
        raise RuntimeError(f"HF logits differ from torchtune's: max abs error {error:.2e} x the logit scale")
    return hf


@torch.no_grad()
def tune_reference_tokens(bench: Bench) -> list[int]:
    """Greedy tokens of `torchtune.generation.generate(top_k=1)` on the KV-cached eager model (as many as one
    round yields, at most REFERENCE_TOKENS)."""
    from torchtune.generation import generate

    model = build_tune_model(bench)
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=bench.shape.max_seq_len)
    count = min(REFERENCE_TOKENS, bench.decode_steps + 1)
    tokens, _ = generate(model, torch.tensor([bench.prompt]), max_generated_tokens=count, top_k=1)
    return tokens[0, len(bench.prompt):].tolist()


# --------------------------------------------------------------------------------------------------
# Drivers for torchtune's calling convention: tokens [1, T], input_pos [1, T], mask bool [1, T, context]


class CausalMaskDriver(ABC):
    """Prefill and decode through `_logits(tokens, input_pos, mask)`, the way torchtune.generation feeds a
    KV-cached decoder: absolute positions and rows of a causal mask over the whole cache."""

    def __init__(self, context: int):
        self.causal = torch.tril(torch.ones(context, context, dtype=torch.bool))

    @abstractmethod
    def _logits(self, tokens: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits `[1, T, V]` of `tokens [1, T]` at `input_pos [1, T]` under the causal `mask [1, T, context]`."""

    def _step(self, tokens: list[int], start: int) -> int:
        end = start + len(tokens)
        positions = torch.arange(start, end)[None]
        return argmax_last(self._logits(torch.tensor([tokens]), positions, self.causal[None, start:end]))

    def prefill(self, prompt: list[int]) -> int:
        return self._step(prompt, 0)

    def decode(self, token: int, pos: int) -> int:
        return self._step([token], pos)


class TuneEagerDriver(RebuiltWhenPickled, CausalMaskDriver):
    """(d) the torchtune decoder `build_model(bench)` in eager PyTorch with its own KV caches (`setup_caches`)."""

    def __init__(self, build_model: Callable[[Bench], torch.nn.Module], bench: Bench):
        context = bench.shape.max_seq_len
        super().__init__(context)
        self.model = build_model(bench)
        self.model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=context)

    def reset(self) -> None:
        self.model.reset_caches()

    @torch.no_grad()
    def _logits(self, tokens: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, input_pos=input_pos, mask=mask)


class InferenceMHADriver(RebuiltWhenPickled, CausalMaskDriver):
    """(c) ExecuTorch's torchtune program, `forward(tokens, input_pos, mask) -> logits [1, T, V]`. Its caches
    write at their own `kv_cache_pos` buffer, which nothing but a fresh load resets: `reset()` reloads the method."""

    def __init__(self, path: Path, context: int):
        super().__init__(context)
        self.path = path
        self.method: Any = None

    def reset(self) -> None:
        self.method = None  # free the old method (its packed weights) before loading the next
        gc.collect()
        self.method = load_method(self.path)

    def _logits(self, tokens: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return run_method(self.method, [tokens, input_pos, mask])[0]


# --------------------------------------------------------------------------------------------------
# Delegation


def delegation_cell(summary: DelegationSummary) -> str:
    """'delegated/all (N partitions)' for the table."""
    delegated = summary.ops_per_delegate.get("XnnpackBackend", 0)
    total = sum(count for _, count in summary.partitions) + summary.n_cpu_ops
    return f"{delegated}/{total} ({len(summary.partitions)} partitions)"


# --------------------------------------------------------------------------------------------------
# Paths: one function per row, `(bench, row) -> Driver`


def path_tune_etblocks(bench: Bench, row: Row) -> Driver:
    """(a) etblocks swap + export of the torchtune decoder."""
    driver, result = export_with_etblocks(bench, row, build_tune_model, "a_etblocks_torchtune.pte")
    row.extras[DELEGATION] = delegation_cell(result.delegation)
    return driver


def path_hf_etblocks(bench: Bench, row: Row) -> Driver:
    """(b) etblocks swap + export of the same weights as a transformers LlamaForCausalLM."""
    driver, result = export_with_etblocks(bench, row, hf_from_tune, "b_etblocks_hf.pte")
    row.extras[DELEGATION] = delegation_cell(result.delegation)
    row.note = f"HF logits equal torchtune's within {LOGITS_TOLERANCE:g} x the logit scale (checked before export)"
    return driver


def inference_mha_manager(bench: Bench) -> Any:
    """The torchtune decoder with ExecuTorch's inference MHA and its KV caches, in an LLMEdgeManager set up as
    ExecuTorch's `Llama3_2Decoder` example sets it up (examples/models/llama3_2_vision/text_decoder/model.py):
    tokens, input_pos and a bool mask row per token, dynamic in T."""
    from executorch.extension.llm.export.builder import DType, LLMEdgeManager
    from executorch.extension.llm.modules import replace_mha_with_inference_mha

    s = bench.shape
    model = replace_mha_with_inference_mha(build_tune_model(bench))
    model.requires_grad_(False)
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=s.max_seq_len)
    n = 34  # the example's number of example tokens
    mask = torch.tril(torch.ones(s.max_seq_len, s.max_seq_len, dtype=torch.bool))[None, :n].contiguous()
    token_dim, static = torch.export.Dim("token_dim", min=1, max=s.max_seq_len), torch.export.Dim.STATIC
    return LLMEdgeManager(
        model=model,
        modelname="llama3_2_torchtune",
        max_seq_len=s.max_seq_len,
        dtype=DType.fp32,
        use_kv_cache=True,
        example_inputs=(torch.ones(1, n, dtype=torch.long),),
        example_kwarg_inputs={"input_pos": torch.arange(n)[None], "mask": mask},  # program input order
        dynamic_shapes={"tokens": {0: static, 1: token_dim}, "input_pos": {0: static, 1: token_dim},
                        "mask": {0: static, 1: token_dim, 2: static}},
        enable_dynamic_shape=True,
    )


def linears_in_cond_branches(graph_module: torch.fx.GraphModule) -> int:
    """How many aten.linear nodes sit inside torch.cond branches of an exported graph (recursively)."""
    count = 0
    for child in graph_module.children():
        if isinstance(child, torch.fx.GraphModule):
            count += sum(node.target == torch.ops.aten.linear.default for node in child.graph.nodes)
            count += linears_in_cond_branches(child)
    return count


def top_level_xnnpack_partitioner() -> Any:
    """An XnnpackPartitioner that keeps `aten.linear` whole only in the top-level graph. XNNPACK partitions only
    that graph, so a linear it keeps whole inside a torch.cond branch stays undelegated and undecomposed, which
    `to_edge_transform_and_lower` refuses; decomposed there, it runs as a portable `mm`."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    class TopLevelXnnpackPartitioner(XnnpackPartitioner):
        def ops_to_not_decompose(self, ep: Any) -> tuple[list[Any], Any]:
            ops, keep = super().ops_to_not_decompose(ep)
            top = ep.graph_module.graph
            return ops, lambda node: node.graph is top and (keep is None or keep(node))

    return TopLevelXnnpackPartitioner()


def export_inference_mha(bench: Bench, row: Row, partitioner: Any, filename: str) -> Driver:
    """Export and lower (c) with `partitioner`; a lowering failure is explained in the row's note and re-raised."""
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    manager = inference_mha_manager(bench)
    path = bench.out_dir / filename
    start = time.perf_counter()
    try:
        with torch.no_grad():
            summary = lower_llm_manager(
                manager, [partitioner], path, passes=[InitializedMutableBufferPass(["kv_cache_pos"])],
                inspect=lambda edge: summarize(edge.exported_program().graph_module),
            )
    except Exception as e:
        inside = linears_in_cond_branches(manager.pre_autograd_graph_module) if manager.pre_autograd_graph_module else 0
        row.note = (f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]} ({inside} aten.linear nodes, k_proj "
                    "and v_proj of every layer, sit inside the torch.cond branches of ExecuTorch's MHA, where "
                    "XnnpackPartitioner keeps linear undecomposed but does not partition)")
        raise
    row.export_s = time.perf_counter() - start
    row.extras[DELEGATION] = delegation_cell(summary)
    del manager
    gc.collect()
    row.pte_mb = pte_megabytes(path)
    return InferenceMHADriver(path, bench.shape.max_seq_len)


def path_inference_mha(bench: Bench, row: Row) -> Driver:
    """(c) ExecuTorch's torchtune replacement, lowered as ExecuTorch's llama export lowers fp32 XNNPACK."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return export_inference_mha(bench, row, XnnpackPartitioner(), "c_inference_mha.pte")


def path_inference_mha_workaround(bench: Bench, row: Row) -> Driver:
    """(c2) the same, with the cond-branch linears decomposed so that lowering succeeds."""
    row.note = ("not ExecuTorch's flow: k_proj/v_proj run as portable mm inside torch.cond; ops and partitions "
                "count both cond branches of every layer")
    return export_inference_mha(bench, row, top_level_xnnpack_partitioner(), "c2_inference_mha_workaround.pte")


def path_tune_eager(bench: Bench, row: Row) -> Driver:
    """(d) torchtune eager with its KV cache: nothing exported."""
    row.note = "no export; prefill returns logits for every prompt position, as torchtune's decoder does"
    return TuneEagerDriver(build_tune_model, bench)


PATHS: list[PathSpec] = [
    PathSpec("a", "etblocks, torchtune model", path_tune_etblocks),
    PathSpec("b", "etblocks, same weights as HF Llama", path_hf_etblocks),
    PathSpec("c", "ExecuTorch inference MHA (its flow)", path_inference_mha),
    PathSpec("c2", "ExecuTorch inference MHA, workaround", path_inference_mha_workaround),
    PathSpec("d", "torchtune eager + KV cache", path_tune_eager),
]


# --------------------------------------------------------------------------------------------------
# Main


def format_notes(rows: Sequence[Row], reference: list[int]) -> str:
    """Per-row notes (failed rows too: their note explains the failure) and what the columns mean."""
    notes = [f"  ({r.key}) {r.note}" for r in rows if r.note]
    notes.append(f"  {DELEGATION}: delegated ops / all ops of the lowered program (etblocks.export.delegation; "
                 "shape bookkeeping not counted)")
    notes.append(f"  tokens=tune generate: leading greedy tokens equal to torchtune.generation.generate(top_k=1) on "
                 f"the KV-cached eager model ({len(reference)} tokens, {len(set(reference))} distinct)")
    return "notes:\n" + "\n".join(notes)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv, PATHS, __doc__, "torchtune_decode", SMOKE)
    specs = select_paths(args.rows, PATHS)
    bench = make_bench(args)
    reference = tune_reference_tokens(bench)
    rows, bandwidths = run_paths(specs, bench, keep_files=args.out_dir is not None, warm_prefill=True)
    roofline_tps = statistics.median(bandwidths) / bench.shape.weight_bytes_per_token()

    header = describe_run("torchtune llama3_2 builder to ExecuTorch/XNNPACK", bench, bandwidths)
    table = format_table(rows, roofline_tps, reference, reference_label="tune generate", extra_headers=[DELEGATION])
    notes = format_notes(rows, reference)
    print(header)
    print(table)
    print(notes)
    checks = Checks()
    # (c) fails to lower with ExecuTorch 1.5.1 (module docstring): a found bug this benchmark shows, not an error of
    # the run; any other failed row is.
    for row in rows:
        if row.key == "c" and row.status.startswith("failed"):
            row.status = "expected failure: " + row.status
    check_rows(checks, rows, reference, "tune generate", REQUIRED,
               {"c2": "known wrong after the first call (ExecuTorch 1.5.1), first token required"})
    return finish("torchtune_decode", args, checks, {"torchtune_decode": "\n".join([header.strip(), table, notes])},
                  started, shape=vars(bench.shape), prompt=bench.prompt, reference_tokens=reference,
                  bandwidths_gbs=spread_record([b / 1e9 for b in bandwidths]), roofline_tps=roofline_tps,
                  rows=[row_record(r) for r in rows])


if __name__ == "__main__":
    sys.exit(main())
