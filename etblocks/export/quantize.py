"""Quantizing a static program with pt2e, method by method, calibrated by feeding it like a real generation.

The methods (prefill, decode) are prepared apart, calibrated together through the same feeder the runner uses,
given one set of activation ranges and converted; the quantizer comes from the backend (`Backend.quantizer`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from etblocks.errors import ConfigError
from etblocks.export.contract import StaticContract
from etblocks.export.feeders import StaticFeeder

if TYPE_CHECKING:
    from torchao.quantization.pt2e.quantizer import Quantizer


def _symbolic_inputs(program: torch.export.ExportedProgram) -> list[str]:
    user_inputs = set(program.graph_signature.user_inputs)
    found = []
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and node.name in user_inputs and isinstance(value, torch.Tensor):
            if any(not isinstance(size, int) for size in value.shape):
                found.append(f"{node.name} {list(value.shape)}")
    return found


def _check_calibrated(name: str, prepared: torch.fx.GraphModule) -> None:
    """Fail before `convert_pt2e` turns a range that was never seen, or that holds an infinity, into
    meaningless scales: both give NaN or useless outputs without any error."""
    observed = {node.target: node.args[0] for node in prepared.graph.nodes if node.op == "call_module"}
    for module_name, module in prepared.named_children():
        if not hasattr(module, "min_val") or module_name not in observed:
            continue
        what = f"method {name!r}: the observer of {observed[module_name]}"
        if module.min_val.numel() == 0 or bool((module.min_val > module.max_val).any()):
            raise ConfigError(f"{what} saw no data; calibrate(...) must run every method it is given")
        if not (torch.isfinite(module.min_val).all() and torch.isfinite(module.max_val).all()):
            raise ConfigError(
                f"{what} saw non-finite values (min {module.min_val.min().item()}, "
                f"max {module.max_val.max().item()}); feed finite calibration data, e.g. an additive mask of -255 "
                "rather than -inf"
            )


def _share_ranges(prepared: dict[str, torch.fx.GraphModule]) -> None:
    """Give the observers of one tensor in every method the union of their calibrated ranges.

    Methods traced from one module name their nodes alike, so an observer is matched across methods by its
    own name and the name and op of the node it observes. Unmatched observers keep their own range.
    """
    groups: dict[tuple, list] = {}
    for module in prepared.values():
        for node in module.graph.nodes:
            if node.op != "call_module":
                continue
            observer = module.get_submodule(node.target)
            if not hasattr(observer, "min_val"):
                continue
            observed = node.args[0]
            key = (node.target, observed.name, str(observed.target), tuple(observer.min_val.shape))
            groups.setdefault(key, []).append(observer)
    for observers in groups.values():
        low = torch.stack([o.min_val for o in observers]).amin(0)
        high = torch.stack([o.max_val for o in observers]).amax(0)
        for observer in observers:
            observer.min_val.copy_(low)
            observer.max_val.copy_(high)


def _own_extreme_constants(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`QnnQuantizer` clamps constants beyond float16's range (an `-inf` mask buffer, say) in place, and
    `ExportedProgram.module()` shares its tensors with the program: give those constants (only) a copy so
    the caller's program keeps its values.

    workaround(executorch 1.5.1): its `QnnQuantizer` writes into constants in place.
    """
    limit = torch.finfo(torch.float16).max
    for node in module.graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, attr = node.target.rpartition(".")
        owner = module.get_submodule(owner_path)
        tensor = getattr(owner, attr)
        if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
            continue
        if bool((~torch.isfinite(tensor) | (tensor.abs() >= limit)).any()):
            copied = tensor.detach().clone()
            if isinstance(tensor, torch.nn.Parameter):
                copied = torch.nn.Parameter(copied, tensor.requires_grad)
            setattr(owner, attr, copied)
    return module


