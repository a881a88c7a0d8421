"""KV caches: in place (static), sliding window (ring) and caller-owned (io)."""

from etblocks.kv_cache.base import KVCache, find_caches, reset_caches
from etblocks.kv_cache.io import IOKVCache
from etblocks.kv_cache.ring import RingKVCache
from etblocks.kv_cache.static import StaticKVCache

__all__ = ["KVCache", "StaticKVCache", "RingKVCache", "IOKVCache", "find_caches", "reset_caches"]
