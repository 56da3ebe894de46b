"""Per-token FP8 / INT8 paged write: one scale per (token, head), or per (token, head,
group of head-dim elements) in a MAX collection.

Semantics are those of :func:`jkv.reference.quant_write.write_token_quant` (bit for bit).
The caches are viewed as ``[rows, block_elems]`` and addressed through
:class:`jkv.layout.Plane` offsets, as in :mod:`pallas_kernels.write`; scale arrays are
viewed flat. A program owns a ``[tokens, heads, head_size padded to a power of two]``
tile (grid: token tiles x head groups), so it holds whole head rows and computes their
amax itself (or each group's). The caches and scale arrays are aliased to the outputs:
nothing is copied.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jkv import quant
from jkv.layout import PageRows, Plane
from pallas_kernels import common, lowering


def _token_quant_kernel(slot_ref,             # int32 [T] (< 0: padding)
                        layer_ref,            # int32 [1]
                        key_ref, value_ref,   # [T, H * D] each
                        *refs,   # caches [L * nb, block elems] (K, V or one shared), k / v
                                 # scales float32 [L * nb * H * bs] (flat; a MAX collection:
                                 # its one scale collection), then the same as outputs
                                 # (aliased)
                        num_tokens, num_heads, head_size, block_size, num_blocks, total_rows,
                        tokens_per_program, heads_per_program, key_plane, value_plane,
                        key_rows, value_rows, scale_groups, dtype, scales_block_major,
                        shared_cache, native):
  """A [tokens, heads, D] tile: each (token, head) row's finite amax gives its scale
  (``amax / qmax``, NaN for a row with a non-finite value); the row is stored quantized
  at its slot and the scale at (block, head, offset) or (head, slot). ``scale_groups``
  (a MAX collection): each group of D / scale_groups dims of a row is quantized so, its
  scale stored at ((page row, offset, head), group)."""
  num_caches = 1 if shared_cache else 2
  num_scales = 1 if scale_groups is not None else 2   # a MAX scale collection: K and V
  outs = refs[num_caches + num_scales:]
  cache_outs, scale_outs = outs[:num_caches], outs[num_caches:]
  tb, hb, dp = tokens_per_program, heads_per_program, common.next_pow2(head_size)
  t, t_ok, slot, ok = common.program_tokens(slot_ref, tb, num_tokens, num_blocks * block_size)
  h, h_ok = common.program_heads(hb, num_heads)
  d = lax.iota(jnp.int32, dp)
  mask = ok[:, None, None] & h_ok[None, :, None] & (d < head_size)[None, None, :]
  layer = layer_ref[0]
  block = jnp.where(ok, slot // block_size, 0)
  offset = jnp.where(ok, slot % block_size, 0)
  loaded = [common.load_rows(src, t, h, d, head_size, mask) for src in (key_ref, value_ref)]
  scale_mask = ok[:, None] & h_ok[None, :]
  for x, plane, page_rows, which in zip(loaded, (key_plane, value_plane),
                                        (key_rows, value_rows), range(2)):
    out_ref = cache_outs[0 if shared_cache else which]
    page_row = page_rows.row(layer, block)
    rows = jnp.where(ok, page_row, total_rows)
    if scale_groups is not None:   # MAX: scales [rows, bs, H, groups], a group's own scale
      # [TB, HB, DP] as [TB, HB * DP / group_size, group_size] (group_size a power of two:
      # DP / group_size groups per head, those past head_size padding, their scales masked).
      group_size = head_size // scale_groups
      per_head = dp // group_size
      cols = hb * per_head
      grouped = x.reshape(tb, cols, group_size)
      amax, all_finite = common.finite_amax(grouped)                  # [TB, HB * DP / G]
      inv = 1.0 / jnp.maximum(quant.scale_of(amax, dtype), quant.SCALE_FLOOR)
      c = lax.iota(jnp.int32, cols)
      head, group = pl.program_id(1) * hb + c // per_head, c % per_head
      index = (((page_row * block_size + offset)[:, None] * num_heads + head[None, :])
               * scale_groups + group[None, :])
      common.store_flat(scale_outs[0], index,
                        jnp.where(all_finite, quant.scale_of(amax, dtype), jnp.nan),
                        ok[:, None] & ((head < num_heads) & (group < scale_groups))[None, :])
      stored = common.quantize_stored((grouped * inv[:, :, None]).reshape(tb, hb, dp), dtype,
                                      out_ref.dtype, native)
      common.store_tile(out_ref, plane, rows, offset, h, d, stored, mask)
      continue
    amax, all_finite = common.finite_amax(x)
    inv = 1.0 / jnp.maximum(quant.scale_of(amax, dtype), quant.SCALE_FLOOR)   # [TB, HB]
    scale = jnp.where(all_finite, quant.scale_of(amax, dtype), jnp.nan)
    stored = common.quantize_stored(x * inv[:, :, None], dtype, out_ref.dtype, native)
    common.store_tile(out_ref, plane, rows, offset, h, d, stored, mask)
    if scales_block_major:   # [L, nb, H, bs]
      index = ((layer * num_blocks + block)[:, None] * num_heads + h[None, :]) * block_size \
          + offset[:, None]
    else:                    # [L, H, nb * bs]
      index = (layer * num_heads + h[None, :]) * (num_blocks * block_size) + slot[:, None]
    common.store_flat(scale_outs[which], index, scale, scale_mask)



def token_quant(key, value, key_cache, value_cache, k_scales, v_scales, slot_mapping, layer, *,
                key_plane: Plane, value_plane: Plane, num_blocks: int, scales_block_major: bool,
                interpret: bool, tokens_per_program: int | None = None,
                heads_per_program: int | None = None, num_warps: int | None = None,
                key_rows: PageRows | None = None, value_rows: PageRows | None = None,
                scale_groups: int | None = None):
  """Per-token FP8 / INT8 write (see :func:`jkv.reference.quant_write.write_token_quant`).

  key, value [T, H, D]; caches of one layout (value_cache None: K and V share
  key_cache); k_scales, v_scales float32, block-major [L, nb, H, bs] or head-major
  [L, H, nb * bs] (any leading dims are flattened). Returns the four arrays.
  key_rows / value_rows: where each (layer, block)'s page lies in the caches viewed as
  ``[rows, page_elems]`` (default: stacked caches, a row per (layer, block)).
  scale_groups: a MAX collection (:func:`jkv.reference.quant_write.write_max_token_quant`),
  groups of a power-of-two number of elements:
  the one scale collection ``[rows, bs, H, scale_groups]`` as k_scales (v_scales unused,
  returned as the same array), one scale per group of D / scale_groups elements,
  addressed through the rows.
  """
  num_tokens, num_heads, head_size = key.shape
  caches = (key_cache,) if value_cache is None else (key_cache, value_cache)
  if key_rows is None:
    block_elems = key_plane.block_size * num_heads * head_size * (2 if value_cache is None else 1)
  else:   # one plane's page per row
    block_elems = key_plane.block_size * num_heads * head_size
  views = common.cache_views(caches, block_elems)
  # Fastest tiles in sweeps (benchmarks/run.py --sections quant --sweep): 4 tokens x 8
  # heads x 128 with 4 warps (H200, flash and others); for vLLM's value plane ([H, D, bs],
  # token-minor) 8 tokens x 8 heads with 8 warps (H100, 2026-11-22: FP8 85.9 vs 92.8 us,
  # INT8 91.1 vs 97.3 us for 32K tokens): twice the tokens per stored run of a head dim.
  token_minor = value_plane.kind == "VD"
  tb = min(tokens_per_program or (8 if token_minor else 4), common.next_pow2(num_tokens))
  num_warps = num_warps or (8 if token_minor else 4)
  hb = heads_per_program or common.head_group(num_heads, head_size, tb,
                                              target=8192 if token_minor else 4096)
  kernel = functools.partial(
      _token_quant_kernel, num_tokens=num_tokens, num_heads=num_heads, head_size=head_size,
      block_size=key_plane.block_size, num_blocks=num_blocks, total_rows=views[0].shape[0],
      tokens_per_program=tb, heads_per_program=hb, key_plane=key_plane, value_plane=value_plane,
      key_rows=key_rows or PageRows(num_blocks), value_rows=value_rows or PageRows(num_blocks),
      scale_groups=scale_groups, dtype=key_cache.dtype, scales_block_major=scales_block_major,
      shared_cache=value_cache is None, native=not interpret)
  scales = ((k_scales.reshape(-1),) if scale_groups is not None
            else (k_scales.reshape(-1), v_scales.reshape(-1)))
  arrays = tuple(views) + scales
  inputs = (slot_mapping.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
            key.reshape(num_tokens, -1), value.reshape(num_tokens, -1))
  outs = lowering.call_in_place(
      kernel, inputs, arrays, grid=(pl.cdiv(num_tokens, tb), pl.cdiv(num_heads, hb)),
      interpret=interpret, num_warps=num_warps, name="jkv_token_quant")
  cache_outs = common.restore_caches(outs[:len(views)], caches)
  k_out = outs[len(views)].reshape(k_scales.shape)
  v_out = k_out if scale_groups is not None else outs[len(views) + 1].reshape(v_scales.shape)
  return cache_outs[0], (None if value_cache is None else cache_outs[1]), k_out, v_out
