"""llama.cpp rows: the benchmark's transformers Llama written to GGUF, quantized by llama.cpp, run by llama-cpp-python.

The weights are the ones every other row runs (`harness.build_hf_model`), written as llama.cpp's own converter writes
a LlamaForCausalLM (`convert_hf_to_gguf.py`: tensor names, q/k rows permuted to llama.cpp's rope layout, the tied
embedding stored once) with a vocabulary of token ids only (`tokenizer.ggml.model = "none"`: the benchmarks feed
ids, never text). Q8_0 and Q4_0 files come from that F32 file through `llama_model_quantize` with `pure` set, as
`llama-quantize --pure` makes them: every matrix in the named type, the tied embedding / lm_head included, as
etblocks quantizes its lm_head; llama.cpp's default mix would store that one matrix in a wider type.

Runs use llama.cpp's CPU backend with one sequence, on as many threads as ExecuTorch's thread pool, with the KV cache
in the type the compared etblocks row keeps (`kv_type`: f32, or q8_0 beside an int8 cache). Flash attention (what
llama-cli's "auto" picks on a CPU) only with a q8_0 cache, which needs it: its CPU kernel takes Q.K through fp16,
which moved the logits of an F32 model by 1e-3 of their range, where without it they equal transformers' to 1e-6.
Benchmark-only: the `bench` extra builds llama.cpp for this host (docs/benchmarks.md gives the command); without it
the rows say so and the others run.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness import Bench, Driver, RebuiltWhenPickled, Row, Shape, Unavailable, build_hf_model

# llama.cpp's file types (`llama_ftype`) and cache types (`ggml_type`), by the names its tools take
FILE_TYPES = {"F32": 0, "Q4_0": 2, "Q8_0": 7}
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}
BYTES_PER_WEIGHT = {"F32": 4.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32}
REQUIREMENT = 'llama-cpp-python (pip install -e ".[bench]", which compiles llama.cpp)'


def import_llama_cpp() -> Any:
    """llama-cpp-python, or `Unavailable` naming the install that provides it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise Unavailable(f"needs {REQUIREMENT}: {e}") from e
    return llama_cpp


def import_gguf() -> Any:
    """The `gguf` package (llama.cpp's gguf-py), or `Unavailable`."""
    try:
        import gguf
    except ImportError as e:
        raise Unavailable(f"needs gguf ({REQUIREMENT}): {e}") from e
    return gguf


def permute_for_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from transformers' rotate-half order to llama.cpp's interleaved pairs (the converter's `permute`)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape)


def write_gguf(model: torch.nn.Module, path: Path) -> None:
    """An F32 GGUF of a transformers LlamaForCausalLM with a tied embedding, as llama.cpp's converter lays it out."""
    import gguf

    config = model.config
    if not config.tie_word_embeddings:
        raise ValueError("write_gguf writes tied embeddings only (the benchmark shape ties them)")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(FILE_TYPES["F32"])
    writer.add_tokenizer_model("none")

    def add(name: str, tensor: torch.Tensor) -> None:
        writer.add_tensor(name, tensor.detach().to(torch.float32).contiguous().numpy())

    inner = model.model
    add("token_embd.weight", inner.embed_tokens.weight)
    add("output_norm.weight", inner.norm.weight)
    for i, layer in enumerate(inner.layers):
        attention, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add(f"blk.{i}.attn_q.weight", permute_for_rope(attention.q_proj.weight, config.num_attention_heads))
        add(f"blk.{i}.attn_k.weight", permute_for_rope(attention.k_proj.weight, config.num_key_value_heads))
        add(f"blk.{i}.attn_v.weight", attention.v_proj.weight)
        add(f"blk.{i}.attn_output.weight", attention.o_proj.weight)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        add(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight)
        add(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight)
        add(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_gguf(source: Path, target: Path, file_type: str) -> None:
    """`llama-quantize --pure source target file_type`, through llama.cpp's library."""
    llama_cpp = import_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.pure = True
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize({source}, {file_type}) failed")


def gguf_weight_bytes_per_token(shape: Shape, file_type: str) -> float:
    """What one decoded token reads of a pure GGUF's weights (`harness.Shape.weight_bytes_per_token`'s count: every
    linear and the lm_head): F32 4 bytes a weight, Q8_0 34 bytes and Q4_0 18 bytes per block of 32 (fp16 scale)."""
    return shape.weight_bytes_per_token(1) * BYTES_PER_WEIGHT[file_type]


def rounded_through(model: torch.nn.Module, file_type: str) -> torch.nn.Module:
    """A copy of `model` whose matrices are rounded to a GGUF quantization type and back by gguf-py's reference
    quantizer (blocks along the input dimension, as the file stores them): the eager reference of a quantized row, as
    `harness.quantized_reference` is etblocks' (llama.cpp rounds activations to q8_0 blocks besides)."""
    import copy

    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[file_type]
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in rounded.parameters():
            if parameter.dim() == 2:
                weight = parameter.numpy()
                parameter.copy_(torch.from_numpy(quants.dequantize(quants.quantize(weight, kind), kind).reshape(
                    weight.shape)))
    return rounded


class LlamaCppDriver(RebuiltWhenPickled):
    """A GGUF loaded by llama-cpp-python: prefill is one `eval` of the prompt (llama.cpp splits it in batches of
    `n_batch`), decode one `eval` of a token; the greedy token is the argmax of the last position's logits."""

    def __init__(self, path: Path, context: int, threads: int, kv_type: str = "f32"):
        llama_cpp = import_llama_cpp()
        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
            flash_attn=kv_type != "f32", type_k=KV_TYPES[kv_type], type_v=KV_TYPES[kv_type], verbose=False)
        self.vocab = self.llm.n_vocab()
        # freed at exit while the library is still loaded: Llama.__del__ at interpreter teardown raises
        weakref.finalize(self, self.llm.close)

    def reset(self) -> None:
        self.llm.reset()  # the next eval drops every cached position from 0 on

    def last_logits(self) -> np.ndarray:
        """The logits of the last position evaluated (a view of llama.cpp's buffer, valid until the next eval)."""
        return np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.vocab,))

    def _next_token(self) -> int:
        return int(self.last_logits().argmax())

    def prefill(self, prompt: list[int]) -> int:
        self.llm.eval(prompt)
        return self._next_token()

    def decode(self, token: int, pos: int) -> int:
        if pos != self.llm.n_tokens:
            raise ValueError(f"decode at position {pos}, but llama.cpp holds {self.llm.n_tokens} positions")
        self.llm.eval([token])
        return self._next_token()


