"""The probe that guards every swap: each replacement must reproduce its original on the inputs the original saw.

The untouched model runs once over random tokens; a forward hook records what each original module received and
returned. Each replacement is then driven the way a program drives it: a prefill of the first tokens from empty
state, a short continuation, then single-token decode steps that read the rows the earlier calls wrote (from its
own buffers, or, caller-owned, from tensors kept the way a static program's caller keeps them). A causal module's
outputs for the tokens of a step are the original's outputs for those rows, so every call is compared with a slice
of the one recorded run: a replacement whose prefill is right but whose cached rows are misread fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from etblocks.attention.masks import additive_mask, allowed_keys
from etblocks.errors import UnsupportedModelError
from etblocks.state.base import State, find_states, reset_states
from etblocks.state.spec import RING, apply_update, held_positions
from etblocks.swap.kinds import ModelKind

# Odd lengths: a probe length equal to another dimension would make the sequence axis ambiguous when slicing.
PROBE_LEN = 19
# After the prefill: one call of 2 tokens (a dynamic program's next chunk), then single-token decode steps.
CONTINUATION = (2, 1, 1)
TOLERANCE = 1e-4  # relative to the largest expected value (at least 1)


def probe_length(replacements: list[nn.Module], max_seq_len: int) -> int:
    """Long enough that decode steps read a sliding window's ring after it wrapped."""
    windows = [spec.rows for new in replacements for state in find_states(new) for spec in state.specs() if spec.update == RING]
    return min(max([PROBE_LEN] + [w + sum(CONTINUATION) + 3 for w in windows]), max_seq_len)


@dataclass
class Call:
    """A module's last call in the recorded run, and how many times the run called it."""

    args: tuple
    kwargs: dict
    output: torch.Tensor
    count: int = 1


