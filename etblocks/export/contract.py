"""The static program contract: what `prefill` and `decode` take and return, recorded in the program itself.

A static program has fixed shapes. With caller-owned state ("io") its methods take
`(tokens int64 [1, T], positions int64 [1, T], *masks, *state)` and return `(logits [1, T, V], *updates)`:
- positions of the T tokens; the rows of a call padded at the end carry position -1 when a state `skips_padding`;
- one additive mask `[T, L + T]` per mask group: the positional state (K/V rows) of full attention (L = the
  context), or of one sliding window W (L = W rows used as a ring);
- every tensor each mixer's state declares (`etblocks.state.StateSpec`: name, shape, dtype, update kind), in
  program order, and one update of each: new rows for `rows`, `ring` and `window` state, the whole new tensor
  for `replace` state (`etblocks.state.spec` says how the caller applies each). An attention layer declares
  `k_cache`, `v_cache` (six tensors in int8); MLA keeps its latent as k and the shared roped key as v.
With in-place state (hybrid partition) the methods take `(tokens int64 [1, T], input_pos int64 [1])` and return
the last token's logits `[1, V]`, like the dynamic contract at fixed T.
A program exported with LoRA adapters takes, after those, the slots of the active adapter: `slot_a [in, R]` per
group of layers sharing an input and `slot_b [R, out]` per entry of `adapters`, in `AdapterTable.input_names`
order (see `etblocks.export.adapters`; zeros: the base model).

The contract travels as JSON in the program's `etblocks_contract` method, so a runner never guesses.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from etblocks.export.adapters import AdapterSlot, AdapterTable
from etblocks.state.spec import StateSpec

CONTRACT_METHOD = "etblocks_contract"
CONTRACT_VERSION = "etblocks.static/2"


@dataclass(frozen=True)
class MaskGroup:
    """Positional state read under one mask: full attention (`window=None`, `length` = the context) or one sliding
    window (`length` = `window` rows used as a ring: position p lives in row p % length)."""

    name: str
    length: int
    window: int | None


@dataclass(frozen=True)
class StateInput:
    """One caller-owned state tensor: the `state` it belongs to (its index among the program's states, and the
    module path `owner` of that `State`), its declaration, and the mask group it is read under (positional
    state only)."""

    state: int
    owner: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    update: str
    mask: str | None = None
    skips_padding: bool = False

    @classmethod
    def declared(cls, state: int, owner: str, spec: StateSpec, mask: str | None) -> StateInput:
        dtype = str(spec.dtype).removeprefix("torch.")
        return cls(state, owner, spec.name, spec.shape, dtype, spec.update, mask, spec.skips_padding)

    @property
    def spec(self) -> StateSpec:
        return StateSpec(self.name, self.shape, getattr(torch, self.dtype), self.update, self.skips_padding)


@dataclass(frozen=True)
class StaticContract:
    chunk: int
    max_context_len: int
    vocab_size: int
    cache: str  # "io" or "inplace"
    dtype: str  # masks and float state, e.g. "float32"
    mask_value: float  # what masked mask entries hold
    masks: tuple[MaskGroup, ...] = ()
    states: tuple[StateInput, ...] = ()
    adapters: tuple[AdapterSlot, ...] = ()

    @property
    def methods(self) -> dict[str, int]:
        """Method name -> its fixed number of tokens."""
        return {"prefill": self.chunk, "decode": 1}

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def adapter_table(self) -> AdapterTable:
        return AdapterTable(self.adapters, self.dtype)

    @property
    def paddable(self) -> bool:
        """Whether a short call may go through `prefill` padded at the end: only when every update leaves its state
        as the real tokens left it (in-place state would store the padding; `replace` state folds it in unless it
        `skips_padding`)."""
        return self.cache == "io" and all(s.spec.paddable for s in self.states)

    def mask(self, name: str) -> MaskGroup:
        return next(g for g in self.masks if g.name == name)

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [s.shape for s in self.states]

    def inputs(self) -> list[str]:
        slots = self.adapter_table.input_names()
        if self.cache == "inplace":
            return ["tokens", "input_pos", *slots]
        state = [f"{s.name}.{s.state}" for s in self.states]
        return ["tokens", "positions", *(f"mask.{g.name}" for g in self.masks), *state, *slots]

    def outputs(self) -> list[str]:
        if self.cache == "inplace":
            return ["logits_last"]
        return ["logits", *(f"{s.name.removesuffix('_cache')}_new.{s.state}" for s in self.states)]

    def __str__(self) -> str:
        owners = {s.state: s.mask for s in self.states}
        groups = [f"{g.name} ({g.length} rows) x{sum(m == g.name for m in owners.values())}" for g in self.masks]
        kinds = Counter(s.update for s in self.states if s.mask is None)
        other = [f"{kind} x{n} tensors" for kind, n in kinds.items()]
        dtypes = sorted({s.dtype for s in self.states}) or [self.dtype]
        state = f"{self.cache} state ({', '.join(dtypes)})" + (f": {', '.join(groups + other)}" if groups or other else "")
        slots = f", LoRA slots in {len(self.adapters)} layers" if self.adapters else ""
        return f"prefill T={self.chunk}, decode T=1, context {self.max_context_len}, {state}{slots}"

    def to_json(self) -> str:
        body = asdict(self)
        body.update(contract=CONTRACT_VERSION, methods=self.methods, inputs=self.inputs(), outputs=self.outputs())
        return json.dumps(body)

    @classmethod
    def from_json(cls, text: str) -> StaticContract:
        body = json.loads(text)
        if body.get("contract") != CONTRACT_VERSION:
            raise ValueError(
                f"unknown program contract {body.get('contract')!r}; this etblocks reads {CONTRACT_VERSION!r} "
                "(export the model again with this etblocks)"
            )
        return cls(
            chunk=body["chunk"],
            max_context_len=body["max_context_len"],
            vocab_size=body["vocab_size"],
            cache=body["cache"],
            dtype=body["dtype"],
            mask_value=body["mask_value"],
            masks=tuple(MaskGroup(**g) for g in body["masks"]),
            states=tuple(StateInput(**{**s, "shape": tuple(s["shape"])}) for s in body["states"]),
            adapters=tuple(AdapterSlot.from_dict(slot) for slot in body.get("adapters", [])),
        )

    def as_constant(self) -> list[int]:
        """The JSON as UTF-8 byte values: ExecuTorch constant methods return ints, not strings."""
        return list(self.to_json().encode())

    @classmethod
    def from_constant(cls, values) -> StaticContract:
        return cls.from_json(bytes(int(v) for v in values).decode())
