"""MLA entry kernels: builds ``[nope | pe]`` (or ``[pe | nope]``) entries, with RoPE on the pe
part, and stores them to cache slots or to every token's row (``q_out``)
(:func:`write_entries`); and the DeepSeek-V4 split entries (:func:`write_split`).

The destination is viewed as ``[rows, H * (R + P)]``: cache slots (``[NB, bs, H, R+P]``
is token-major, so a slot is a row) or tokens. A program handles a tile of tokens of one
head: it copies the nope part as one contiguous ``[tokens, R]`` block, and rotates the pe
part pair by pair (the pairs' first and second elements loaded as two ``[tokens, P/2]``
blocks, cos / sin at each token's position) in float32 like
:func:`jkv.rope.rotate_element`, then stores cast or FP8-quantized values. Semantics:
:mod:`jkv.reference.mla`. The cache is aliased to the output (``input_output_aliases``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jkv import quant
from jkv.formats import FLT_MIN
from pallas_kernels import common, lowering


def _kernel(slot_ref,        # int32 [T] (< 0: padding; to_slots only)
            layer_ref,       # int32 [1]
            pos_ref,         # int32 [T]: RoPE positions (rotate only)
            inv_scale_ref,   # float32 [1]: 1 / scale (FP8 only)
            nope_ref,        # [T, H * R]
            pe_ref,          # [T, H * P]
            cos_ref,         # float32 [max_pos, P / 2]
            sin_ref,         # float32 [max_pos, P / 2]
            *refs,           # to_slots: the cache [L * NB * bs, H * (R + P)] and the same
                             # as output (aliased); else the new output [T, H * (R + P)]
            num_tokens, num_heads, nope_dim, pe_dim, tokens_per_program, is_neox,
            is_nope_first, rotate, to_slots, num_slots, num_rows, quant_dtype, interpret):
  """Program (token tile, head): entries ``[nope | rope(pe)]`` (or pe first), converted
  or FP8-quantized, stored at the tokens' slots or rows."""
  out_ref = refs[-1]
  entry = nope_dim + pe_dim
  tb = tokens_per_program
  head = pl.program_id(1)
  t = pl.program_id(0) * tb + lax.iota(jnp.int32, tb)
  t_ok = t < num_tokens
  t = jnp.where(t_ok, t, 0)
  if to_slots:
    slot = lowering.load(slot_ref.at[t], mask=t_ok, other=-1)
    row_ok = t_ok & (slot >= 0) & (slot < num_slots)
    row = layer_ref[0] * num_slots + slot
  else:
    row, row_ok = t, t_ok
  # Masked lanes point one row past the destination (the interpreter drops them).
  row = jnp.where(row_ok, row, num_rows)
  nope_base = head * entry + (0 if is_nope_first else pe_dim)
  pe_base = head * entry + (nope_dim if is_nope_first else 0)

  def mask_of(cols_ok):
    return row_ok[:, None] if cols_ok is None else row_ok[:, None] & cols_ok[None, :]

  def grid_of(vector, width):
    return jnp.broadcast_to(vector, (tb, width))

  def load(ref, columns, cols_ok):
    width = columns.shape[0]
    return lowering.load(ref.at[grid_of(t[:, None], width), grid_of(columns[None, :], width)],
                         mask=grid_of(mask_of(cols_ok), width), other=0)

  inv_scale = None if quant_dtype is None else inv_scale_ref[0]

  def store(y, columns, cols_ok):
    if quant_dtype is None:
      value = y.astype(out_ref.dtype)
    else:
      value = common.quantize_stored(y.astype(jnp.float32) * inv_scale, quant_dtype,
                                     out_ref.dtype, not interpret)
    width = columns.shape[0]
    lowering.store(out_ref.at[grid_of(row[:, None], width), grid_of(columns[None, :], width)],
                   value, mask=grid_of(mask_of(cols_ok), width))

  # Every load before the first store: a load after a store stays after it (the refs may
  # alias), so a program would wait for two loads in turn (H100, 16K tokens, profiler:
  # FP8 12.0 -> 11.5 us, bf16 15.3 -> 14.4, fused RoPE unchanged; the same order made the
  # fp8_split and fp8_ds_mla writers slower, 12.7 -> 13.9 and 12.4 -> 13.1, and they keep
  # theirs; 2026-12-07).
  cols, raw, cols_ok = lowering.padded_columns(nope_dim)
  nope = load(nope_ref, head * nope_dim + cols, cols_ok)
  stores = [(nope, nope_base + raw, cols_ok)]
  if not rotate:
    cols, raw, cols_ok = lowering.padded_columns(pe_dim)
    stores.append((load(pe_ref, head * pe_dim + cols, cols_ok), pe_base + raw, cols_ok))
  else:   # RoPE in float32: pair i is (i, i + P/2) (NeoX) or (2i, 2i + 1) (GPT-J).
    half = pe_dim // 2
    pair, raw, pair_ok = lowering.padded_columns(half)
    first, second = (pair, pair + half) if is_neox else (2 * pair, 2 * pair + 1)
    # stores: masked lanes at distinct columns past the pe part's pairs
    first_out, second_out = (raw, raw + half) if is_neox else (2 * raw, 2 * raw + 1)
    x1 = load(pe_ref, head * pe_dim + first, pair_ok).astype(jnp.float32)
    x2 = load(pe_ref, head * pe_dim + second, pair_ok).astype(jnp.float32)
    pos = lowering.load(pos_ref.at[t], mask=t_ok, other=0)
    pos = jnp.clip(pos, 0, cos_ref.shape[0] - 1)
    cos = lowering.load(cos_ref.at[grid_of(pos[:, None], pair.shape[0]),
                                   grid_of(pair[None, :], pair.shape[0])],
                        mask=grid_of(mask_of(pair_ok), pair.shape[0]), other=0)
    sin = lowering.load(sin_ref.at[grid_of(pos[:, None], pair.shape[0]),
                                   grid_of(pair[None, :], pair.shape[0])],
                        mask=grid_of(mask_of(pair_ok), pair.shape[0]), other=0)
    cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
    stores += [(x1 * cos - x2 * sin, pe_base + first_out, pair_ok),
               (x2 * cos + x1 * sin, pe_base + second_out, pair_ok)]
  for value, columns, ok in stores:
    store(value, columns, ok)


