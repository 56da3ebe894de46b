"""Cache formats and their constants, shared by the references, the ops and the kernels.

:class:`CacheFormat` says how one layer of a paged cache stores K and V; the constants
below fix the byte layouts and quantization floors of the DeepSeek MLA entries and the
V3.2 indexer cache (sources in ``shared/reference/op_semantics.md``). Kernels read them
here, never from :mod:`jkv.reference`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jkv import layout as layout_lib, quant


@dataclasses.dataclass(frozen=True)
class CacheFormat:
  """How one layer of a paged cache stores K and V (static).

  layout / kv_layout: as :mod:`jkv.layout` (``packed``: K and V in the one key cache).
  quant: ``"none"`` (values as stored), ``"tensor"`` (times k/v_scale [H]), ``"token"``
  (scales [L, num_blocks, H, block_size]), ``"block"`` (scales [L, units, H], one per
  ``scale_block_tokens`` slots), ``"mxfp4"`` / ``"nvfp4"`` (packed E2M1 in layout hnd,
  scales [L, num_blocks, H, block_size, D / group], nvfp4 with [1] global scales).
  Layout ``"max"`` with ``"token"``: one scale collection ``[num_blocks, 2, L, block_size,
  H, scale_groups]`` for K and V (as both k and v scales), a scale per (token, head,
  group of ``D / scale_groups`` head-dim elements): MAX's ``quantization_granularity``.
  """
  layout: str
  kv_layout: str = "NHD"
  quant: str = "none"
  scale_block_tokens: int = 0
  scale_groups: int = 1

  @property
  def scale_collection(self) -> bool:
    """A per-token quantized MAX collection: its scales are one scale collection
    ``[num_blocks, 2, L, block_size, H, scale_groups]`` (as both k and v scales)."""
    return self.layout == layout_lib.MAX and self.quant == "token"


# MLA latent caches: kv_cache_dtype "auto" or an FP8 name (entries [kv_c | k_pe], FP8 ones
# times one per-tensor scale), or one of these two formats with scales of their own.
MLA_DS_MLA = "fp8_ds_mla"   # vLLM's / FlashMLA's sparse entries (below)
MLA_SPLIT = "fp8_split"     # the DeepSeek-V4 pool: FP8 content + entry scale, bf16 RoPE part


def mla_per_tensor_fp8(kv_cache_dtype: str) -> bool:
  """True for an MLA cache of FP8 entries under the one per-tensor scale."""
  return (kv_cache_dtype not in (MLA_DS_MLA, MLA_SPLIT)
          and quant.fp8_dtype(kv_cache_dtype) is not None)


# vLLM's "fp8_ds_mla" entry (DeepSeek's FlashMLA sparse format), bytes per token:
# [R FP8 e4m3 values of kv_c | R / 128 float32 tile scales | P bfloat16 values of k_pe]
# (R = 512, P = 64: 656 bytes). Tile scale = max(amax * (1 / 448), FLT_MIN) over each 128
# values (amax over finite values); values sat(kv_c * (1 / tile_scale)).
DS_MLA_TILE = 128
FLT_MIN = float(np.finfo(np.float32).tiny)

# Per-token-group FP8 quantization of MLA activations (AITER's fused BMM input): scale =
# max(amax, ACT_AMAX_FLOOR) / 448.
ACT_AMAX_FLOOR = 1e-10


def ds_mla_entry_bytes(rank: int, pe_dim: int) -> int:
  """Bytes of one fp8_ds_mla entry: R FP8 values, R / 128 float32 scales, P bfloat16."""
  return rank + rank // DS_MLA_TILE * 4 + 2 * pe_dim


# The V3.2 indexer cache: FP8 (e4m3fn) values and float32 scales (4 bytes) per token, one
# scale per quant_block_size values, scale = max(amax, 1e-4) / 448.
INDEXER_FP8 = jnp.float8_e4m3fn
INDEXER_AMAX_FLOOR = 1e-4
INDEXER_SCALE_BYTES = 4


def indexer_stride(head_dim: int, quant_block_size: int) -> int:
  """Bytes per token in the indexer cache's last dim: values + float32 scales."""
  return head_dim + head_dim // quant_block_size * INDEXER_SCALE_BYTES
