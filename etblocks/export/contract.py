"""The static program contract: what `prefill` and `decode` take and return, recorded in the program itself.

A static program has fixed shapes. With caller-owned ("io") caches its methods take
`(tokens int64 [1, T], positions int64 [1, T], *masks, *caches)` and return `(logits [1, T, V], *new_rows)`:
- one additive mask `[T, L + T]` per cache group (full attention, or a sliding window W with its own length L),
- per layer `k_cache`, `v_cache` `[1, L, Hkv, Dk]`, `[1, L, Hkv, Dv]` of its group's length, and the T new rows
  of each (`[1, T, Hkv, Dk]`, `[1, T, Hkv, Dv]`). An int8 cache (`kv_quantize="int8"`) has six tensors per layer:
  int8 `k_cache`, float32 `k_scales` and int8 `k_zero_points` `[1, L, Hkv, 1]`, the same for v
  (`etblocks.kv_cache.io.io_cache_layout`).
With in-place caches (hybrid partition) they take `(tokens int64 [1, T], input_pos int64 [1])` and return the
last token's logits `[1, V]`, like the dynamic contract at fixed T.
A program exported with LoRA adapters takes, after those, the slots of the active adapter: `slot_a [in, r]` and
`slot_b [r, out]` per entry of `adapters` (see `etblocks.export.adapters`; zeros: the base model).

The contract travels as JSON in the program's `etblocks_contract` method, so a runner never guesses.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from etblocks.export.adapters import AdapterSlot, AdapterTable
from etblocks.kv_cache.io import CacheTensor, io_cache_layout

CONTRACT_METHOD = "etblocks_contract"
CONTRACT_VERSION = "etblocks.static/1"


@dataclass(frozen=True)
class CacheGroup:
    """Layers that share one mask: full attention (`window=None`, `length` = the context) or one sliding window
    (`length` = `window` rows used as a ring: position p lives in row p % length)."""

    name: str
    length: int
    window: int | None


@dataclass(frozen=True)
class LayerCache:
    """One layer's two caches: `k` rows `[n_kv_heads, k_dim]` and `v` rows `[n_kv_heads, v_dim]` per position,
    in the program's dtype or, with `kv_quantize="int8"`, in int8 with per-row scales and zero points. MLA layers
    keep one "head": the compressed latent as k and the shared roped key as v."""

    group: str
    n_kv_heads: int
    k_dim: int
    v_dim: int
    kv_quantize: str | None = None


@dataclass(frozen=True)
class StaticContract:
    chunk: int
    max_context_len: int
    vocab_size: int
    cache: str  # "io" or "inplace"
    dtype: str  # masks and caches, e.g. "float32"
    mask_value: float  # what masked mask entries hold
    groups: tuple[CacheGroup, ...] = ()
    layers: tuple[LayerCache, ...] = ()
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

    def group(self, name: str) -> CacheGroup:
        return next(g for g in self.groups if g.name == name)

    def cache_tensors(self) -> list[tuple[int, CacheTensor]]:
        """`(layer, tensor)` for every cache input in order: `[1, L, Hkv, Dk]`, `[1, L, Hkv, Dv]` per layer (or
        its int8 layout); the new rows come back in the same order, with T rows."""
        tensors = []
        for i, spec in enumerate(self.layers):
            length = self.group(spec.group).length
            layout = io_cache_layout(spec.n_kv_heads, spec.k_dim, spec.v_dim, length, self.torch_dtype, spec.kv_quantize)
            tensors += [(i, tensor) for tensor in layout]
        return tensors

    def cache_shapes(self) -> list[tuple[int, ...]]:
        return [tensor.shape for _, tensor in self.cache_tensors()]

    def inputs(self) -> list[str]:
        slots = [f"slot_{ab}.{i}" for i in range(len(self.adapters)) for ab in ("a", "b")]
        if self.cache == "inplace":
            return ["tokens", "input_pos", *slots]
        caches = [f"{tensor.name}.{i}" for i, tensor in self.cache_tensors()]
        return ["tokens", "positions", *(f"mask.{g.name}" for g in self.groups), *caches, *slots]

    def outputs(self) -> list[str]:
        if self.cache == "inplace":
            return ["logits_last"]
        return ["logits", *(f"{tensor.name.removesuffix('_cache')}_new.{i}" for i, tensor in self.cache_tensors())]

    def __str__(self) -> str:
        groups = ", ".join(
            f"{g.name} ({g.length} rows) x{sum(layer.group == g.name for layer in self.layers)} layers" for g in self.groups
        )
        kv_dtype = next((layer.kv_quantize for layer in self.layers if layer.kv_quantize), self.dtype)
        caches = f"{self.cache} caches ({kv_dtype})" + (f": {groups}" if groups else "")
        slots = f", LoRA slots in {len(self.adapters)} layers" if self.adapters else ""
        return f"prefill T={self.chunk}, decode T=1, context {self.max_context_len}, {caches}{slots}"

    def to_json(self) -> str:
        body = asdict(self)
        body.update(contract=CONTRACT_VERSION, methods=self.methods, inputs=self.inputs(), outputs=self.outputs())
        return json.dumps(body)

    @classmethod
    def from_json(cls, text: str) -> StaticContract:
        body = json.loads(text)
        if body.get("contract") != CONTRACT_VERSION:
            raise ValueError(f"unknown program contract {body.get('contract')!r}; this etblocks reads {CONTRACT_VERSION!r}")
        return cls(
            chunk=body["chunk"],
            max_context_len=body["max_context_len"],
            vocab_size=body["vocab_size"],
            cache=body["cache"],
            dtype=body["dtype"],
            mask_value=body["mask_value"],
            groups=tuple(CacheGroup(**g) for g in body["groups"]),
            layers=tuple(LayerCache(**layer) for layer in body["layers"]),
            adapters=tuple(AdapterSlot.from_dict(slot) for slot in body.get("adapters", [])),
        )

    def as_constant(self) -> list[int]:
        """The JSON as UTF-8 byte values: ExecuTorch constant methods return ints, not strings."""
        return list(self.to_json().encode())

    @classmethod
    def from_constant(cls, values) -> StaticContract:
        return cls.from_json(bytes(int(v) for v in values).decode())
