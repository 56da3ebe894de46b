"""Paged cache write kernel for Mosaic GPU (Hopper TMA): token rows to NHD / HND pages.

A program takes ``tokens_per_program`` consecutive tokens: one TMA load brings their
``[TB, H, D]`` key rows (and one their value rows) into shared memory, then each token
with a slot in the cache is stored by TMA to its place: ``[H, D]`` at ``[block, offset,
:, base:base + D]`` of an NHD cache viewed ``[rows, bs, H, row]``, or at ``[block, :,
offset, base:base + D]`` of an HND cache viewed ``[rows, H, bs, row]`` (``row`` is D, or
2D for the packed layouts, whose K and V share a row). Padding slots (< 0) and slots past
the cache store nothing. The last program's window is moved back to end at the last
token (so every load stays in bounds) and it skips the tokens the program before it
stored. The slots come in by TMA too, from the multiple of 4 at or before the window's
first token (a TMA load from an address that is not 16-byte aligned stops the GPU).
FP8 caches: each token's row is scaled by ``1 / scale`` per head, clipped to the format's
range (NaN stays NaN) and converted in registers (round to nearest even), then stored.

The caches are updated through refs (:func:`pallas_kernels.lowering.mosaic_in_place`):
donated, they are written in place. Same semantics as :mod:`pallas_kernels.write`
(``jkv_scatter_kv``) for the layouts and formats :func:`supported` accepts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jkv import quant
from jkv.layout import Plane
from pallas_kernels import lowering

_SMEM_TARGET = 96 * 1024   # shared memory a program aims at (two programs per Hopper SM)
_SMEM_LIMIT = 200 * 1024   # what one program may take (a Hopper SM has 227 KiB; Mosaic's
                           # own scratch and barriers take some)
_FP8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def slot_window(tokens_per_program: int) -> int:
  """Slots a program loads: its tokens' and up to 3 before them (the window starts at a
  multiple of 4), in whole 128-byte lines (a warpgroup's 128 threads)."""
  return -(-(tokens_per_program + 3) // 32) * 32


def smem_bytes(tokens_per_program: int, num_heads: int, head_size: int, itemsize: int,
               quantized: bool) -> int:
  """Shared memory of one program: its slots, the [2, H, D] float32 scale rows, the K and V
  tiles and, for FP8 caches, their converted copies."""
  slots = slot_window(tokens_per_program) * 4
  tiles = 2 * tokens_per_program * num_heads * head_size * (itemsize + int(quantized))
  return slots + 2 * num_heads * head_size * 4 + tiles


def supported(key_plane: Plane, value_plane: Plane, key_dtype, value_dtype, cache_dtype,
              quant_dtype) -> bool:
  """Whether this kernel handles the case:

  * NHD / HND planes whose tensor lies inside its row: flash, hnd, packed (not FlashInfer's
    single ``paged5d`` tensor, whose V plane starts a half block in);
  * key and value of one dtype, a cache of that dtype or an FP8 (e4m3fn / e5m2) cache
    written with quantization (then ``H * D`` a multiple of 128: rows are converted in
    registers, whole lines of the warpgroup);
  * a row of ``head_size`` elements a whole number of 16-byte vectors (a TMA box), a
    token's ``[H, D]`` input rows a multiple of 128 bytes (a warpgroup's loads), at most
    256 heads and 256 dims (TMA box limits), and one token's tiles within
    ``_SMEM_LIMIT`` of shared memory.
  """
  planes_ok = all(p.kind in ("NHD", "HND") and p.base + p.head_size <= (p.row or p.head_size)
                  for p in (key_plane, value_plane))
  cache_dtype = np.dtype(cache_dtype)
  input_dtype = np.dtype(key_dtype)
  if quant_dtype is None:
    dtype_ok = cache_dtype == input_dtype
  else:
    dtype_ok = cache_dtype in _FP8 and cache_dtype == np.dtype(quant_dtype)
  dtype_ok = dtype_ok and np.dtype(value_dtype) == input_dtype
  h, d = key_plane.num_heads, key_plane.head_size
  itemsize = input_dtype.itemsize
  box_ok = (h <= 256 and d <= 256 and (d * cache_dtype.itemsize) % 16 == 0
            and (d * itemsize) % 16 == 0 and (h * d * itemsize) % 128 == 0)
  quant_ok = quant_dtype is None or (h * d) % 128 == 0
  smem_ok = smem_bytes(1, h, d, itemsize, quant_dtype is not None) <= _SMEM_LIMIT
  return (planes_ok and dtype_ok and box_ok and quant_ok and smem_ok
          and lowering.mosaic_available())


def default_tokens_per_program(num_tokens: int, num_heads: int, head_size: int,
                               itemsize: int, quantized: bool, min_programs: int = 264) -> int:
  """Tokens per program: 8 (32K-token writes on an H200, 2026-11-26: 8 and 16 within 1% in
  bf16, 8 faster by 7% in FP8), fewer where the token count is smaller or the shared
  memory would pass ``_SMEM_TARGET``, and fewer while that leaves under ``min_programs``
  programs (two per SM of an H100), so small writes spread over the GPU."""
  tokens = max(1, min(8, num_tokens))
  while tokens > 1 and smem_bytes(tokens, num_heads, head_size, itemsize,
                                  quantized) > _SMEM_TARGET:
    tokens //= 2
  while tokens > 1 and -(-num_tokens // tokens) < min_programs:
    tokens //= 2
  return tokens


def _kernel(slot_ref,        # int32 [T + pad] GMEM: slots, -1 past the tokens
            scale_ref,       # float32 [2, H, D] GMEM: 1 / k_scale, 1 / v_scale of each head
            key_ref,         # [T, H, D] GMEM
            value_ref,       # [T, H, D] GMEM
            *refs,           # the cache refs (one, or K and V), then the scratch
            num_tokens, tokens_per_program, window, num_slots, block_size, planes,
            head_size, quant_dtype, shared, interpret):
  num_caches = 1 if shared else 2
  cache_refs, scratch = refs[:num_caches], refs[num_caches:]
  slot_smem, scale_smem, k_smem, v_smem, barriers = scratch[:5]
  quant_smem = scratch[5:]
  tb = tokens_per_program
  program = jax.lax.axis_index("program")
  first = program * tb
  start = jnp.minimum(first, num_tokens - tb)   # the last window ends at the last token
  plgpu = lowering.plgpu
  # TMA reads global memory from 16-byte aligned addresses: the slots' window starts at
  # the multiple of 4 at or before ``start``.
  slot_start = (start // 4) * 4
  loads = ((slot_ref.at[pl.ds(slot_start, window)], slot_smem), (scale_ref, scale_smem),
           (key_ref.at[pl.ds(start, tb)], k_smem), (value_ref.at[pl.ds(start, tb)], v_smem))
  for i, (src, dst) in enumerate(loads):
    plgpu.copy_gmem_to_smem(src, dst, barriers.at[i])
  for i in range(len(loads)):
    plgpu.barrier_wait(barriers.at[i])

  sources = [k_smem, v_smem]
  if quant_dtype is not None:   # token by token: [H, D] rows times the [H, D] scale rows
    m = float(quant.dtype_max(quant_dtype))
    num_heads, head_size = k_smem.shape[1:]
    per_thread = num_heads * head_size // 128
    # One register layout for the input and scale rows (their dtypes' defaults differ).
    layout = plgpu.Layout.WG_STRIDED((num_heads, head_size),
                                     vec_size=max(v for v in (4, 2, 1) if per_thread % v == 0))
    for which, (src, dst) in enumerate(zip(sources, quant_smem)):
      inv_scale = plgpu.load(scale_smem.at[which], layout=layout)
      for j in range(tb):
        y = plgpu.load(src.at[j], layout=layout).astype(jnp.float32) * inv_scale
        if interpret:   # the exact path of the reference (the CPU rounds e5m2 twice)
          dst[j] = quant.saturate_cast(y, quant_dtype)
        else:   # saturate_cast(native=True), as it ran on the GPU: clip keeping NaN, convert
          dst[j] = jnp.where(y == y, jnp.minimum(jnp.maximum(y, -m), m), y).astype(quant_dtype)
    plgpu.commit_smem()
    sources = list(quant_smem)

  for j in range(tb):
    slot = slot_smem[start - slot_start + j]
    todo = (start + j >= first) & (slot >= 0) & (slot < num_slots)

    @pl.when(todo)
    def _(j=j, slot=slot):
      block, offset = slot // block_size, slot % block_size
      for which, (src, plane) in enumerate(zip(sources, planes)):
        cache = cache_refs[0 if shared else which]
        columns = pl.ds(plane.base, head_size)
        if plane.kind == "NHD":
          dst = cache.at[block, offset, :, columns]
        else:
          dst = cache.at[block, :, offset, columns]
        plgpu.copy_smem_to_gmem(src.at[j], dst, commit_group=False)
  plgpu.commit_smem_to_gmem_group()
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def scatter_kv(key, value, key_cache, value_cache, slot_mapping, layer, k_inv_scale,
               v_inv_scale, *, key_plane: Plane, value_plane: Plane, num_blocks: int,
               quant_dtype, interpret: bool, tokens_per_program: int | None = None):
  """Writes ``key``/``value`` [T, H, D] into paged caches (NHD / HND planes) in place.

  Same arguments and result as :func:`pallas_kernels.write.scatter_kv`; the case must
  pass :func:`supported`. ``tokens_per_program`` None: :func:`default_tokens_per_program`.
  """
  num_tokens, num_heads, head_size = key.shape
  shared = value_cache is None
  caches = (key_cache,) if shared else (key_cache, value_cache)
  bs = key_plane.block_size
  row = key_plane.row or head_size
  views = []
  for cache, plane in zip(caches, (key_plane, value_plane)):
    shape = (-1, bs, num_heads, row) if plane.kind == "NHD" else (-1, num_heads, bs, row)
    views.append(cache.reshape(shape))
  tb = tokens_per_program or default_tokens_per_program(
      num_tokens, num_heads, head_size, np.dtype(key.dtype).itemsize, quant_dtype is not None)
  tb = min(tb, num_tokens)
  window = slot_window(tb)
  slots = jnp.full((num_tokens + window,), -1, jnp.int32)
  slots = slots.at[:num_tokens].set(slot_mapping.astype(jnp.int32))
  # Out-of-range layers write nothing (the op maps their slots to -1); rows of other
  # layers follow from the layer's first block.
  layer = jnp.asarray(layer, jnp.int32)
  in_layer = (slots >= 0) & (slots < num_blocks * bs)
  slots = jnp.where(in_layer, slots + layer * (num_blocks * bs), -1)
  num_slots = views[0].shape[0] * bs
  head_scales = [jnp.broadcast_to(s, (num_heads,)) for s in (k_inv_scale, v_inv_scale)]
  scales = jnp.broadcast_to(jnp.stack(head_scales)[:, :, None], (2, num_heads, head_size))
  plgpu = lowering.plgpu
  tile = (tb, num_heads, head_size)
  scratch = [plgpu.SMEM((window,), jnp.int32), plgpu.SMEM((2, num_heads, head_size), jnp.float32),
             plgpu.SMEM(tile, key.dtype), plgpu.SMEM(tile, value.dtype),
             plgpu.Barrier(num_barriers=4)]
  if quant_dtype is not None:
    scratch += [plgpu.SMEM(tile, quant_dtype)] * 2
  kernel = functools.partial(
      _kernel, num_tokens=num_tokens, tokens_per_program=tb, window=window,
      num_slots=num_slots, block_size=bs, planes=(key_plane, value_plane),
      head_size=head_size, quant_dtype=quant_dtype, shared=shared, interpret=interpret)
  outs = lowering.mosaic_in_place(
      kernel, (slots, scales, key, value), views, grid=-(-num_tokens // tb),
      scratch=scratch, interpret=interpret, name="jkv_scatter_kv_mosaic")
  return tuple(out.reshape(cache.shape) for out, cache in zip(outs, caches))
