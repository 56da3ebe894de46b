"""Array-level ops (functional versions of the vLLM / AITER / FlashInfer cache ops)."""

from jkv.ops.contiguous import update_kv_cache
from jkv.ops.write import (append_paged_kv_cache, reshape_and_cache, reshape_and_cache_flash,
                           reshape_and_cache_packed, write_kv)

__all__ = ["append_paged_kv_cache", "reshape_and_cache", "reshape_and_cache_flash",
           "reshape_and_cache_packed", "update_kv_cache", "write_kv"]
