"""Paged cache write kernel: scatter token rows into any layout, with FP8 conversion.

One kernel body serves every layout: the cache is viewed as ``[rows, page_elems]`` and each
(token, head, dim) element goes to ``[page_rows.row(layer, slot // bs), plane.offset(slot %
bs, head, dim)]`` (see :class:`jkv.layout.Plane` and :class:`jkv.layout.PageRows`: for
stacked caches ``[L, nb, ...]`` the row is ``layer * nb + slot // bs``). A program handles a ``[tokens_per_program,
elems_per_program]`` tile of the flattened ``[T, num_heads * head_size]`` input.
Padding slots (< 0) and slots past the cache are masked: nothing is written.
The cache buffers are aliased to the outputs (``input_output_aliases``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jkv.layout import PageRows, Plane
from pallas_kernels import common, lowering


# (tokens, elems) per program for a 32K-token prefill, by the value plane's kind; chosen
# from sweeps on an H200 (benchmarks/run.py --sweep, 2026-11-22): token-major planes
# are flat at 73-77 us across tiles, vLLM's [H, D, bs] value wants 16 consecutive
# tokens (a 32-byte sector), AITER's ASM value wants 8-token groups across many dims.
_PREFILL_TILE = {"NHD": (4, 1024), "HND": (4, 1024), "VD": (16, 1024), "VASM": (32, 128)}


def default_tile(num_tokens: int, row_elems: int, plane: Plane) -> tuple[int, int]:
  """(tokens_per_program, elems_per_program), powers of two (Triton needs them).

  Small writes (decode) that would leave the GPU with few programs use 2 tokens x 512
  elements (fastest for 256-token decodes in every layout measured), shrunk further
  while there are fewer than 256 programs.
  """
  min_programs = 256
  def programs(t, e):
    return pl.cdiv(num_tokens, t) * pl.cdiv(row_elems, e)
  tokens, elems = _PREFILL_TILE[plane.kind]
  if programs(tokens, elems) < min_programs:
    tokens, elems = 2, 512
  elems = min(elems, common.next_pow2(row_elems))
  tokens = min(tokens, common.next_pow2(num_tokens))
  while tokens > 1 and programs(tokens, elems) < min_programs:
    tokens //= 2
  while elems > 128 and programs(tokens, elems) < min_programs:
    elems //= 2
  return tokens, elems


def _convert(x, inv_scale, quant_dtype, out_dtype, native):
  """Input tile -> stored tile: plain cast, or saturating FP8 quantization."""
  if quant_dtype is None:
    return x.astype(out_dtype)
  return common.quantize_stored(x.astype(jnp.float32) * inv_scale, quant_dtype, out_dtype,
                                native)


def _kernel(slot_ref,          # int32 [T]: the slot of each token (< 0: padding)
            layer_ref,         # int32 [1]: the layer written
            k_inv_scale_ref,   # float32 [H] (1 / k_scale; read for FP8 caches)
            v_inv_scale_ref,   # float32 [H]
            key_ref,           # [T, H * D]
            value_ref,         # [T, H * D]
            *cache_refs,       # caches [rows, page elems] (K and V, or one cache holding
                               # both), then the same as outputs (aliased)
            num_tokens, row_elems, head_size, block_size, num_blocks, total_rows,
            tokens_per_program, elems_per_program, key_plane, value_plane, key_rows,
            value_rows, per_head_scale, quant_dtype, arrange, interpret):
  """One [tokens_per_program, elems_per_program] tile of the [T, H * D] key and value:
  each element to row ``rows.row(layer, slot // bs)`` at its plane's offset, converted (and
  FP8-quantized) to the cache dtype; padding slots and slots past the cache write
  nothing."""
  num_caches = len(cache_refs) // 2
  outs = cache_refs[num_caches:]
  tb, eb = tokens_per_program, elems_per_program
  t = pl.program_id(0) * tb + lax.iota(jnp.int32, tb)
  e = pl.program_id(1) * eb + lax.iota(jnp.int32, eb)
  # Bounds masks only where the shapes have ragged edges (decided statically), so the
  # common case keeps plain iota index vectors.
  if num_tokens % tb:
    t_ok = t < num_tokens
    t = jnp.where(t_ok, t, 0)
    slot = lowering.load(slot_ref.at[t], mask=t_ok, other=-1)
  else:
    slot = lowering.load(slot_ref.at[t])
  ok = (slot >= 0) & (slot < num_blocks * block_size)
  if row_elems % eb:
    e_ok = e < row_elems
    e = jnp.where(e_ok, e, 0)
    mask = ok[:, None] & e_ok[None, :]
  else:
    mask = jnp.broadcast_to(ok[:, None], (tb, eb))
  head = lax.div(e, head_size)   # e >= 0 (see Plane.flat_elem_offset)
  layer = layer_ref[0]
  offset_in_block = jnp.where(ok, slot % block_size, 0)
  block = jnp.where(ok, slot // block_size, 0)
  src_t = jnp.broadcast_to(t[:, None], (tb, eb))
  src_e = jnp.broadcast_to(e[None, :], (tb, eb))
  targets = ((key_ref, k_inv_scale_ref, key_plane, key_rows, outs[0]),
             (value_ref, v_inv_scale_ref, value_plane, value_rows, outs[-1]))
  # Both loads are issued before either store: more bytes in flight per program.
  loaded = [lowering.load(src_ref.at[src_t, src_e], mask=mask, other=0)
            for src_ref, _, _, _, _ in targets]
  for x, (_, scale_ref, plane, page_rows, out_ref) in zip(loaded, targets):
    # Masked lanes point one row past the cache: the interpreter drops them, the GPU
    # never touches them.
    rows = jnp.where(mask, page_rows.row(layer, block)[:, None], total_rows)
    scale = None
    if quant_dtype is not None:
      scale = (lowering.load(scale_ref.at[head])[None, :] if per_head_scale
               else scale_ref[0])
    stored = _convert(x, scale, quant_dtype, out_ref.dtype, not interpret)
    offsets = (plane.token_offset(offset_in_block)[:, None]
               + plane.flat_elem_offset(e)[None, :])
    tiles = (stored, rows, offsets, mask)
    if arrange:
      tiles = common.arrange(plane, *tiles)
    stored, tile_rows, offsets, tile_mask = tiles
    lowering.store(out_ref.at[tile_rows, offsets], stored, mask=tile_mask)


def scatter_kv(key, value, key_cache, value_cache, slot_mapping, layer, k_inv_scale,
               v_inv_scale, *,
               key_plane: Plane, value_plane: Plane, num_blocks: int, quant_dtype,
               interpret: bool, key_rows: PageRows | None = None,
               value_rows: PageRows | None = None, page_elems: int | None = None,
               tokens_per_program: int | None = None,
               elems_per_program: int | None = None, num_warps: int = 4,
               arrange: bool = True):
  """Writes ``key``/``value`` [T, H, D] rows into paged caches in place.

  Args:
    key_cache, value_cache: cache arrays of one layout; any leading ``num_layers``
      dims are folded into rows. ``value_cache=None``: K and V share ``key_cache``
      (packed layouts), through ``key_plane`` / ``value_plane``.
    slot_mapping: int32 [T]; < 0 or >= num_blocks * block_size: not written.
    layer: int32 scalar (may be traced): which stacked layer to write.
    k_inv_scale, v_inv_scale: float32 [1] or [H], 1 / k_scale and 1 / v_scale (used
      when ``quant_dtype`` is an FP8 dtype).
    num_blocks: blocks per layer.
    key_rows, value_rows, page_elems: where the pages lie in the caches viewed as ``[rows,
      page_elems]``; None: stacked caches ``[L, nb, ...]``, a row per (layer, block).
    quant_dtype: None (cast to the cache dtype) or the FP8 dtype to quantize to.
    tokens_per_program, elems_per_program: the tile (powers of two); None: ``default_tile``.
    num_warps: Triton warps per program.
    arrange: store in the plane's preferred lane order (``common.arrange``); False stores in
      the input's [token, element] order (slow for the token-minor value layouts).
  Returns:
    ``(key_cache, value_cache)``, or ``(kv_cache,)`` for a shared cache.
  """
  num_tokens, num_heads, head_size = key.shape
  row_elems = num_heads * head_size
  caches = (key_cache,) if value_cache is None else (key_cache, value_cache)
  page_elems = page_elems or (key_plane.block_size * num_heads * head_size
                              * (1 if value_cache is not None else 2))
  key_rows = key_rows or PageRows(num_blocks)
  value_rows = value_rows or PageRows(num_blocks)
  views = common.cache_views(caches, page_elems)
  total_rows = views[0].shape[0]
  per_head_scale = k_inv_scale.shape[0] > 1 or v_inv_scale.shape[0] > 1
  if per_head_scale:
    k_inv_scale = jnp.broadcast_to(k_inv_scale, (num_heads,))
    v_inv_scale = jnp.broadcast_to(v_inv_scale, (num_heads,))
  tb, eb = default_tile(num_tokens, row_elems, value_plane)
  tb = tokens_per_program or tb
  eb = elems_per_program or eb
  kernel = functools.partial(
      _kernel, num_tokens=num_tokens, row_elems=row_elems, head_size=head_size,
      block_size=key_plane.block_size, num_blocks=num_blocks, total_rows=total_rows,
      tokens_per_program=tb, elems_per_program=eb, key_plane=key_plane,
      value_plane=value_plane, key_rows=key_rows, value_rows=value_rows,
      per_head_scale=per_head_scale,
      quant_dtype=quant_dtype, arrange=arrange, interpret=interpret)
  inputs = (slot_mapping.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
            k_inv_scale, v_inv_scale, key.reshape(num_tokens, row_elems),
            value.reshape(num_tokens, row_elems))
  outs = lowering.call_in_place(
      kernel, inputs, views, grid=(pl.cdiv(num_tokens, tb), pl.cdiv(row_elems, eb)),
      interpret=interpret, num_warps=num_warps, name="jkv_scatter_kv")
  return tuple(common.restore_caches(outs, caches))
