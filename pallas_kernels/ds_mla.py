"""vLLM's ``fp8_ds_mla`` cache write (DeepSeek FlashMLA sparse entries), bit for bit as
:func:`jkv.reference.mla.concat_and_cache_ds_mla` (compiled: the hardware's RNE FP8
conversion, which the GPU tests compare with the reference).

An entry is ``E = R + 4 R/128 + 2 P`` bytes: R e4m3 values of kv_c (one scale per 128
values), the R/128 float32 tile scales, then the P bf16 values of k_pe, little-endian.
The cache uint8 ``[(L,) NB, bs, E]`` is viewed as ``[rows, E]`` (a row is a slot, ``rows =
L * NB * bs``). Grid over token tiles; a program loads ``[tokens, tiles, 128]`` of kv_c
(tiles padded to a power of two), takes each tile's amax over finite values, its scale
``max(amax * (1 / 448), FLT_MIN)`` and the saturated FP8 values in float32, and stores the
values' bits, the four bytes of each scale and the two of each bf16 k_pe value (Triton
bitcasts only between types of one width: float32 -> uint32, bf16 -> uint16, then
``(bits >> 8 * byte) & 0xFF``). Slots < 0 or past the cache are not written; masked lanes
point one row past the cache (the interpreter drops them). The cache is aliased to the
output (``input_output_aliases``): untouched bytes keep their values.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jkv import quant
from jkv.formats import DS_MLA_TILE, FLT_MIN
from pallas_kernels import common, lowering

_FP8 = jnp.float8_e4m3fn
_SCALE_BYTES = 4
_PE_BYTES = 2


def _byte_planes(bits, width: int):
  """Unsigned ints [TB, N] -> their ``width`` little-endian bytes, uint8 [TB, N, width]."""
  shift = (8 * lax.iota(jnp.int32, width)).astype(bits.dtype)
  return ((bits[:, :, None] >> shift[None, None, :]) & 0xFF).astype(jnp.uint8)


def _kernel(slot_ref,    # int32 [T] (< 0: padding)
            layer_ref,   # int32 [1]
            kv_c_ref,    # [T, R]
            k_pe_ref,    # [T, P]
            cache_ref,   # uint8 [L * NB * bs, E] entries (aliased to out_ref)
            out_ref,     # uint8 [L * NB * bs, E]
            *, num_tokens, rank, pe_dim, num_slots, tokens_per_program, interpret):
  """A tile of tokens: each token's fp8_ds_mla entry (R FP8 values, a float32 scale per
  128, P bfloat16) written as bytes at its slot."""
  del cache_ref   # aliased to out_ref
  tiles = rank // DS_MLA_TILE
  tb = tokens_per_program
  t, t_ok, slot, ok = common.program_tokens(slot_ref, tb, num_tokens, num_slots)
  row = layer_ref[0] * num_slots + jnp.where(ok, slot, 0)

  def mask_of(token_ok, part_ok, shape):
    """token_ok [TB] & part_ok [N] (None: all) as ``shape`` [TB, N, W]."""
    mask = token_ok[:, None, None]
    if part_ok is not None:
      mask = mask & part_ok[None, :, None]
    return jnp.broadcast_to(mask, shape)

  def store(columns, value, mask):
    """value [TB, N, W] at ``columns`` [TB, N, W] of the tokens' rows where ``mask``."""
    # Masked lanes point one row past the cache (the interpreter drops them).
    rows = jnp.where(mask, row[:, None, None], out_ref.shape[0])
    lowering.store(out_ref.at[rows, jnp.broadcast_to(columns, value.shape)], value, mask=mask)

  # kv_c: [TB, tiles, 128] values (tiles padded to a power of two) -> FP8 and a scale per tile.
  tile, tile_raw, tile_ok = lowering.padded_columns(tiles)
  lane = lax.iota(jnp.int32, DS_MLA_TILE)
  shape = (tb, tile.shape[0], DS_MLA_TILE)
  # kv_c of padding slots is loaded too: the load need not wait for the slots.
  x = lowering.load(
      kv_c_ref.at[jnp.broadcast_to(t[:, None, None], shape),
                  jnp.broadcast_to((tile[:, None] * DS_MLA_TILE + lane[None, :])[None], shape)],
      mask=mask_of(t_ok, tile_ok, shape), other=0).astype(jnp.float32)
  amax = jnp.max(quant.finite_abs(x), axis=-1)                  # [TB, padded tiles]
  scale = jnp.maximum(quant.scale_of(amax, _FP8), FLT_MIN)
  # No clip before the conversion, which saturates by itself (with 2 warps a program, faster
  # than clipped: H100, 16K tokens, 12.5 us against 13.0; NOTES_quant).
  values = common.quantize_stored(x * (1.0 / scale)[:, :, None], _FP8, _FP8, not interpret)
  store((tile_raw[:, None] * DS_MLA_TILE + lane[None, :])[None],
        lax.bitcast_convert_type(values, jnp.uint8), mask_of(ok, tile_ok, shape))
  byte = lax.iota(jnp.int32, _SCALE_BYTES)
  store(rank + tile_raw[None, :, None] * _SCALE_BYTES + byte[None, None, :],
        _byte_planes(lax.bitcast_convert_type(scale, jnp.uint32), _SCALE_BYTES),
        mask_of(ok, tile_ok, (tb, tile.shape[0], _SCALE_BYTES)))

  # k_pe: [TB, P] (padded to a power of two) -> bf16 -> two bytes each.
  pe, pe_raw, pe_ok = lowering.padded_columns(pe_dim)
  pe_mask = t_ok[:, None] if pe_ok is None else t_ok[:, None] & pe_ok[None, :]
  k_pe = lowering.load(
      k_pe_ref.at[jnp.broadcast_to(t[:, None], (tb, pe.shape[0])),
                  jnp.broadcast_to(pe[None, :], (tb, pe.shape[0]))],
      mask=jnp.broadcast_to(pe_mask, (tb, pe.shape[0])), other=0)
  if k_pe.dtype != jnp.bfloat16:   # through float32: Triton has no float16 -> bf16 cast
    k_pe = k_pe.astype(jnp.float32).astype(jnp.bfloat16)
  bits = lax.bitcast_convert_type(k_pe, jnp.uint16)
  byte = lax.iota(jnp.int32, _PE_BYTES)
  store(rank + tiles * _SCALE_BYTES + pe_raw[None, :, None] * _PE_BYTES + byte[None, None, :],
        _byte_planes(bits, _PE_BYTES), mask_of(ok, pe_ok, (tb, pe.shape[0], _PE_BYTES)))


