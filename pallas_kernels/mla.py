"""MLA entry kernel: builds ``[nope | pe]`` (or ``[pe | nope]``) entries, with RoPE on the pe
part, and stores them to cache slots or to every token's row (``q_out``).

The destination is viewed as ``[rows, H * (R + P)]``: cache slots (``[NB, bs, H, R+P]``
is token-major, so a slot is a row) or tokens. A program handles a ``[tokens, elems]``
tile; each element loads its nope value or its pe value (and, rotating, the pe partner
and the cos / sin of its pair at the token's position), computes in float32 like
:func:`jkv.rope.rotate_element`, and stores the cast or FP8-quantized value. Semantics:
:mod:`jkv.reference.mla`. The cache is aliased to the output (``input_output_aliases``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jkv import rope
from pallas_kernels import lowering
from pallas_kernels.write import (_FNUZ, _next_pow2, cache_views, quantize_stored,
                                  restore_caches)


def _kernel(slot_ref, layer_ref, pos_ref, inv_scale_ref, nope_ref, pe_ref, cos_ref, sin_ref,
            *refs, num_tokens, num_heads, nope_dim, pe_dim, tokens_per_program,
            elems_per_program, is_neox, is_nope_first, rotate, to_slots, num_slots, num_rows,
            quant_dtype, interpret):
  out_ref = refs[-1]
  entry = nope_dim + pe_dim
  row_elems = num_heads * entry
  tb, eb = tokens_per_program, elems_per_program
  t = pl.program_id(0) * tb + lax.iota(jnp.int32, tb)
  e = pl.program_id(1) * eb + lax.iota(jnp.int32, eb)
  t_ok = t < num_tokens
  t = jnp.where(t_ok, t, 0)
  e_ok = e < row_elems
  e = jnp.where(e_ok, e, 0)
  if to_slots:
    slot = lowering.load(slot_ref.at[t], mask=t_ok, other=-1)
    row_ok = t_ok & (slot >= 0) & (slot < num_slots)
    row = layer_ref[0] * num_slots + slot
  else:
    row, row_ok = t, t_ok
  mask = row_ok[:, None] & e_ok[None, :]
  head, j = e // entry, e % entry
  if is_nope_first:
    is_nope, nope_j, pe_j = j < nope_dim, j, j - nope_dim
  else:
    is_nope, nope_j, pe_j = j >= pe_dim, j - pe_dim, j
  nope_j = jnp.where(is_nope, nope_j, 0)
  pe_j = jnp.where(is_nope, 0, pe_j)
  tokens = jnp.broadcast_to(t[:, None], (tb, eb))
  nope_mask = mask & is_nope[None, :]
  pe_mask = mask & ~is_nope[None, :]

  def cols(c):
    return jnp.broadcast_to(c[None, :], (tb, eb))

  nope = lowering.load(nope_ref.at[tokens, cols(head * nope_dim + nope_j)], mask=nope_mask,
                       other=0)
  pe = lowering.load(pe_ref.at[tokens, cols(head * pe_dim + pe_j)], mask=pe_mask, other=0)
  if rotate:
    partner, pair, first = rope.partner_and_pair(pe_j, pe_dim, is_neox)
    other = lowering.load(pe_ref.at[tokens, cols(head * pe_dim + partner)], mask=pe_mask,
                          other=0)
    pos = lowering.load(pos_ref.at[t], mask=t_ok, other=0)
    pos = jnp.broadcast_to(jnp.clip(pos, 0, cos_ref.shape[0] - 1)[:, None], (tb, eb))
    cos = lowering.load(cos_ref.at[pos, cols(pair)], mask=pe_mask, other=0)
    sin = lowering.load(sin_ref.at[pos, cols(pair)], mask=pe_mask, other=0)
    pe32 = rope.rotate_element(pe, other, cos, sin, cols(first))
  else:
    pe32 = pe.astype(jnp.float32)
  y = jnp.where(cols(is_nope), nope.astype(jnp.float32), pe32)
  if quant_dtype is None:
    value = y.astype(out_ref.dtype)
  else:
    value = quantize_stored(y * inv_scale_ref[0], quant_dtype, out_ref.dtype, not interpret)
  # Masked lanes point one row past the destination (the interpreter drops them).
  rows = jnp.where(mask, row[:, None], num_rows)
  lowering.store(out_ref.at[rows, cols(e)], value, mask=mask)


def _tile(num_tokens, row_elems):
  """(tokens, elems) per program, powers of two; at least ~256 programs when possible."""
  elems = min(1024, _next_pow2(row_elems))
  tokens = min(4, _next_pow2(num_tokens))
  while tokens > 1 and pl.cdiv(num_tokens, tokens) * pl.cdiv(row_elems, elems) < 256:
    tokens //= 2
  return tokens, elems


def write_entries(nope, pe, destination, slot_mapping, positions, cos_cache, sin_cache,
                  inv_scale, *, is_neox: bool, is_nope_first: bool, rotate: bool,
                  quant_dtype, interpret: bool, out_dtype=None, layer=None):
  """Entries from nope [T, H, R] and pe [T, H, P].

  destination: a cache [NB, bs, H, R+P] (or [NB, bs, R+P], H = 1) written at
    ``slot_mapping`` [T] in place (slots < 0 or past the cache: not written); with a
    leading num_layers dim, layer ``layer`` (int32 scalar, may be traced, in range) of it.
    Or None: a new [T, H, R+P] array of ``out_dtype`` with every token's entries.
  positions [T] int32, cos_cache / sin_cache [max_pos, P/2] (used when ``rotate``).
  inv_scale: float32 [1], 1 / scale (used when ``quant_dtype`` is an FP8 dtype).
  """
  num_tokens, num_heads, nope_dim = nope.shape
  pe_dim = pe.shape[2]
  row_elems = num_heads * (nope_dim + pe_dim)
  tb, eb = _tile(num_tokens, row_elems)
  if destination is None:
    views, aliases = [], {}
    # float8_e4m3fnuz is stored as its bits (Triton cannot convert to it)
    stored_dtype = jnp.uint8 if np.dtype(out_dtype) == _FNUZ else out_dtype
    out_shape = jax.ShapeDtypeStruct((num_tokens, row_elems), stored_dtype)
    num_rows = num_slots = num_tokens
  else:
    views = cache_views([destination], row_elems)
    aliases = {8: 0}
    out_shape = jax.ShapeDtypeStruct(views[0].shape, views[0].dtype)
    num_rows = views[0].shape[0]
    num_slots = num_rows // (1 if layer is None else destination.shape[0])
  if positions is None:
    positions = jnp.zeros((num_tokens,), jnp.int32)
    cos_cache = sin_cache = jnp.zeros((1, max(pe_dim // 2, 1)), jnp.float32)
  if slot_mapping is None:
    slot_mapping = jnp.zeros((num_tokens,), jnp.int32)
  kernel = functools.partial(
      _kernel, num_tokens=num_tokens, num_heads=num_heads, nope_dim=nope_dim, pe_dim=pe_dim,
      tokens_per_program=tb, elems_per_program=eb, is_neox=is_neox,
      is_nope_first=is_nope_first, rotate=rotate, to_slots=destination is not None,
      num_slots=num_slots, num_rows=num_rows, quant_dtype=quant_dtype, interpret=interpret)
  out = lowering.pallas_call(
      kernel, out_shape=out_shape,
      grid=(pl.cdiv(num_tokens, tb), pl.cdiv(row_elems, eb)),
      input_output_aliases=aliases, interpret=interpret, name="jkv_mla_entries",
  )(slot_mapping.astype(jnp.int32), jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1),
    positions.astype(jnp.int32),
    jnp.asarray(inv_scale, jnp.float32).reshape(1), nope.reshape(num_tokens, -1),
    pe.reshape(num_tokens, -1), cos_cache, sin_cache, *views)
  if destination is None:
    if out.dtype != np.dtype(out_dtype):
      out = lax.bitcast_convert_type(out, out_dtype)
    return out.reshape(num_tokens, num_heads, nope_dim + pe_dim)
  return restore_caches([out], [destination])[0]
