"""`adapter_mode="programs"`: the base weights in one data file, each adapter a small program reading them, against
`peft.PeftModel`.

A tiny llama with two PEFT adapters (A: rank and alpha patterns on four module kinds; B: rsLoRA on every linear),
exported once: `model.pte` (the base), `model.ptd` (its weights), `model.A.pte`, `model.B.pte`. One Runner
switches A, B, none and A again: last-token logits equal PeftModel's (fp32, atol 1e-4) and 32 greedy tokens equal
its `generate`. The programs hold no base weight, each adapter program holds its adapter's tensors, and the adapter
runs as constant linears (no LoRA slot, no batched matmul). Files that do not fit are refused with the runner
left as it was.
"""

from __future__ import annotations

import copy
import re
import shutil
from collections import Counter

import pytest
import torch
from hf_models import hf_greedy, prompt_ids, tiny_model
from peft_refs import ADAPTERS, make_adapters, peft_reference, peft_with, swapped_with, switch_and_match_peft

import etblocks
from etblocks.backends import _REGISTRY, Backend, register_backend
from etblocks.errors import AdapterMismatchError, ConfigError, ProgramFileError
from etblocks.export.adapters import adapter_program_file, exported_adapters, lora_layers
from etblocks.export.delegation import DelegationSummary
from etblocks.export.external import weights_file

