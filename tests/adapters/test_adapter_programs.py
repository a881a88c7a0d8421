"""Adapters as separate files over one exported base, switched at run time, against `peft.PeftModel`.

Tiny qwen3 with two PEFT adapters (A: rank and alpha patterns on four module kinds; B: rsLoRA on every
linear). One XNNPACK program with LoRA slots and a file per adapter; one Runner switches A, B, none and A again
without reloading: last-token logits equal PeftModel's (fp32, atol 1e-4) and 32 greedy tokens equal its
`generate`, none equals the base model's own program. The base file is the base's size and each adapter file
about its tensors; adapter files that do not fit the program are refused and change nothing.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hf_models import hf_greedy, prompt_ids, tiny_model
from peft_refs import (
    ADAPTERS,
    SHARED_INPUT_GROUPS,
    first_layer_groups,
    make_adapter,
    make_adapters,
    peft_reference,
    peft_with,
    swapped_with,
    switch_and_match_peft,
)
from safetensors.torch import load_file

import etblocks
from etblocks.adapters import merge_adapter
from etblocks.adapters.files import adapter_tensors, save_adapter_file
from etblocks.adapters.peft import read_peft_adapter
from etblocks.backends import _REGISTRY, Backend, get_backend, register_backend
from etblocks.errors import AdapterMismatchError, ConfigError, ProgramFileError
from etblocks.adapters.lora import LoRATensors
from etblocks.export.adapters import AdapterTable, adapter_slots, lora_layers, slot_buffers
from etblocks.export.programs import dynamic_program

ATOL = 1e-4  # the exported program vs eager PEFT
CONTEXT = 64


def assert_switches_match_peft(runner: etblocks.Runner, reference, prompt: torch.Tensor, names=("A", "B", None)) -> None:
    """After `runner.set_adapter(name)` the program's 32 greedy tokens equal PeftModel's with that adapter."""
    for name in names:
        runner.set_adapter(name)
        with peft_with(reference, name):
            expected = hf_greedy(reference, prompt, 32)
        assert runner.generate(prompt[0].tolist(), max_new_tokens=32) == expected, name


def test_slots_compute_what_the_named_adapters_compute(tmp_path):
    """Eager: the slot form filled with an adapter's `set_adapter` inputs equals the adapter itself, with each
    layer's own slot_a and with one slot_a per group of layers reading one input (q/k/v, gate/up); zero slots
    equal the base."""
    base = tiny_model("llama")
    make_adapter(base, tmp_path / "B", 1, **ADAPTERS["B"])
    model = swapped_with(base, {"B": tmp_path / "B"})
    tokens = prompt_ids(10)
    with torch.no_grad():
        expected = model(tokens).logits
        for run in (None, lambda: model(tokens)):
            with adapter_slots(model, run) as table:
                buffers = slot_buffers(model, table)
                for slot_buffer, value in zip(buffers, table.inputs(adapter_tensors(model, "B")), strict=True):
                    slot_buffer.copy_(value)
                assert (model(tokens).logits - expected).abs().max().item() <= ATOL
                for slot_buffer in buffers:
                    slot_buffer.zero_()
                assert (model(tokens).logits - base(tokens).logits).abs().max().item() <= ATOL
                assert repr(model.model.layers[0]).count("slot_rank=") == 7  # grouped layers own no slot_a
            kinds = [slot.target.rsplit(".", 1)[1] for slot in table.slots[:7]]
            groups = [slot.group for slot in table.slots[:7]]
            assert kinds == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            assert groups == ([None] * 7 if run is None else [0, 0, 0, None, 4, 4, None])
    assert not any(layer.has_slot for _, layer in lora_layers(model))


# qwen3: llama's layers plus q/k norms after the projections, which the adapted q/k must precede (a plain llama
# would not tell); tiny llama's programs are tests/adapters/test_adapter_program_files.py and the CLI's.
@pytest.fixture(scope="module", params=["qwen3"])
def exported(request, tmp_path_factory):
    """(base, PeftModel with A and B, the adapter program's ExportResult, the base-only program, adapter dirs)."""
    base = tiny_model(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    dirs = make_adapters(base, root)
    result = etblocks.export(swapped_with(base, dirs), backend="xnnpack", out=root / "model.pte")
    plain = etblocks.swap(copy.deepcopy(base), backend="xnnpack", max_seq_len=CONTEXT)
    base_result = etblocks.export(plain, backend="xnnpack", out=root / "base.pte")
    return base, peft_reference(base, dirs), result, base_result, dirs


@pytest.mark.slow
def test_switching_adapters_matches_peft(exported):
    base, reference, result, base_result, _ = exported
    assert set(result.adapters) == set(ADAPTERS)
    runner = etblocks.Runner(result.path, adapters=result.adapters)
    program = runner.program
    prompt = prompt_ids(12)
    base_tokens = etblocks.Runner(base_result.path).generate(prompt[0].tolist(), max_new_tokens=32)
    assert base_tokens == hf_greedy(base, prompt, 32)
    seen = {}
    for name in ("A", "B", None, "A"):
        seen[name] = switch_and_match_peft(runner, reference, name, prompt, ATOL)
    assert seen[None] == base_tokens
    assert len({tuple(tokens) for tokens in seen.values()}) == 3, "each adapter must change the output"
    assert runner.program is program  # switched in place, never reloaded
    assert first_layer_groups(runner.adapter_table) == SHARED_INPUT_GROUPS


def test_layers_reading_one_input_share_one_projection(tmp_path):
    """The traced program computes `x @ A^T` once per group of layers reading one input: one batched matmul
    for q/k/v, one for gate/up, one each for o and down, and one B-side matmul per layer."""
    base = tiny_model("llama")
    make_adapter(base, tmp_path / "B", 1, **ADAPTERS["B"])
    program = dynamic_program(swapped_with(base, {"B": tmp_path / "B"}), None)
    layers = base.config.num_hidden_layers
    for run, a_side in ((None, 7), (lambda: program.module(*program.example_inputs()), 4)):
        with adapter_slots(program.module, run):
            ep = torch.export.export(program.module, program.example_inputs(), dynamic_shapes=program.dynamic_shapes())
        matmuls = sum(node.target == torch.ops.aten.bmm.default for node in ep.graph.nodes)
        assert matmuls == layers * (a_side + 7)


def test_a_table_without_groups_keeps_the_layout_of_earlier_programs():
    """Programs exported before groups record slots without `group`: each keeps its own `slot_a [in, r]` before
    its `slot_b [r, out]`, so they run as they did."""
    old = {"slots": [dict(target="m.q_proj", rows=None, in_features=8, out_features=4, rank=2),
                     dict(target="m.k_proj", rows=[0, 2], in_features=8, out_features=2, rank=3)], "dtype": "float32"}
    table = AdapterTable.from_json(json.dumps(old))
    assert table.input_names() == ["slot_a.0", "slot_b.0", "slot_a.1", "slot_b.1"]
    lora_A, lora_B = torch.randn(2, 8), torch.randn(4, 2)
    inputs = table.inputs({"m.q_proj": LoRATensors(lora_A, lora_B, 0.5)})
    assert [list(t.shape) for t in inputs] == [[8, 2], [2, 4], [8, 3], [3, 2]]
    assert torch.equal(inputs[0], lora_A.T) and torch.equal(inputs[1], lora_B.T * 0.5)
    assert not any(t.any() for t in inputs[2:])


@pytest.mark.slow
def test_base_and_adapter_file_sizes(exported):
    _, _, result, base_result, dirs = exported
    slots = len(etblocks.Runner(result.path).adapter_table.slots)
    slots_overhead = result.path.stat().st_size - base_result.path.stat().st_size
    assert 0 <= slots_overhead <= 3000 * slots, f"{slots} slots and the set_adapter method add {slots_overhead} B"
    for name, file in result.adapters.items():
        peft_bytes = sum(t.numel() * t.element_size() for t in load_file(dirs[name] / "adapter_model.safetensors").values())
        overhead = file.stat().st_size - peft_bytes
        assert 0 <= overhead <= 4096 + 32 * len(read_peft_adapter(dirs[name])), f"{name}: {overhead} B beyond its tensors"


@pytest.mark.slow
def test_adapter_files_that_do_not_fit_are_refused(exported, tmp_path):
    _, _, result, base_result, _ = exported
    runner = etblocks.Runner(result.path, adapters={"A": result.adapters["A"]})
    model_type = runner.adapter_table.slots[0].target  # any target: the tiny models share names
    assert model_type.startswith("model.layers.0.")

    def file_for(name: str, base: torch.nn.Module, **options):
        make_adapter(base, tmp_path / name, 0, **options)
        return save_adapter_file(read_peft_adapter(tmp_path / name), tmp_path / f"{name}.ptd")

    wider = file_for("wider", tiny_model("llama", hidden_size=96), r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(AdapterMismatchError, match=r"self_attn\.q_proj: the adapter has lora_A \[4, 96\].*lora_A \[r, 64\]"):
        runner.add_adapter("W", wider)
    deeper = file_for("deeper", tiny_model("llama", num_hidden_layers=3), r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(AdapterMismatchError, match=r"targets model\.layers\.2\.self_attn\.q_proj, which has no LoRA slot"):
        runner.add_adapter("D", deeper)
    larger = file_for("larger", tiny_model("llama"), r=16, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(AdapterMismatchError, match=r"r <= 8"):
        runner.add_adapter("L", larger)
    corrupt = tmp_path / "corrupt.ptd"
    corrupt.write_bytes(result.adapters["A"].read_bytes()[:100])
    with pytest.raises(ProgramFileError, match=r"corrupt\.ptd is truncated: its header declares \d+ bytes, the file holds 100"):
        runner.add_adapter("C", corrupt)
    with pytest.raises(ProgramFileError, match="missing.ptd does not exist; expected an etblocks adapter file"):
        runner.add_adapter("M", tmp_path / "missing.ptd")
    assert runner.adapters == ["A"]
    with pytest.raises(ConfigError, match=r"name='B' is not an added adapter; added: \['A'\]"):
        runner.set_adapter("B")
    with pytest.raises(ConfigError, match="this program has no LoRA slots"):
        etblocks.Runner(base_result.path).add_adapter("A", result.adapters["A"])


@pytest.mark.slow
def test_merged_adapter_exports_as_a_plain_program(tmp_path):
    """One adapter baked in: `merge_adapter` leaves no LoRA layer, so the program has no slots and generates
    PeftModel's tokens with that adapter."""
    base = tiny_model("qwen3")
    dirs = make_adapters(base, tmp_path)
    reference = peft_reference(base, dirs)
    reference.set_adapter("B")
    model = swapped_with(base, dirs)
    assert len(merge_adapter(model, "B")) == 2 * 7
    assert not lora_layers(model)
    tokens = prompt_ids(12)
    with torch.no_grad():
        assert (model(tokens).logits - reference(tokens).logits).abs().max().item() <= ATOL
    result = etblocks.export(model, backend="xnnpack", out=tmp_path / "merged.pte")
    assert result.adapters == {} and "set_adapter" not in result.methods
    assert etblocks.Runner(result.path).generate(tokens[0].tolist(), max_new_tokens=32) == hf_greedy(reference, tokens, 32)


@pytest.mark.slow
def test_hybrid_static_program_takes_the_slots_as_inputs(tmp_path):
    """The static in-place (hybrid) contract: slots are inputs of prefill and decode after tokens and input_pos;
    A, B and none generate PeftModel's tokens for a prompt longer than a chunk."""
    base = tiny_model("llama")
    dirs = make_adapters(base, tmp_path)
    model = swapped_with(base, dirs, chunk=16, shapes="static", cache="inplace", partition="hybrid")
    result = etblocks.export(model, backend="xnnpack", out=tmp_path / "hybrid.pte")
    runner = etblocks.Runner(result.path, adapters=result.adapters)
    assert runner.contract.inputs()[:3] == ["tokens", "input_pos", "slot_a.0"]
    assert_switches_match_peft(runner, peft_reference(base, dirs), prompt_ids(21))


class DynamicOpenvino(Backend):
    """OpenVINO's partitioner offered for dynamic programs: one that cannot be told to leave nodes on CPU."""

    name = "openvino-dynamic"
    requires = "openvino"
    dynamic_shapes = True

    def partitioners(self, options) -> list:
        return get_backend("openvino").partitioners(options)


def test_dynamic_program_with_slots_refuses_a_partitioner_it_cannot_filter(tmp_path):
    """A partitioner that cannot be told to leave the slot reads alone is refused before any export work."""
    base = tiny_model("llama")
    make_adapter(base, tmp_path / "A", 0, **ADAPTERS["A"])
    model = swapped_with(base, {"A": tmp_path / "A"})
    with pytest.raises(ConfigError, match=r"backend='openvino' takes fixed shapes only"):
        etblocks.export(model, backend="openvino", out=tmp_path / "never.pte")
    register_backend(DynamicOpenvino)
    try:
        with pytest.raises(ConfigError, match=r"LoRA slots in a dynamic program .* swap with shapes='static'.*got OpenvinoPartitioner"):
            etblocks.export(model, backend="openvino-dynamic", out=tmp_path / "never.pte")
    finally:
        _REGISTRY.pop("openvino-dynamic")
    assert not (tmp_path / "never.pte").exists()


@pytest.mark.slow
def test_openvino_static_program_switches_adapters(tmp_path):
    """The openvino recipe (static, io caches): the slots are inputs, OpenVINO runs the LoRA path here."""
    pytest.importorskip("openvino")
    base = tiny_model("qwen3")
    dirs = make_adapters(base, tmp_path)
    result = etblocks.export(swapped_with(base, dirs, "openvino", chunk=16), backend="openvino", out=tmp_path / "ov.pte")
    assert result.delegation.ops_per_delegate.get("OpenvinoBackend", 0) > 0
    runner = etblocks.Runner(result.path, adapters=result.adapters)
    assert_switches_match_peft(runner, peft_reference(base, dirs), prompt_ids(13))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["coreml", "vulkan"])
def test_npu_programs_with_slot_inputs_lower_whole(backend, tmp_path):
    """Core ML and Vulkan (lower here, run on device) take the slot inputs into their one partition per method."""
    base = tiny_model("llama")
    make_adapter(base, tmp_path / "A", 0, **ADAPTERS["A"])
    model = swapped_with(base, {"A": tmp_path / "A"}, backend, chunk=16)
    result = etblocks.export(model, backend=backend, out=tmp_path / f"{backend}.pte")
    assert list(result.adapters) == ["A"]
    for method, summary in result.delegations.items():
        assert len(summary.partitions) == 1 and summary.n_cpu_ops == 0, f"{method}: {summary}"