def _tokens_per_program(num_tokens: int, num_heads: int) -> int:
  """Tokens per program (a power of two): 16, fewer when that leaves under ~256 programs."""
  tokens = min(16, common.next_pow2(num_tokens))
  while tokens > 1 and pl.cdiv(num_tokens, tokens) * num_heads < 256:
    tokens //= 2
  return tokens


def write_entries(nope, pe, destination, slot_mapping, positions, cos_cache, sin_cache,
                  inv_scale, *, is_neox: bool, is_nope_first: bool, rotate: bool,
                  quant_dtype, interpret: bool, out_dtype=None, layer=None,
                  tokens_per_program: int | None = None, num_warps: int = 4):
  """Entries from nope [T, H, R] and pe [T, H, P].

  destination: a cache [NB, bs, H, R+P] (or [NB, bs, R+P], H = 1) written at
    ``slot_mapping`` [T] in place (slots < 0 or past the cache: not written); with a
    leading num_layers dim, layer ``layer`` (int32 scalar, may be traced, in range) of it.
    Or None: a new [T, H, R+P] array of ``out_dtype`` with every token's entries.
  positions [T] int32, cos_cache / sin_cache [max_pos, P/2] (used when ``rotate``).
  inv_scale: float32 [1], 1 / scale (used when ``quant_dtype`` is an FP8 dtype).
  tokens_per_program: a power of two (None: :func:`_tokens_per_program`).
  """
  num_tokens, num_heads, nope_dim = nope.shape
  pe_dim = pe.shape[2]
  row_elems = num_heads * (nope_dim + pe_dim)
  tb = tokens_per_program or _tokens_per_program(num_tokens, num_heads)
  if destination is None:   # a new output: float8_e4m3fnuz as its bits (Triton has no such type)
    views = []
    stored_dtype = jnp.uint8 if np.dtype(out_dtype) == common.FNUZ else out_dtype
    new_outputs = (jax.ShapeDtypeStruct((num_tokens, row_elems), stored_dtype),)
    num_rows = num_slots = num_tokens
  else:                     # the cache, written in place
    views = common.cache_views([destination], row_elems)
    new_outputs = ()
    num_rows = views[0].shape[0]
    num_slots = num_rows // (1 if layer is None else destination.shape[0])
  if positions is None:
    positions = jnp.zeros((num_tokens,), jnp.int32)
    cos_cache = sin_cache = jnp.zeros((1, max(pe_dim // 2, 1)), jnp.float32)
  if slot_mapping is None:
    slot_mapping = jnp.zeros((num_tokens,), jnp.int32)
  kernel = functools.partial(
      _kernel, num_tokens=num_tokens, num_heads=num_heads, nope_dim=nope_dim, pe_dim=pe_dim,
      tokens_per_program=tb, is_neox=is_neox,
      is_nope_first=is_nope_first, rotate=rotate, to_slots=destination is not None,
      num_slots=num_slots, num_rows=num_rows, quant_dtype=quant_dtype, interpret=interpret)
  inputs = (slot_mapping.astype(jnp.int32),
            jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1),
            positions.astype(jnp.int32), jnp.asarray(inv_scale, jnp.float32).reshape(1),
            nope.reshape(num_tokens, -1), pe.reshape(num_tokens, -1), cos_cache, sin_cache)
  (out,) = lowering.call_in_place(
      kernel, inputs, views, grid=(pl.cdiv(num_tokens, tb), num_heads), interpret=interpret,
      num_warps=num_warps, name="jkv_mla_entries", new_outputs=new_outputs)
  if destination is None:
    if out.dtype != np.dtype(out_dtype):
      out = lax.bitcast_convert_type(out, out_dtype)
    return out.reshape(num_tokens, num_heads, nope_dim + pe_dim)
  return common.restore_caches([out], [destination])[0]


def _split_kernel(slot_ref,    # int32 [T] (< 0: padding)
                  layer_ref,   # int32 [1]
                  pos_ref,     # int32 [T]: RoPE positions (rotate only)
                  nope_ref,    # [T, H * R]
                  pe_ref,      # [T, H * P]
                  cos_ref,     # float32 [max_pos, P / 2]
                  sin_ref,     # float32 [max_pos, P / 2]
                  *refs,       # content e4m3fn [L * NB * bs, H * R], rope bf16
                               # [L * NB * bs, H * P], scale float32 [L * NB * bs, H], then
                               # the same as outputs (aliased)
                  num_tokens, num_heads, nope_dim, pe_dim, tokens_per_program, is_neox, rotate,
                  num_slots, interpret):
  """Program (token tile, head): the fp8_split entry of each token: FP8 content with its
  scale (``max(amax / 448, FLT_MIN)``) and the bf16 (rotated) RoPE part, at its slot."""
  content_ref, rope_ref, scale_ref = refs[3:]
  tb = tokens_per_program
  head = pl.program_id(1)
  t = pl.program_id(0) * tb + lax.iota(jnp.int32, tb)
  t_ok = t < num_tokens
  t = jnp.where(t_ok, t, 0)
  slot = lowering.load(slot_ref.at[t], mask=t_ok, other=-1)
  row_ok = t_ok & (slot >= 0) & (slot < num_slots)
  # Masked lanes point one row past the caches (the interpreter drops them).
  row = jnp.where(row_ok, layer_ref[0] * num_slots + slot, content_ref.shape[0])

  def grid_of(vector, width):
    return jnp.broadcast_to(vector, (tb, width))

  def mask_of(cols_ok, width):
    return grid_of(row_ok[:, None] if cols_ok is None else row_ok[:, None] & cols_ok[None, :],
                   width)

  def load(ref, columns, cols_ok, rows=t):
    width = columns.shape[0]
    return lowering.load(ref.at[grid_of(rows[:, None], width), grid_of(columns[None, :], width)],
                         mask=mask_of(cols_ok, width), other=0)

  def store(ref, value, columns, cols_ok):
    width = columns.shape[0]
    lowering.store(ref.at[grid_of(row[:, None], width), grid_of(columns[None, :], width)],
                   value, mask=mask_of(cols_ok, width))

  cols, raw, cols_ok = lowering.padded_columns(nope_dim)
  x = load(nope_ref, head * nope_dim + cols, cols_ok).astype(jnp.float32)
  amax = jnp.max(quant.finite_abs(x), axis=1)                          # masked lanes are 0
  scale = jnp.maximum(quant.scale_of(amax, jnp.float8_e4m3fn), FLT_MIN)
  content = common.quantize_stored(x * (1.0 / scale)[:, None], jnp.float8_e4m3fn,
                                   content_ref.dtype, not interpret)
  store(content_ref, content, head * nope_dim + raw, cols_ok)
  lowering.store(scale_ref.at[jnp.where(row_ok, row * num_heads + head, scale_ref.shape[0])],
                 scale, mask=row_ok)
  if not rotate:
    cols, raw, cols_ok = lowering.padded_columns(pe_dim)
    pe = load(pe_ref, head * pe_dim + cols, cols_ok).astype(jnp.float32)
    store(rope_ref, pe.astype(rope_ref.dtype), head * pe_dim + raw, cols_ok)
    return
  half = pe_dim // 2   # RoPE in float32, as write_entries
  pair, raw, pair_ok = lowering.padded_columns(half)
  first, second = (pair, pair + half) if is_neox else (2 * pair, 2 * pair + 1)
  first_out, second_out = (raw, raw + half) if is_neox else (2 * raw, 2 * raw + 1)
  x1 = load(pe_ref, head * pe_dim + first, pair_ok).astype(jnp.float32)
  x2 = load(pe_ref, head * pe_dim + second, pair_ok).astype(jnp.float32)
  pos = jnp.clip(lowering.load(pos_ref.at[t], mask=t_ok, other=0), 0, cos_ref.shape[0] - 1)
  cos = load(cos_ref, pair, pair_ok, rows=pos).astype(jnp.float32)
  sin = load(sin_ref, pair, pair_ok, rows=pos).astype(jnp.float32)
  store(rope_ref, (x1 * cos - x2 * sin).astype(rope_ref.dtype), head * pe_dim + first_out,
        pair_ok)
  store(rope_ref, (x2 * cos + x1 * sin).astype(rope_ref.dtype), head * pe_dim + second_out,
        pair_ok)


def write_split(nope, pe, content, rope, scale, slot_mapping, positions, cos_cache, sin_cache,
                layer, *, is_neox: bool, interpret: bool):
  """The ``fp8_split`` entries of nope [T, H, R] and pe [T, H, P] at ``slot_mapping`` [T]
  (< 0 or past the cache: not written) into layer ``layer`` (int32 scalar, in range) of
  content e4m3fn [L, NB, bs, (H,) R], rope bf16 [L, NB, bs, (H,) P] and scale float32
  [L, NB, bs, (H,)], in place. positions None: pe stored as given; else RoPE at positions
  [T] with cos_cache / sin_cache [max_pos, P/2]. Returns (content, rope, scale)."""
  num_tokens, num_heads, nope_dim = nope.shape
  pe_dim = pe.shape[2]
  num_slots = content.shape[1] * content.shape[2]
  rows = content.shape[0] * num_slots
  rotate = positions is not None
  if not rotate:
    positions = jnp.zeros((num_tokens,), jnp.int32)
    cos_cache = sin_cache = jnp.zeros((1, max(pe_dim // 2, 1)), jnp.float32)
  tb = _tokens_per_program(num_tokens, num_heads)
  views = (content.reshape(rows, num_heads * nope_dim), rope.reshape(rows, num_heads * pe_dim),
           scale.reshape(rows * num_heads))
  kernel = functools.partial(
      _split_kernel, num_tokens=num_tokens, num_heads=num_heads, nope_dim=nope_dim,
      pe_dim=pe_dim, tokens_per_program=tb, is_neox=is_neox, rotate=rotate,
      num_slots=num_slots, interpret=interpret)
  inputs = (slot_mapping.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
            positions.astype(jnp.int32), nope.reshape(num_tokens, -1),
            pe.reshape(num_tokens, -1), cos_cache, sin_cache)
  outs = lowering.call_in_place(kernel, inputs, views, grid=(pl.cdiv(num_tokens, tb), num_heads),
                                interpret=interpret, name="jkv_mla_split")
  return tuple(out.reshape(array.shape) for out, array in zip(outs, (content, rope, scale)))
