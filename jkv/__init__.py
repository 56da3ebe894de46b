"""jkv: a JAX/XLA-native KV-cache library with Pallas GPU kernels."""

from jkv import fp4, layout, pages, quant, rope, transcode
from jkv.cache import ContiguousKVCache, PagedKVCache
from jkv.host_cache import HostKVCache
from jkv.host_prefix import HostPrefixCache
from jkv.mla_cache import FP4IndexerCache, IndexerKCache, MLACache
from jkv.page_pool import PagePool
from jkv.ops import (append_paged_kv_cache, concat_and_cache_mla, copy_blocks, fp4_cache_shapes,
                     cp_gather_indexer_k_quant_cache, fused_fp8_bmm_rope_cat_and_cache_mla,
                     fused_qk_rope_concat_and_cache_mla,
                     indexer_k_quant_and_cache, paged_attention_decode, ragged_paged_attention,
                     ragged_paged_attention_with_write, reshape_and_cache,
                     reshape_and_cache_flash, reshape_and_cache_fp4, reshape_and_cache_packed,
                     reshape_and_cache_with_block_quant,
                     reshape_and_cache_with_block_quant_for_asm_pa,
                     reshape_and_cache_with_pertoken_quant, swap_blocks, update_kv_cache,
                     write_kv, write_quant_kv)
from jkv.pages import get_batch_indices_positions, get_seq_lens
from jkv.persist import load, load_sharded, save, save_sharded
from jkv.state_cache import StateCache, StateSpec
from jkv.transcode import transcode_paged_kv_cache
from jkv import checked, sharded_ops, sharded_pools, sharding
from jkv.sharded_ops import (sharded_attend, sharded_copy_blocks, sharded_swap_blocks,
                             sharded_write, sharded_write_kv)
from jkv.sharding import cache_partition_spec, cache_sharding, repeat_kv_heads, shard_cache

__version__ = "0.1.0"

__all__ = [
    "ContiguousKVCache", "FP4IndexerCache", "HostKVCache", "HostPrefixCache", "IndexerKCache", "MLACache",
    "PagePool", "PagedKVCache", "StateCache", "StateSpec", "append_paged_kv_cache",
    "cache_partition_spec", "cache_sharding", "checked", "concat_and_cache_mla", "copy_blocks",
    "cp_gather_indexer_k_quant_cache", "fp4", "fp4_cache_shapes",
    "fused_fp8_bmm_rope_cat_and_cache_mla", "fused_qk_rope_concat_and_cache_mla",
    "get_batch_indices_positions", "get_seq_lens", "indexer_k_quant_and_cache", "layout",
    "load", "load_sharded", "pages", "paged_attention_decode", "quant", "ragged_paged_attention",
    "ragged_paged_attention_with_write", "repeat_kv_heads", "reshape_and_cache", "reshape_and_cache_flash",
    "reshape_and_cache_fp4", "reshape_and_cache_packed", "reshape_and_cache_with_block_quant",
    "reshape_and_cache_with_block_quant_for_asm_pa", "reshape_and_cache_with_pertoken_quant",
    "rope", "save", "save_sharded", "shard_cache", "sharded_attend", "sharded_copy_blocks",
    "sharded_ops", "sharded_pools", "sharded_swap_blocks", "sharded_write", "sharded_write_kv",
    "sharding",
    "swap_blocks", "transcode", "transcode_paged_kv_cache", "update_kv_cache", "write_kv",
    "write_quant_kv",
]
