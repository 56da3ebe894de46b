"""DeepSeek-V3.2 indexer cache kernels: the quantized key write and the byte gather.

Semantics and byte layout: :mod:`jkv.reference.indexer` (bit for bit). The cache is viewed
as ``uint8 [rows, bs * stride]`` (``rows = num_layers * num_blocks``): one row is one
block's flat bytes, FP8 values at ``o * head_dim + d``, float32 scales at
``bs * head_dim + (o * G + g) * 4 + byte`` for token offset ``o``.

* :func:`quant_write` -- grid over token tiles. A program loads ``[tokens, G, qbs]`` of
  keys (groups padded to powers of two), takes each group's amax, scale and FP8 values in
  float32, and stores the values' bits and the four little-endian bytes of each scale
  (``(bits >> 8 * byte) & 0xFF``) into the byte cache.
* :func:`gather` -- grid over output row tiles. The wrapper finds each row's source (a few
  jnp ops on ``[T]``); a program copies ``head_dim`` value bytes and ``4 G`` scale bytes
  per row into ``dst_k`` / ``dst_scale`` (viewed as uint8).

The cache (write) and the destinations (gather) are aliased to the outputs
(``input_output_aliases``): in place, untouched bytes keep their values.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jkv import quant
from jkv import pages
from jkv.formats import INDEXER_AMAX_FLOOR, INDEXER_FP8, INDEXER_SCALE_BYTES
from pallas_kernels import common, lowering


def _write_kernel(slot_ref,    # int32 [T] (< 0: padding)
                  layer_ref,   # int32 [1]
                  k_ref,       # [T, head_dim]
                  cache_ref,   # uint8 [L * NB, bs * stride]: each block's flat bytes
                               # (aliased to out_ref)
                  out_ref,     # uint8 [L * NB, bs * stride]
                  *, num_tokens, head_dim, quant_block_size, block_size, num_blocks,
                  tokens_per_program, scale_fmt, interpret):
  """A tile of tokens: per group of ``quant_block_size`` values the scale (UE8M0 rounded
  or float32) and the FP8 values, stored at the token's value and scale bytes."""
  del cache_ref   # aliased to out_ref
  groups = head_dim // quant_block_size
  tb, gp, qp = tokens_per_program, common.next_pow2(groups), common.next_pow2(quant_block_size)
  t, t_ok, slot, ok = common.program_tokens(slot_ref, tb, num_tokens, num_blocks * block_size)
  g = lax.iota(jnp.int32, gp)
  i = lax.iota(jnp.int32, qp)
  offset = jnp.where(ok, slot % block_size, 0)
  row = layer_ref[0] * num_blocks + jnp.where(ok, slot // block_size, 0)
  # Group and lane bounds only where groups / quant_block_size are not powers of two.
  g_ok = g < groups if gp != groups else None
  lane_ok = i < quant_block_size if qp != quant_block_size else None

  def bounded(token_ok):
    """token_ok [TB] & the group / lane bounds, as [TB, GP, QP]."""
    mask = token_ok[:, None, None]
    if g_ok is not None:
      mask = mask & g_ok[None, :, None]
    if lane_ok is not None:
      mask = mask & lane_ok[None, None, :]
    return jnp.broadcast_to(mask, (tb, gp, qp))

  col = jnp.broadcast_to((g[:, None] * quant_block_size + i[None, :])[None], (tb, gp, qp))
  # Keys of padding slots are loaded too: the load need not wait for the slots.
  x = lowering.load(k_ref.at[jnp.broadcast_to(t[:, None, None], (tb, gp, qp)), col],
                    mask=bounded(t_ok), other=0).astype(jnp.float32)
  mask = bounded(ok)
  amax = jnp.max(quant.finite_abs(x), axis=-1)                           # [TB, GP]
  scale = quant.scale_of(jnp.maximum(amax, INDEXER_AMAX_FLOOR), INDEXER_FP8)
  if scale_fmt == "ue8m0":
    scale = quant.round_up_pow2(scale)
  values = common.quantize_stored(x * (1.0 / scale)[:, :, None], INDEXER_FP8, INDEXER_FP8,
                                  not interpret)
  # Masked lanes point one row past the cache (the interpreter drops them).
  rows = jnp.where(mask, row[:, None, None], out_ref.shape[0])
  lowering.store(out_ref.at[rows, offset[:, None, None] * head_dim + col],
                 lax.bitcast_convert_type(values, jnp.uint8), mask=mask)
  byte = lax.iota(jnp.int32, INDEXER_SCALE_BYTES)
  scale_bits = lax.bitcast_convert_type(scale, jnp.uint32)[:, :, None]
  scale_bytes = ((scale_bits >> (8 * byte).astype(jnp.uint32)[None, None, :])
                 & jnp.uint32(0xFF)).astype(jnp.uint8)                    # [TB, GP, 4]
  shape = (tb, gp, INDEXER_SCALE_BYTES)
  scale_mask = ok[:, None, None] if g_ok is None else ok[:, None, None] & g_ok[None, :, None]
  scale_mask = jnp.broadcast_to(scale_mask, shape)
  scale_col = (block_size * head_dim
               + (offset[:, None, None] * groups + g[None, :, None]) * INDEXER_SCALE_BYTES
               + byte[None, None, :])
  rows = jnp.where(scale_mask, row[:, None, None], out_ref.shape[0])
  lowering.store(out_ref.at[rows, jnp.broadcast_to(scale_col, shape)], scale_bytes,
                 mask=scale_mask)


def quant_write(k, kv_cache, slot_mapping, layer, *, quant_block_size: int, scale_fmt: str,
                interpret: bool, tokens_per_program: int | None = None, num_warps: int = 8):
  """Quantizes k [T, head_dim] (float) into kv_cache uint8 [(L,) NB, bs, stride] in place.

  slot_mapping: int32 [T]; < 0 or >= NB * bs: not written. layer: int32 scalar (may be
  traced, in range) into the leading num_layers dim, or None. scale_fmt: "ue8m0" or
  "float32". tokens_per_program: a power of two (None: ~4096 key values per program, 32
  tokens at head_dim 128: with 8 warps the fastest on an H200 for 16K bf16 keys, 2026-11-22,
  though 16-64 tokens and 4-8 warps are within 10%). Returns the updated kv_cache.
  """
  num_tokens, head_dim = k.shape
  num_blocks, block_size, stride = kv_cache.shape[-3:]
  view = kv_cache.reshape(-1, block_size * stride)
  padded = common.next_pow2(head_dim // quant_block_size) * common.next_pow2(quant_block_size)
  tb = tokens_per_program or common.tokens_per_program(num_tokens, padded, 4096)
  kernel = functools.partial(
      _write_kernel, num_tokens=num_tokens, head_dim=head_dim,
      quant_block_size=quant_block_size, block_size=block_size, num_blocks=num_blocks,
      tokens_per_program=tb, scale_fmt=scale_fmt, interpret=interpret)
  inputs = (slot_mapping.astype(jnp.int32),
            jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1), k)
  (out,) = lowering.call_in_place(kernel, inputs, (view,), grid=(pl.cdiv(num_tokens, tb),),
                                  interpret=interpret, num_warps=num_warps,
                                  name="jkv_indexer_k_quant_and_cache")
  return out.reshape(kv_cache.shape)


def _gather_kernel(source_ref,      # int32 [T]: the cache token row of each output row
                                     # (-1: keep the destination row)
                   cache_ref,       # uint8 [L * NB, bs * stride]
                   dst_k_ref,       # uint8 [T, head_dim] (aliased to k_out)
                   dst_scale_ref,   # uint8 [T, G * 4] (aliased to scale_out)
                   k_out,           # uint8 [T, head_dim]
                   scale_out,       # uint8 [T, G * 4]
                   *, num_tokens, head_dim, scale_bytes, block_size, tokens_per_program):
  """A tile of output rows: each row's value and scale bytes copied from its source
  token."""
  del dst_k_ref, dst_scale_ref   # aliased to k_out, scale_out
  tb, hp, sp = tokens_per_program, common.next_pow2(head_dim), common.next_pow2(scale_bytes)
  t = pl.program_id(0) * tb + lax.iota(jnp.int32, tb)
  t_ok = t < num_tokens
  t = jnp.where(t_ok, t, 0)
  source = lowering.load(source_ref.at[t], mask=t_ok, other=-1)
  ok = source >= 0
  row = jnp.where(ok, source // block_size, 0)
  offset = jnp.where(ok, source % block_size, 0)

  def copy(out_ref, width, padded, start):
    """out_ref[t, :width] = cache[row, start + offset * width + :width] for rows ok."""
    j = lax.iota(jnp.int32, padded)
    mask = ok[:, None]
    if padded != width:
      mask = mask & (j < width)[None, :]
    mask = jnp.broadcast_to(mask, (tb, padded))
    col = jnp.broadcast_to(j[None, :], (tb, padded))
    src_col = start + offset[:, None] * width + col
    data = lowering.load(cache_ref.at[jnp.broadcast_to(row[:, None], (tb, padded)), src_col],
                         mask=mask, other=0)
    # Masked lanes point one row past the destination (the interpreter drops them).
    lowering.store(out_ref.at[jnp.where(mask, t[:, None], num_tokens), col], data, mask=mask)

  copy(k_out, head_dim, hp, 0)
  copy(scale_out, scale_bytes, sp, block_size * head_dim)


def gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, layer, *, interpret: bool,
           tokens_per_program: int | None = None, num_warps: int = 4):
  """``cp_gather_indexer_k_quant_cache`` (semantics: :mod:`jkv.reference.indexer`).

  Rows t < cu_seq_lens[-1] of dst_k [T, head_dim] (uint8 / FP8) and dst_scale (float32
  [T, G] or uint8 [T, 4 G]) from the cache ``uint8 [(L,) NB, bs, stride]``; other rows,
  rows whose block-table entry is outside the cache, and every row when ``layer`` (int32
  scalar, may be traced; None: no layer dim) is out of range keep their values.
  block_table int [batch, max_blocks], cu_seq_lens int [batch + 1].
  Returns ``(dst_k, dst_scale)``.
  """
  num_tokens, head_dim = dst_k.shape
  num_blocks, block_size, stride = kv_cache.shape[-3:]
  if num_tokens == 0 or block_table.size == 0:
    return dst_k, dst_scale
  view = kv_cache.reshape(-1, block_size * stride)
  k_bytes = lax.bitcast_convert_type(dst_k, jnp.uint8)
  scale_bytes = lax.bitcast_convert_type(dst_scale, jnp.uint8).reshape(num_tokens, -1)
  # Each row's source, as the reference finds it: a slot of the [L * NB, bs] view, or -1.
  block, position, ok = pages.gather_sources(block_table, cu_seq_lens, num_tokens, block_size,
                                       num_blocks)
  layer_row = 0
  if layer is not None:
    ok &= (layer >= 0) & (layer < kv_cache.shape[0])
    layer_row = jnp.clip(layer, 0, kv_cache.shape[0] - 1) * num_blocks
  source = jnp.where(ok, (layer_row + block) * block_size + position % block_size, -1)
  tb = tokens_per_program or common.tokens_per_program(num_tokens, head_dim, 8192)
  kernel = functools.partial(
      _gather_kernel, num_tokens=num_tokens, head_dim=head_dim,
      scale_bytes=scale_bytes.shape[1], block_size=block_size, tokens_per_program=tb)
  k_out, scale_out = lowering.call_in_place(
      kernel, (source.astype(jnp.int32), view), (k_bytes, scale_bytes),
      grid=(pl.cdiv(num_tokens, tb),), interpret=interpret, num_warps=num_warps,
      name="jkv_cp_gather_indexer_k_quant_cache")
  if dst_scale.dtype != jnp.uint8:   # float32 [T, G] from [T, G, 4] bytes
    scale_out = scale_out.reshape(num_tokens, -1, INDEXER_SCALE_BYTES)
  return (lax.bitcast_convert_type(k_out, dst_k.dtype),
          lax.bitcast_convert_type(scale_out, dst_scale.dtype))