def write_entries(kv_c, k_pe, kv_cache, slot_mapping, layer, *, interpret: bool,
                  tokens_per_program: int | None = None, num_warps: int = 2):
  """The ``fp8_ds_mla`` entries of kv_c [T, R] (float, R a multiple of 128) and k_pe [T, P]
  (float) into kv_cache uint8 [(L,) NB, bs, R + R/128 * 4 + 2 P] in place.

  slot_mapping: int32 [T]; < 0 or >= NB * bs: not written. layer: int32 scalar (may be
  traced, in range) into the leading num_layers dim, or None. tokens_per_program: a power
  of two (None: ~4096 kv_c values per program, 8 tokens at R = 512, fewer while that
  leaves under 128 programs); num_warps: 2 (H100, 16K tokens: 12.5 us, 13.8 with 4, 12.7
  with 8; NOTES_quant). Returns the updated kv_cache.
  """
  num_tokens, rank = kv_c.shape
  pe_dim = k_pe.shape[1]
  num_slots = kv_cache.shape[-3] * kv_cache.shape[-2]
  view = kv_cache.reshape(-1, kv_cache.shape[-1])
  tb = tokens_per_program or common.tokens_per_program(
      num_tokens, common.next_pow2(rank // DS_MLA_TILE) * DS_MLA_TILE, 4096)
  kernel = functools.partial(
      _kernel, num_tokens=num_tokens, rank=rank, pe_dim=pe_dim, num_slots=num_slots,
      tokens_per_program=tb, interpret=interpret)
  inputs = (slot_mapping.astype(jnp.int32),
            jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1), kv_c, k_pe)
  (out,) = lowering.call_in_place(kernel, inputs, (view,), grid=(pl.cdiv(num_tokens, tb),),
                                  interpret=interpret, num_warps=num_warps,
                                  name="jkv_ds_mla_entries")
  return out.reshape(kv_cache.shape)
