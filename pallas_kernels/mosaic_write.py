"""Paged cache write kernel for Mosaic GPU (Hopper TMA): token rows to NHD / HND pages.

A program takes ``tokens_per_program`` consecutive tokens: one TMA load brings their
``[TB, H, D]`` key rows (and one their value rows) into shared memory, then each token
with a slot in the cache is stored by TMA to its place: ``[H, D]`` at ``[block, offset,
:, base:base + D]`` of an NHD cache viewed ``[rows, bs, H, row]``, or at ``[block, :,
offset, base:base + D]`` of an HND cache viewed ``[rows, H, bs, row]`` (``row`` is D, or
2D for the packed layouts, whose K and V share a row). Padding slots (< 0) and slots past
the cache store nothing. The last program's window is moved back to end at the last
token (so every load stays in bounds) and it skips the tokens the program before it
stored. The slots and the layer are read as scalars from global memory, in the kernel
(no XLA pass lays them out first: a decode write is one launch). FP8 caches: each token's
row is scaled by ``1 / scale`` per head, clipped to the format's range (NaN stays NaN)
and converted in registers (round to nearest even), then stored.

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


def smem_bytes(tokens_per_program: int, num_heads: int, head_size: int, itemsize: int,
               quantized: bool) -> int:
  """Shared memory of one program: the K and V tiles and, for FP8 caches, the [2, H, D]
  float32 scale rows and the converted tiles."""
  tiles = 2 * tokens_per_program * num_heads * head_size * (itemsize + int(quantized))
  return tiles + (2 * num_heads * head_size * 4 if quantized else 0)


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


def _kernel(slot_ref,        # int32 [T] GMEM
            layer_ref,       # int32 [1] GMEM
            key_ref,         # [T, H, D] GMEM
            value_ref,       # [T, H, D] GMEM
            *refs,           # FP8: the float32 [2, H, D] 1 / scale rows (GMEM); then the
                             # cache refs (one, or K and V), then the scratch
            num_tokens, tokens_per_program, layer_slots, num_layers, block_size, planes,
            head_size, quant_dtype, shared, interpret):
  num_caches = 1 if shared else 2
  quantized = quant_dtype is not None
  scale_ref = refs[0] if quantized else None
  refs = refs[int(quantized):]
  cache_refs, scratch = refs[:num_caches], refs[num_caches:]
  k_smem, v_smem, barriers = scratch[:3]
  scale_smem, quant_smem = (scratch[3], scratch[4:]) if quantized else (None, ())
  tb = tokens_per_program
  program = jax.lax.axis_index("program")
  first = program * tb
  start = jnp.minimum(first, num_tokens - tb)   # the last window ends at the last token
  plgpu = lowering.plgpu
  loads = [(key_ref.at[pl.ds(start, tb)], k_smem), (value_ref.at[pl.ds(start, tb)], v_smem)]
  if quantized:
    loads.append((scale_ref, scale_smem))
  for i, (src, dst) in enumerate(loads):
    plgpu.copy_gmem_to_smem(src, dst, barriers.at[i])
  # Scalars from global memory while the copies fly: the layer, the tokens' slots.
  layer = layer_ref[0]
  layer_ok = (layer >= 0) & (layer < num_layers)
  slots = [slot_ref[start + j] for j in range(tb)]
  for i in range(len(loads)):
    plgpu.barrier_wait(barriers.at[i])

  sources = [k_smem, v_smem]
  if quant_dtype is not None:   # token by token: [H, D] rows times the [H, D] scale rows
    num_heads, head_size = k_smem.shape[1:]
    per_thread = num_heads * head_size // 128
    # One register layout for the input and scale rows (their dtypes' defaults differ).
    layout = plgpu.Layout.WG_STRIDED((num_heads, head_size),
                                     vec_size=max(v for v in (4, 2, 1) if per_thread % v == 0))
    for which, (src, dst) in enumerate(zip(sources, quant_smem)):
      inv_scale = plgpu.load(scale_smem.at[which], layout=layout)
      for j in range(tb):
        y = plgpu.load(src.at[j], layout=layout).astype(jnp.float32) * inv_scale
        # Interpreted: the reference's exact path (the CPU's conversion rounds e5m2 twice).
        dst[j] = quant.saturate_cast(y, quant_dtype, native=not interpret)
    plgpu.commit_smem()
    sources = list(quant_smem)

  for j, slot in enumerate(slots):
    # Padding slots (< 0), slots past the layer and layers out of range write nothing.
    todo = (start + j >= first) & (slot >= 0) & (slot < layer_slots) & layer_ok

    @pl.when(todo)
    def _(j=j, slot=slot):
      row = slot + layer * layer_slots   # the slot in the view of every layer's blocks
      block, offset = row // block_size, row % block_size
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
  quantized = quant_dtype is not None
  inputs = [slot_mapping.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32), key,
            value]
  plgpu = lowering.plgpu
  tile = (tb, num_heads, head_size)
  scratch = [plgpu.SMEM(tile, key.dtype), plgpu.SMEM(tile, value.dtype),
             plgpu.Barrier(num_barriers=3 if quantized else 2)]
  if quantized:   # 1 / scale of each head, as rows to multiply the [H, D] tiles by
    head_scales = [jnp.broadcast_to(s, (num_heads,)) for s in (k_inv_scale, v_inv_scale)]
    inputs.append(jnp.broadcast_to(jnp.stack(head_scales)[:, :, None],
                                   (2, num_heads, head_size)).astype(jnp.float32))
    scratch += [plgpu.SMEM((2, num_heads, head_size), jnp.float32)]
    scratch += [plgpu.SMEM(tile, quant_dtype)] * 2
  kernel = functools.partial(
      _kernel, num_tokens=num_tokens, tokens_per_program=tb, layer_slots=num_blocks * bs,
      num_layers=views[0].shape[0] // num_blocks, block_size=bs,
      planes=(key_plane, value_plane), head_size=head_size, quant_dtype=quant_dtype,
      shared=shared, interpret=interpret)
  outs = lowering.mosaic_in_place(
      kernel, tuple(inputs), views, grid=-(-num_tokens // tb),
      scratch=scratch, interpret=interpret, name="jkv_scatter_kv_mosaic")
  return tuple(out.reshape(cache.shape) for out, cache in zip(outs, caches))
