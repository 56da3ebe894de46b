"""jkv: a JAX/XLA-native KV-cache library with Pallas GPU kernels."""

from jkv import fp4, layout, pages, quant
from jkv.cache import ContiguousKVCache, PagedKVCache
from jkv.page_pool import PagePool
from jkv.ops import (append_paged_kv_cache, copy_blocks, fp4_cache_shapes, reshape_and_cache,
                     reshape_and_cache_flash, reshape_and_cache_fp4, reshape_and_cache_packed,
                     reshape_and_cache_with_block_quant,
                     reshape_and_cache_with_block_quant_for_asm_pa,
                     reshape_and_cache_with_pertoken_quant, update_kv_cache, write_kv,
                     write_quant_kv)
from jkv.pages import get_batch_indices_positions, get_seq_lens
from jkv.persist import load, save

__version__ = "0.1.0"

__all__ = [
    "ContiguousKVCache", "PagePool", "PagedKVCache", "append_paged_kv_cache", "copy_blocks", "fp4",
    "fp4_cache_shapes",
    "get_batch_indices_positions", "get_seq_lens", "layout", "load", "pages", "quant",
    "reshape_and_cache", "reshape_and_cache_flash", "reshape_and_cache_fp4",
    "reshape_and_cache_packed", "reshape_and_cache_with_block_quant",
    "reshape_and_cache_with_block_quant_for_asm_pa", "reshape_and_cache_with_pertoken_quant",
    "save", "update_kv_cache", "write_kv", "write_quant_kv",
]
