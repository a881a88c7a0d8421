"""The dynamic sequence dimension survives `torch.export` and `to_edge` for every dynamic-shape cache form,
and the exported and to_edge modules compute what the eager block computes (atol 1e-5) at several T
(T = max and decode past the window for the ring).

Forms: StaticKVCache(use_custom_op=True) + CustomSDPA (XNNPACK recipe), StaticKVCache(index_copy_) +
DynamicSDPA (portable), RingKVCache + DynamicSDPA(sliding_window) (sliding layers).
"""

from __future__ import annotations

import copy

import pytest
import torch
from executorch.exir import to_edge
from torch import nn

from etblocks.attention import Attention, CustomSDPA, DynamicSDPA, RotaryEmbedding, default_inv_freq
from etblocks.state import RingKVCache, StaticKVCache

ATOL = 1e-5
HEADS, KV_HEADS, HEAD_DIM, DIM = 4, 2, 8, 32
CACHE_LEN = 8  # the context (static) or the window (ring); the export bound on T


class Wrapper(nn.Module):
    """`forward(x [1, T, D], start [1])`: positions are `start + arange(T)`, as in the dynamic program contract."""

    def __init__(self, attention: Attention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return self.attention(x, torch.arange(x.shape[1]) + start[0])


def make(kind: str) -> Wrapper:
    torch.manual_seed(0)
    if kind == "custom":
        cache, sdpa = StaticKVCache(1, CACHE_LEN, KV_HEADS, HEAD_DIM, use_custom_op=True), CustomSDPA(0.3)
    elif kind == "portable":
        cache, sdpa = StaticKVCache(1, CACHE_LEN, KV_HEADS, HEAD_DIM), DynamicSDPA(0.3)
    else:
        cache, sdpa = RingKVCache(1, CACHE_LEN, KV_HEADS, HEAD_DIM), DynamicSDPA(0.3, sliding_window=CACHE_LEN)
    lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
    attention = Attention(
        HEADS, KV_HEADS, HEAD_DIM, sdpa, cache,
        lin(DIM, HEADS * HEAD_DIM), lin(DIM, KV_HEADS * HEAD_DIM), lin(DIM, KV_HEADS * HEAD_DIM), lin(HEADS * HEAD_DIM, DIM),
        rope=RotaryEmbedding(default_inv_freq(HEAD_DIM, 10000.0)),
    )
    return Wrapper(attention).eval()


# (start, T) calls after export, each run through the exported module and the to_edge module.
# Static: chunks then decode, ending exactly at the context end. Ring: T = window, then decode past the window.
SCHEDULES = {
    "custom": [(0, 5), (5, 1), (6, 2)],
    "portable": [(0, 3), (3, 1), (4, 4)],
    "ring": [(0, 5), (5, 8), (13, 1)],
}


def export_dynamic(module: nn.Module, edge: bool = True):
    seq = torch.export.Dim("T", min=1, max=CACHE_LEN)
    example = (torch.randn(1, 4, DIM), torch.tensor([0]))
    with torch.no_grad():
        ep = torch.export.export(module, example, dynamic_shapes=({1: seq}, None), strict=False)
        return ep, (to_edge(ep) if edge else None)


def assert_matches_eager(exported: nn.Module, eager: nn.Module, schedule) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for start, length in schedule:
            x = torch.randn(1, length, DIM, generator=g)
            got = exported(x, torch.tensor([start]))
            want = eager(x, torch.tensor([start]))
            assert got.shape == (1, length, DIM)
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("kind", ["custom", "portable", "ring"])
def test_dynamic_seq_len_survives_export_and_to_edge(kind):
    module = make(kind)
    eager_for_ep, eager_for_edge = copy.deepcopy(module), copy.deepcopy(module)
    ep, edge = export_dynamic(module)

    edge_ep = edge.exported_program()
    x_node = next(n for n in edge_ep.graph.nodes if n.op == "placeholder" and n.name == "x")
    t_dim = x_node.meta["val"].shape[1]
    assert isinstance(t_dim, torch.SymInt) and not isinstance(t_dim.node.maybe_as_int(), int), (
        f"T was frozen to {t_dim} by to_edge"
    )
    (symbol,) = t_dim.node.expr.free_symbols
    assert int(edge_ep.range_constraints[symbol].upper) == CACHE_LEN, edge_ep.range_constraints

    # Cache buffers keep their sizes (context or window rows), never T-dependent.
    cache_nodes = [
        n for n in edge_ep.graph.nodes if n.op == "placeholder" and n.name.endswith(("k_cache", "v_cache"))
    ]
    assert len(cache_nodes) == 2
    for n in cache_nodes:
        assert tuple(n.meta["val"].shape) == (1, CACHE_LEN, KV_HEADS, HEAD_DIM)

    schedule = SCHEDULES[kind]
    assert len({length for _, length in schedule}) >= 2
    # ep.module(), the edge module and `module` share their buffers: give each run its own caches.
    assert_matches_eager(copy.deepcopy(ep.module()), eager_for_ep, schedule)
    assert_matches_eager(copy.deepcopy(edge_ep.module()), eager_for_edge, schedule)


def test_custom_op_program_decodes_into_last_context_slot():
    """The dynamic contract allows a decode at position context - 1. A block fed `input_pos` directly needs
    size-oblivious tracing for that (by default T is traced as >= 2 and the cache check refuses T=1 at the last
    slot); programs that derive positions as `input_pos + arange(T)`, as etblocks.export's do, need nothing
    (tests/test_errors.py fills a context to its last slot through the feeder)."""
    module = make("custom")
    eager = copy.deepcopy(module)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        ep, _ = export_dynamic(module, edge=False)
    assert_matches_eager(ep.module(), eager, [(0, CACHE_LEN - 1), (CACHE_LEN - 1, 1)])