class Probe:
    """One recorded run of the untouched `model` over `length` random tokens; `mismatch` checks a replacement."""

    def __init__(self, model: nn.Module, kind: ModelKind, originals: list[nn.Module], length: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.length = length
        self.tokens = torch.randint(0, kind.vocab_size(model), (1, length), generator=generator)
        self.positions = torch.arange(length)
        self.calls = _record(model, kind, originals, self.tokens, self.positions)
        self.model, self.kind = model, kind

    @torch.no_grad()
    def position_mismatch(self, first_mixer: nn.Module) -> str | None:
        """Why the model would not decode from absolute positions (None: it does). Programs call it with one token
        at position p; what reaches its first mixer must be what that mixer saw for row p of the whole sequence.
        Models whose embeddings count positions from the call (learned absolute positions that ignore
        `position_ids`) fail: every decode step would embed position 0."""
        recorded = self.calls.get(id(first_mixer))
        if recorded is None or recorded.count > 1:
            return None  # not called, or called in a loop: `mismatch` says so
        single = _record(self.model, self.kind, [first_mixer], self.tokens[:, -1:], self.positions[-1:])[id(first_mixer)]
        expected, actual = _hidden_states(recorded)[:, -1:], _hidden_states(single)
        if actual.shape == expected.shape and (actual - expected).abs().max().item() <= TOLERANCE * max(1.0, expected.abs().max().item()):
            return None
        return (
            f"{type(self.model).__name__} does not place a token by the position_ids it is called with: the input of "
            f"its first token mixer for one token at position {self.length - 1} differs from that row of the whole "
            "sequence (embeddings that count positions from the call); its programs would decode every token as "
            "the first"
        )

    def steps(self) -> list[tuple[int, int]]:
        """`(start, stop)` of each call: a prefill, then `CONTINUATION` (fewer when the probe is short)."""
        stops = [self.length]
        for n in reversed(CONTINUATION):
            if stops[0] - n >= 2:
                stops.insert(0, stops[0] - n)
        return list(zip([0] + stops[:-1], stops))

    @torch.no_grad()
    def mismatch(self, name: str, original: nn.Module, new: nn.Module, sources: list[tuple[nn.Module, nn.Module]] = ()) -> str | None:
        """Why `new` is not a replacement for `original` (None: it matches on every call). A replacement without
        state is checked on the whole probe at once. `sources` are `(original, replacement)` pairs of the blocks
        whose state `new` reads (KV-shared attention reads an earlier layer's keys and values): each runs on its
        own recorded inputs before `new` at every call, as the model would run it."""
        call = self.calls.get(id(original))
        if call is None:
            return f"{name} ({type(original).__name__}) was not called in a forward pass"
        states = find_states(new)
        if states and call.count > 1:  # weight-shared loops (HRM): one cache row per position cannot hold each pass
            return (
                f"{name} ({type(original).__name__}) runs {call.count} times in one forward pass; the state of its "
                "replacement holds one pass per position"
            )
        driven = [(self.calls[id(source)], block, _CallerState(find_states(block))) for source, block in sources]
        caller = _CallerState(states)
        try:
            for start, stop in self.steps() if states or driven else [(0, self.length)]:
                try:
                    for source_call, block, source_caller in driven:
                        self._drive(source_call, block, source_caller, start, stop)
                    actual = self._drive(call, new, caller, start, stop)
                except Exception as exc:  # any failure of the replacement on real inputs means "cannot swap"
                    return f"{name} ({type(original).__name__}): the etblocks block failed on the probe input: {exc}"
                expected = _cut(call.output, self.length, start, stop)
                error = (actual - expected).abs().max().item()
                tolerance = TOLERANCE * max(1.0, expected.abs().max().item())
                if not error <= tolerance:
                    where = "the prefill" if start == 0 else f"the call at positions {start}..{stop - 1} after the prefill"
                    return (
                        f"{name} ({type(original).__name__}) does not match its etblocks replacement on {where} of a "
                        f"{self.length}-token probe: max abs error {error:.3g} > tolerance {tolerance:.3g}"
                    )
            return None
        finally:
            for block, held in [(new, caller)] + [(block, source_caller) for _, block, source_caller in driven]:
                reset_states(block)
                for state in held.states:
                    state.unbind()

    def _drive(self, call: Call, new: nn.Module, caller: _CallerState, start: int, stop: int) -> torch.Tensor:
        """Run `new` on rows `start:stop` of `call`'s inputs with its caller-owned state kept by `caller`."""
        kwargs = call.kwargs
        if hasattr(new, "take_positions") and kwargs.get("position_ids") is None:  # upstream hands it none (`FedPositions`)
            kwargs = {**kwargs, "position_ids": self.positions[None]}
        caller.bind(self.positions[start:stop], start)
        args, step_kwargs = _cut((call.args, kwargs), self.length, start, stop)
        actual = new(*args, **step_kwargs)
        caller.take(start, stop - start)
        return actual[0] if isinstance(actual, tuple) else actual


def _hidden_states(call: Call) -> torch.Tensor:
    return call.args[0] if call.args else call.kwargs["hidden_states"]


def _cut(value, length: int, start: int, stop: int, cut: dict | None = None):
    """`value` with every tensor whose dim 1 is the probe's sequence cut to `start:stop` (tuples, lists and dicts
    walked): hidden states `[B, T, D]`, rope tables `[B, T, R]`, positions `[B, T]`, padding masks `[B, T]`. A
    tensor passed twice stays one tensor (torchtune calls self-attention as `attn(x, x)`)."""
    cut = {} if cut is None else cut
    if isinstance(value, torch.Tensor):
        if id(value) not in cut:
            cut[id(value)] = value[:, start:stop] if value.ndim >= 2 and value.shape[1] == length else value
        return cut[id(value)]
    if isinstance(value, (tuple, list)):
        return type(value)(_cut(v, length, start, stop, cut) for v in value)
    if isinstance(value, dict):
        return {k: _cut(v, length, start, stop, cut) for k, v in value.items()}
    return value


class _CallerState:
    """Keeps the caller-owned states of one replacement as a static program's caller does: zeros at first, each
    call's update applied (`apply_update`), positional ones bound with a mask over the rows held so far."""

    def __init__(self, states: list[State]) -> None:
        self.states = [s for s in states if s.caller_owned]
        self.tensors = [[spec.zeros() for spec in s.specs()] for s in self.states]

    def bind(self, q_pos: torch.Tensor, pos: int) -> None:
        for state, tensors in zip(self.states, self.tensors):
            specs = state.specs()
            ring = next((s.rows for s in specs if s.update == RING), None)
            positional = next((s for s in specs if s.positional), None)
            mask = None
            if positional is not None:
                held = held_positions(positional.update, positional.rows, pos)
                mask = additive_mask(allowed_keys(q_pos, torch.cat((held, q_pos)), ring))
            state.bind(tensors, mask)

    def take(self, pos: int, n: int) -> None:
        for i, state in enumerate(self.states):
            updates = state.take()
            self.tensors[i] = [apply_update(spec, t, u, pos, n) for spec, t, u in zip(state.specs(), self.tensors[i], updates)]


@torch.no_grad()
def _record(model: nn.Module, kind: ModelKind, modules: list[nn.Module], tokens: torch.Tensor, positions: torch.Tensor) -> dict[int, Call]:
    """Run the untouched model once over `tokens` at `positions` and record each listed module's call, by id."""
    calls: dict[int, Call] = {}

    def record(module, args, kwargs, output):
        earlier = calls.get(id(module))
        count = 1 + (earlier.count if earlier else 0)
        calls[id(module)] = Call(args, kwargs, output[0] if isinstance(output, tuple) else output, count)

    hooks = [m.register_forward_hook(record, with_kwargs=True) for m in modules]
    was_training = model.training
    model.eval()
    try:
        # Every position's logits: models that skip rows only the last logits would need (Gemma 4 feeds its
        # KV-shared layers the kept rows alone) show each module every row.
        kind.logits(model, tokens, positions.unsqueeze(0), last_only=False)
    except Exception as exc:  # the untouched model itself: nothing to compare with
        raise UnsupportedModelError(f"{type(model).__name__} failed on a probe input of {tokens.shape[1]} tokens: {exc}") from exc
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return calls
