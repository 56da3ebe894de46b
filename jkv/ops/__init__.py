"""Array-level ops (functional versions of the vLLM / AITER / FlashInfer cache ops)."""

from jkv.ops.attention import paged_attention_decode
from jkv.ops.blocks import copy_blocks, swap_blocks
from jkv.ops.contiguous import update_kv_cache
from jkv.ops.indexer import cp_gather_indexer_k_quant_cache, indexer_k_quant_and_cache
from jkv.ops.mla import (concat_and_cache_mla, fused_fp8_bmm_rope_cat_and_cache_mla,
                         fused_qk_rope_concat_and_cache_mla)
from jkv.ops.quant_write import (fp4_cache_shapes, reshape_and_cache_fp4,
                                 reshape_and_cache_with_block_quant,
                                 reshape_and_cache_with_block_quant_for_asm_pa,
                                 reshape_and_cache_with_pertoken_quant, write_quant_kv)
from jkv.ops.ragged_attention import ragged_paged_attention, ragged_paged_attention_with_write
from jkv.ops.write import (append_paged_kv_cache, reshape_and_cache, reshape_and_cache_flash,
                           reshape_and_cache_packed, write_kv)

__all__ = ["append_paged_kv_cache", "concat_and_cache_mla", "copy_blocks", "fp4_cache_shapes",
           "cp_gather_indexer_k_quant_cache", "fused_fp8_bmm_rope_cat_and_cache_mla",
           "fused_qk_rope_concat_and_cache_mla",
           "indexer_k_quant_and_cache", "paged_attention_decode", "ragged_paged_attention",
           "ragged_paged_attention_with_write", "reshape_and_cache",
           "reshape_and_cache_flash", "reshape_and_cache_fp4", "reshape_and_cache_packed",
           "reshape_and_cache_with_block_quant", "reshape_and_cache_with_block_quant_for_asm_pa",
           "reshape_and_cache_with_pertoken_quant", "swap_blocks", "update_kv_cache", "write_kv",
           "write_quant_kv"]
