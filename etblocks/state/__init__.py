"""The state a token mixer keeps between calls, each tensor declared (`StateSpec`): K/V rows in place, as a ring or
caller-owned (float or int8), the last K inputs of a convolution, and recurrent state replaced whole."""

from etblocks.state.base import State, find_states, reset_states, zero_at_start
from etblocks.state.io import IOKVCache
from etblocks.state.kv import KVCache
from etblocks.state.mixer import Mixer, call_with_state
from etblocks.state.quantized import QuantizedIOKVCache, QuantizedKVCache, QuantizedRingKVCache
from etblocks.state.recurrent import RecurrentState
from etblocks.state.ring import RingKVCache
from etblocks.state.spec import (
    PADDABLE,
    POSITIONAL,
    REPLACE,
    RING,
    ROWS,
    UPDATES,
    WINDOW,
    StateSpec,
    apply_update,
    held_positions,
)
from etblocks.state.shared import KVShare
from etblocks.state.static import StaticKVCache
from etblocks.state.window import WindowState

__all__ = [
    "State",
    "KVShare",
    "StateSpec",
    "Mixer",
    "call_with_state",
    "find_states",
    "reset_states",
    "zero_at_start",
    "apply_update",
    "held_positions",
    "ROWS",
    "RING",
    "WINDOW",
    "REPLACE",
    "UPDATES",
    "POSITIONAL",
    "PADDABLE",
    "KVCache",
    "StaticKVCache",
    "RingKVCache",
    "IOKVCache",
    "QuantizedKVCache",
    "QuantizedRingKVCache",
    "QuantizedIOKVCache",
    "WindowState",
    "RecurrentState",
]
