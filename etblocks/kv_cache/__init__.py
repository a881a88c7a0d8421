"""KV caches: in place (static), sliding window (ring) and caller-owned (io), each in float or int8."""

from etblocks.kv_cache.base import KVCache, find_caches, reset_caches
from etblocks.kv_cache.io import IOKVCache, io_cache_layout
from etblocks.kv_cache.quantized import QuantizedIOKVCache, QuantizedKVCache, QuantizedRingKVCache, QuantizedRows
from etblocks.kv_cache.ring import RingKVCache
from etblocks.kv_cache.static import StaticKVCache

__all__ = [
    "KVCache",
    "StaticKVCache",
    "RingKVCache",
    "IOKVCache",
    "QuantizedKVCache",
    "QuantizedRingKVCache",
    "QuantizedIOKVCache",
    "QuantizedRows",
    "io_cache_layout",
    "find_caches",
    "reset_caches",
]