ATOL = 1e-4  # the exported program vs eager PEFT
CONTEXT = 64


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(base, PeftModel with A and B, the ExportResult, adapter dirs, each LoRA layer's active adapter and adapters
    before and after the export)."""
    base = tiny_model("llama")
    root = tmp_path_factory.mktemp("adapter-programs")
    dirs = make_adapters(base, root)
    model = swapped_with(base, dirs)

    def layers():
        return [(layer.active, dict(layer.adapters)) for _, layer in lora_layers(model)]

    before = layers()
    result = etblocks.export(model, backend="xnnpack", out=root / "model.pte", adapter_mode="programs")
    return base, peft_reference(base, dirs), result, dirs, (before, layers())


@pytest.mark.slow
def test_adapter_programs_switch_and_match_peft(exported):
    base, reference, result, _, (before, after) = exported
    assert result.data_path == weights_file(result.path) == result.path.with_name("model.ptd")
    assert result.adapters == {name: adapter_program_file(result.path, name) for name in ADAPTERS}
    assert exported_adapters(result.path) == result.adapters
    # the export leaves the model's adapters as they were: the same active one, the same (unfolded) weights
    assert after == before and {active for active, _ in before} == {"B"}
    runner = etblocks.Runner(result.path, adapters=result.adapters)  # finds model.ptd beside the program
    assert runner.data_path == result.data_path and runner.adapters == sorted(ADAPTERS)
    prompt = prompt_ids(12)
    seen = {}
    for name in ("A", "B", None, "A"):
        seen[name] = switch_and_match_peft(runner, reference, name, prompt, ATOL)
        assert runner.path == result.adapters.get(name, result.path)
    assert seen[None] == hf_greedy(base, prompt, 32)
    assert len({tuple(tokens) for tokens in seen.values()}) == 3, "each adapter must change the output"


@pytest.mark.slow
def test_programs_hold_no_base_weight_and_the_adapter_as_constant_linears(exported):
    base, _, result, dirs, _ = exported
    weight_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    assert result.data_path.stat().st_size >= weight_bytes  # every base weight (tied embedding once) is in model.ptd
    assert result.path.stat().st_size < weight_bytes / 4
    tensors = {name: read_peft_tensors(dirs[name]) for name in dirs}
    for name, program in result.adapters.items():
        adapter = sum(t.numel() * t.element_size() for t in tensors[name].values())
        assert adapter <= program.stat().st_size - result.path.stat().st_size < adapter + weight_bytes / 4, name
    base = result.delegation
    assert set(result.adapter_delegations) == set(ADAPTERS)
    adapted = {name: sum(".lora_A." in key for key in tensors[name]) for name in dirs}  # one lora_A per adapted linear
    for name, delegations in result.adapter_delegations.items():  # the LoRA path delegated whole, as linears
        summary = DelegationSummary.combine(delegations.values())
        assert summary.cpu_ops == base.cpu_ops and len(summary.partitions) == len(base.partitions), name
        added = summary.delegated_ops - base.delegated_ops
        # two linears and an add per adapted layer: the scale is folded into lora_B, no multiplication
        assert added == Counter({"aten.linear": 2 * adapted[name], "aten.add.Tensor": adapted[name]}), (name, added)


def read_peft_tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "adapter_model.safetensors")


@pytest.mark.slow
def test_adapter_programs_that_do_not_fit_are_refused(exported, tmp_path):
    _, _, result, _, _ = exported
    runner = etblocks.Runner(result.path, adapters=result.adapters)
    with pytest.raises(ConfigError, match="scale=0.5 for the adapter program"):
        runner.add_adapter("half", result.adapters["A"], 0.5)
    alone = tmp_path / "alone.pte"
    shutil.copy(result.path, alone)  # no alone.ptd beside it: its weights are not found
    with pytest.raises(ProgramFileError, match="needs their data file"):
        etblocks.Runner(alone)
    shorter = etblocks.swap(tiny_model("llama", num_hidden_layers=1), backend="xnnpack", max_seq_len=CONTEXT // 2)
    other = etblocks.export(shorter, backend="xnnpack", out=tmp_path / "other.pte")
    with pytest.raises(AdapterMismatchError, match=r"is not an adapter program of .*\['get_max_context_len'"):
        runner.add_adapter("other", other.path)  # another context: its metadata differ
    foreign = tmp_path / "model.foreign.pte"  # adapter A's program reading a weight the data file does not hold
    data = bytearray(result.adapters["A"].read_bytes())
    key = re.search(rb"[0-9a-f]{64}", data)  # a constant's content key (sha256, hex)
    data[key.start()] = ord("0") if data[key.start()] != ord("0") else ord("1")
    foreign.write_bytes(data)
    runner.add_adapter("foreign", foreign)  # same methods and metadata
    runner.set_adapter("A")
    with pytest.raises(AdapterMismatchError, match="is it an adapter program exported with"):
        runner.set_adapter("foreign")
    assert runner.path == result.adapters["A"] and runner.adapter == "A"  # still runs A
    with peft_with(exported[1], "A") as peft_model:
        expected = hf_greedy(peft_model, prompt_ids(4), 4)
    assert runner.generate(prompt_ids(4)[0].tolist(), max_new_tokens=4) == expected


class OwnWeights(Backend):
    """A backend with dynamic programs whose weights stay in its own compiled form (`external_weights` False)."""

    name = "own-weights"
    dynamic_shapes = True

    def partitioners(self, options) -> list:
        return []


def test_adapter_mode_is_checked_before_any_work(tmp_path):
    base = tiny_model("llama")
    dirs = make_adapters(base, tmp_path)
    model = swapped_with(base, {"B": dirs["B"]})
    with pytest.raises(ConfigError, match=r"adapter_mode='stacked' \(str\) is not accepted; choose one of \['slots', 'programs'\]"):
        etblocks.export(model, backend="xnnpack", out=tmp_path / "m.pte", adapter_mode="stacked")
    register_backend(OwnWeights)
    try:
        with pytest.raises(ConfigError, match=r"backend='own-weights' keeps them in its own compiled form .* "
                                              r"\['portable', 'xnnpack'\]"):
            etblocks.export(model, backend="own-weights", out=tmp_path / "m.pte", adapter_mode="programs")
    finally:
        _REGISTRY.pop("own-weights")
    static = etblocks.swap(copy.deepcopy(base), backend="xnnpack", max_seq_len=CONTEXT, shapes="static")
    etblocks.load_adapter(static, dirs["B"], name="B")
    with pytest.raises(ConfigError, match="takes dynamic programs"):
        etblocks.export(static, backend="xnnpack", out=tmp_path / "s.pte", adapter_mode="programs")
    assert not list(tmp_path.glob("*.pte"))
