"""jkv: a JAX/XLA-native KV-cache library with Pallas GPU kernels."""

from jkv import layout, pages, quant
from jkv.cache import ContiguousKVCache, PagedKVCache
from jkv.ops import (append_paged_kv_cache, reshape_and_cache, reshape_and_cache_flash,
                     reshape_and_cache_packed, update_kv_cache, write_kv)
from jkv.pages import get_batch_indices_positions, get_seq_lens

__version__ = "0.1.0"

__all__ = [
    "ContiguousKVCache", "PagedKVCache", "append_paged_kv_cache", "get_batch_indices_positions",
    "get_seq_lens", "layout", "pages", "quant", "reshape_and_cache", "reshape_and_cache_flash",
    "reshape_and_cache_packed", "update_kv_cache", "write_kv",
]