def _drop_unused_attributes(module: torch.fx.GraphModule) -> None:
    """`convert_pt2e` leaves the float weights it replaced with quantized copies on the module; exported,
    they would be serialized next to the quantized ones.

    workaround(torchao 0.18.0): its `convert_pt2e` keeps the replaced float weights as attributes.
    """
    used = {node.target for node in module.graph.nodes if node.op == "get_attr"}
    for name, _ in [*module.named_parameters(), *module.named_buffers()]:
        if name not in used:
            owner_path, _, attr = name.rpartition(".")
            delattr(module.get_submodule(owner_path), attr)


def _producer_nodes(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """torchao's `collect_producer_nodes` (a node and the nodes it is computed from, up to `getattr` calls; None
    if a graph input is among them), visiting each node once and reading nodes inside list arguments too."""
    nodes, frontier, seen = [node], [node], {node}
    while frontier:
        for arg in frontier.pop().all_input_nodes:
            if arg in seen:
                continue
            if arg.op == "placeholder":
                return None
            seen.add(arg)
            nodes.append(arg)
            if not (arg.op == "call_function" and arg.target is getattr):
                frontier.append(arg)
    return nodes


@contextlib.contextmanager
def _constant_folding_that_finds_inputs() -> Iterator[None]:
    """torchao 0.18's constant folding in `convert_pt2e` keeps every node that an in-place copy's target is computed
    from unfolded when that target depends on a buffer and, as far as it can see, on no graph input. It does not see
    inputs behind list arguments (`cat`, `stack`) and walks without remembering what it has seen. Gemma 3n's AltUp
    (`corrections[1:] += first`, in every layer, over a `stack`) made that walk take time and memory exponential in
    the depth (20 GB for 4 layers) and kept every weight above it as an unfolded float quantize, on which
    Qualcomm's `AnnotateQuantAttrs` pass fails. This walk visits each node once and reads list arguments, so a
    target computed from the tokens keeps nothing from folding, as torchao means it to."""
    from torchao.quantization.pt2e import constant_fold

    original = constant_fold.collect_producer_nodes
    constant_fold.collect_producer_nodes = _producer_nodes
    try:
        yield
    finally:
        constant_fold.collect_producer_nodes = original


def quantize_programs(
    programs: dict[str, torch.export.ExportedProgram],
    quantizer: Quantizer,
    calibrate: Callable[[dict[str, Callable[..., Any]]], None],
) -> dict[str, torch.export.ExportedProgram]:
    """Quantize several methods of one model (e.g. prefill and decode) with pt2e.

    Each method is prepared on its own; `calibrate` gets all prepared callables at once, so it can drive
    them as a real generation does (prefill, then decode steps fed by the prefill's cache). Each is then
    converted and re-exported (non-strict, at its example inputs) for `to_edge_transform_and_lower`.

    Weight encodings depend only on the weights, so a layer's quantized weight and scales come out identical
    in every method and ExecuTorch stores them once. Activation ranges are made identical too: each takes
    the union of what its tensor saw in every method (ExecuTorch's Qualcomm LLM flow likewise gives prefill
    and decode one set of encodings). Calibrated apart, a prefill that only ever sees an empty cache gets a
    degenerate range (scale ~1e-9) for its cache inputs and would zero a non-empty one.

    Programs must have static shapes (QNN graphs are static): the re-export would silently fix them.
    """
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    for name, program in programs.items():
        if symbolic := _symbolic_inputs(program):
            raise ConfigError(
                f"method {name!r} has dynamic input shapes ({', '.join(symbolic)}); export each method at fixed shapes"
            )
    prepared = {
        name: prepare_pt2e(_own_extreme_constants(program.module()), quantizer) for name, program in programs.items()
    }
    with torch.no_grad():
        calibrate(dict(prepared))
    for name, module in prepared.items():
        _check_calibrated(name, module)
    _share_ranges(prepared)
    quantized = {}
    for name, module in prepared.items():
        with _constant_folding_that_finds_inputs():
            converted = convert_pt2e(module)
        _drop_unused_attributes(converted)
        args, kwargs = programs[name].example_inputs
        with torch.no_grad():
            quantized[name] = torch.export.export(converted, args, kwargs, strict=False)
    return quantized


def quantized_weight_constants(program: torch.export.ExportedProgram) -> dict[str, tuple[torch.Tensor, ...]]:
    """The stored constants of each quantized weight: `(integers, scale, zero_point)` per dequantize that
    reads a constant, keyed `"<module path>/<consumer node>"`. Lets callers check that methods share them."""
    dequantize = {
        torch.ops.quantized_decomposed.dequantize_per_tensor.default,
        torch.ops.quantized_decomposed.dequantize_per_channel.default,
    }
    signature = program.graph_signature
    names = {
        **signature.inputs_to_parameters,
        **signature.inputs_to_buffers,
        **signature.inputs_to_lifted_tensor_constants,
    }
    tensors = {**program.state_dict, **program.constants}

    def value(arg: Any) -> torch.Tensor:
        if isinstance(arg, torch.fx.Node):
            return tensors[names[arg.name]]
        return torch.tensor(arg)

    weights = {}
    for node in program.graph.nodes:
        if node.target not in dequantize or node.args[0].name not in names:
            continue
        for consumer in node.users:
            stack = consumer.meta.get("nn_module_stack") or {"": ("", None)}
            path = list(stack.values())[-1][0]
            weights[f"{path}/{consumer.name}"] = tuple(value(arg) for arg in node.args[:3])
    return weights


def top1_agreement(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Fraction of rows (over the last dim, e.g. logits `[.., V]`) whose argmax agrees: how often a
    quantized model would pick the same greedy token."""
    if reference.shape != other.shape:
        raise ConfigError(f"top1_agreement needs equal shapes; got {tuple(reference.shape)} and {tuple(other.shape)}")
    return (reference.argmax(-1) == other.argmax(-1)).float().mean().item()


CALIBRATION_DECODE_STEPS = 8


def default_calibration_prompts(contract: StaticContract, n_prompts: int = 4) -> list[list[int]]:
    """Seeded random token ids, one prompt per length from under a chunk to a few chunks. Random ids calibrate
    only roughly; give `calibration=` prompts from the model's real use for a deployable program."""
    generator = torch.Generator().manual_seed(0)
    room = contract.max_context_len - CALIBRATION_DECODE_STEPS
    lengths = [max(1, min(room, round(contract.chunk * f))) for f in (0.5, 1.0, 1.5, 3.0)][:n_prompts]
    return [torch.randint(0, contract.vocab_size, (n,), generator=generator).tolist() for n in lengths]


def calibrate_static(
    prepared: dict, contract: StaticContract, prompts: Sequence[Sequence[int]], adapters: Sequence[list[torch.Tensor]] = ()
) -> None:
    """Run each prompt through `prefill`, then a few greedy `decode` steps, so both methods see real inputs;
    with the base model, then with each adapter's slot inputs."""
    feeder = StaticFeeder(contract, lambda method, inputs: prepared[method](*inputs))
    for slots in [feeder.adapter_inputs, *adapters]:
        feeder.adapter_inputs = slots
        for prompt in prompts:
            feeder.reset()
            prompt = list(prompt)[: contract.max_context_len - CALIBRATION_DECODE_STEPS]
            logits = feeder.forward(prompt)
            for _ in range(CALIBRATION_DECODE_STEPS):
                logits = feeder.forward([int(torch.argmax(logits))])


def quantize_static(
    exported: dict[str, torch.export.ExportedProgram],
    contract: StaticContract,
    quantizer: Quantizer,
    calibration: Sequence[Sequence[int]] | None = None,
    adapters: Sequence[list[torch.Tensor]] = (),
) -> dict[str, torch.export.ExportedProgram]:
    """Annotate every method with `quantizer` (a backend's, `Backend.quantizer(scheme)`), calibrate, convert,
    re-export. `adapters`: the slot inputs of each adapter the program will run (see `etblocks.export.adapters`);
    the prompts run with each and with none, so the LoRA path's ranges cover them all."""
    prompts = calibration or default_calibration_prompts(contract)
    with torch.no_grad():
        return quantize_programs(exported, quantizer, lambda prepared: calibrate_static(prepared, contract, prompts, adapters))