def llama_cpp_path(file_type: str, kv_type: str = "f32",
                   build_model: Callable[[Bench], torch.nn.Module] = build_hf_model) -> Callable[[Bench, Row], Driver]:
    """The `(bench, row) -> Driver` path of a llama.cpp row: convert (and quantize) the benchmark's weights (timed as
    the row's export), load them with a context of `bench.shape.max_seq_len`."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type={file_type!r}; expected one of {sorted(FILE_TYPES)}")
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type={kv_type!r}; expected one of {sorted(KV_TYPES)}")

    def path(bench: Bench, row: Row) -> Driver:
        from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

        llama_cpp = import_llama_cpp()
        import_gguf()
        if kv_type == "q8_0" and bench.shape.head_dim % 32:
            raise Unavailable(f"llama.cpp's q8_0 cache stores blocks of 32: head_dim {bench.shape.head_dim} is no "
                              "multiple of 32")
        model = build_model(bench)
        target = bench.out_dir / f"{row.key}_llama_cpp_{file_type}.gguf"
        converted = target if file_type == "F32" else target.with_suffix(".f32.gguf")
        start = time.perf_counter()
        write_gguf(model, converted)
        if file_type != "F32":
            quantize_gguf(converted, target, file_type)
            converted.unlink()
        row.export_s = time.perf_counter() - start
        del model
        row.pte_mb = target.stat().st_size / 1e6
        threads = _threadpool_get_thread_count()
        row.note = (f"llama-cpp-python {llama_cpp.__version__}, {file_type} GGUF (pure), KV cache {kv_type}"
                    f"{'' if kv_type == 'f32' else ' (flash attention)'}, {threads} threads; export = conversion"
                    f"{' + quantization' if file_type != 'F32' else ''}")
        return LlamaCppDriver(target, bench.shape.max_seq_len, threads, kv_type)

    return path


# ggml's x86 options by the /proc/cpuinfo flags each needs (GGML_AVX512 needs the five AVX-512 subsets it compiles for)
GGML_X86_OPTIONS = {
    "GGML_SSE42": ("sse4_2",), "GGML_AVX": ("avx",), "GGML_F16C": ("f16c",), "GGML_FMA": ("fma",),
    "GGML_BMI2": ("bmi2",), "GGML_AVX2": ("avx2",), "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"), "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",), "GGML_AVX512_BF16": ("avx512_bf16",),
}


def cmake_args(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """CMAKE_ARGS that build llama.cpp for this x86 host's vector extensions but AMX: ggml's AMX matmul crashes in
    `ggml_backend_amx_mul_mat` on this machine kind (ggml-org/llama.cpp#20824, open; ollama and dspy drop the AMX
    build too), and `GGML_NATIVE` (the default) turns it on wherever the CPU has it. Elsewhere (no x86 `flags` line,
    e.g. Arm): nothing, llama.cpp's own native build."""
    flags = next((set(line.partition(":")[2].split()) for line in cpuinfo.read_text().splitlines()
                  if line.startswith("flags")), None)
    if flags is None:
        return ""
    options = [f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}"
               for option, needs in GGML_X86_OPTIONS.items()]
    amx_off = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return " ".join(["-DGGML_NATIVE=OFF", *options, *amx_off])


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--cmake-args"]:
        raise SystemExit('usage: CMAKE_ARGS="$(python benchmarks/llamacpp.py --cmake-args)" pip install -e ".[bench]"')
    print(cmake_args())
