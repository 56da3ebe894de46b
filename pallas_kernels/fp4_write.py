"""FP4 paged write (MXFP4 / NVFP4): E2M1 values packed two per byte, one scale per group
of 32 / 16 values.

Semantics are those of :func:`jkv.reference.quant_write.write_fp4` (bit for bit). Grid
over (token tiles, head groups); a program quantizes whole groups (:func:`
pallas_kernels.common.fp4_groups`) and stores bytes and scales through flat views. The
data and scale arrays are aliased to the outputs: nothing is copied.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jkv import fp4
from pallas_kernels import common, lowering


def _fp4_kernel(slot_ref,     # int32 [T] (< 0: padding)
                layer_ref,    # int32 [1]
                global_ref,   # float32 [4]: K, V global scales, their nvfp4 multipliers
                key_ref,      # [T, H * D]
                value_ref,    # [T, H * D]
                *refs,        # K / V data uint8 [L * nb * H * bs * D / 2] (flat), K / V
                              # group scales [L * nb * H * bs * D / G] (uint8 E8M0 bits or
                              # e4m3fn), then the same four as outputs (aliased)
                num_tokens, num_heads, head_size, block_size, num_blocks, tokens_per_program,
                heads_per_program, fp4_format):
  """A [tokens, heads] tile: every group of G values (32 mxfp4, 16 nvfp4) of each row
  quantized to E2M1 pairs with its group scale (:func:`pallas_kernels.common.fp4_groups`)
  and stored at the token's (block, head, offset) entry."""
  outs = refs[4:]
  data_outs, scale_outs = outs[:2], outs[2:]
  group = fp4.GROUP_SIZE[fp4_format]
  half = group // 2
  num_groups = head_size // group
  tb, hb, gp = tokens_per_program, heads_per_program, common.next_pow2(num_groups)
  t, t_ok, slot, ok = common.program_tokens(slot_ref, tb, num_tokens, num_blocks * block_size)
  h, h_ok = common.program_heads(hb, num_heads)
  g = lax.iota(jnp.int32, gp)
  i = lax.iota(jnp.int32, half)
  layer = layer_ref[0]
  # Entry (token, head) of a [L, nb, H, bs, n] array starts at entry * n.
  entry = (((layer * num_blocks + jnp.where(ok, slot // block_size, 0))[:, None] * num_heads
            + h[None, :]) * block_size + jnp.where(ok, slot % block_size, 0)[:, None])
  shape4 = (tb, hb, gp, half)
  mask3 = ok[:, None, None] & h_ok[None, :, None] & (g < num_groups)[None, None, :]
  mask4 = jnp.broadcast_to(mask3[..., None], shape4)
  pair = g[:, None] * half + i[None, :]                        # [GP, half]
  rows = jnp.broadcast_to(t[:, None, None, None], shape4)
  cols = jnp.broadcast_to((h[:, None, None] * head_size + 2 * pair[None])[None], shape4)
  for which, src in enumerate((key_ref, value_ref)):
    even = lowering.load(src.at[rows, cols], mask=mask4, other=0).astype(jnp.float32)
    odd = lowering.load(src.at[rows, cols + 1], mask=mask4, other=0).astype(jnp.float32)
    byte, scale = common.fp4_groups(even, odd, fp4_format, global_ref[which], global_ref[2 + which])
    data_index = entry[:, :, None, None] * (head_size // 2) + pair[None, None]
    common.store_flat(data_outs[which], data_index, byte, mask4)
    scale_index = entry[:, :, None] * num_groups + g[None, None, :]
    common.store_flat(scale_outs[which], scale_index, scale, mask3)


def _global_inputs(global_scales):
  """float32 [4]: the K and V global scales, then their nvfp4 scale multipliers."""
  g = jnp.asarray(global_scales, jnp.float32).reshape(2)
  return jnp.concatenate([g, jnp.stack([fp4.nvfp4_scale_multiplier(g[0]),
                                        fp4.nvfp4_scale_multiplier(g[1])])])


def fp4_write(key, value, key_data, value_data, k_block_scales, v_block_scales, slot_mapping,
              layer, global_scales, *, fp4_format: str, num_blocks: int, block_size: int,
              interpret: bool, tokens_per_program: int = 4, num_warps: int = 4):
  """FP4 write (see :func:`jkv.reference.quant_write.write_fp4`).

  key_data, value_data uint8 [L, nb, H, bs, D/2]; k/v_block_scales [L, nb, H, bs, D/G]
  (float8_e8m0fnu for mxfp4, float8_e4m3fn for nvfp4); global_scales float32 [2]
  (K, V; nvfp4). Returns the four arrays.
  """
  num_tokens, num_heads, head_size = key.shape
  tb = min(tokens_per_program, common.next_pow2(num_tokens))
  hb = common.head_group(num_heads, head_size // 2, tb, target=2048)
  scales = [s.reshape(-1) for s in (k_block_scales, v_block_scales)]
  if fp4_format == "mxfp4":   # E8M0 through its bits
    scales = [lax.bitcast_convert_type(s, jnp.uint8) for s in scales]
  arrays = (key_data.reshape(-1), value_data.reshape(-1), *scales)
  kernel = functools.partial(
      _fp4_kernel, num_tokens=num_tokens, num_heads=num_heads, head_size=head_size,
      block_size=block_size, num_blocks=num_blocks, tokens_per_program=tb, heads_per_program=hb,
      fp4_format=fp4_format)
  inputs = (slot_mapping.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
            _global_inputs(global_scales), key.reshape(num_tokens, -1),
            value.reshape(num_tokens, -1))
  outs = lowering.call_in_place(
      kernel, inputs, arrays, grid=(pl.cdiv(num_tokens, tb), pl.cdiv(num_heads, hb)),
      interpret=interpret, num_warps=num_warps, name="jkv_fp4_write")
  k_scales_out, v_scales_out = outs[2], outs[3]
  if fp4_format == "mxfp4":
    k_scales_out = lax.bitcast_convert_type(k_scales_out, k_block_scales.dtype)
    v_scales_out = lax.bitcast_convert_type(v_scales_out, v_block_scales.dtype)
  return (outs[0].reshape(key_data.shape), outs[1].reshape(value_data.shape),
          k_scales_out.reshape(k_block_scales.shape), v_scales_out.reshape(v_block_scales.shape))
