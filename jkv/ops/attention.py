"""Paged decode attention: one query token per sequence reads its K/V from the cache.

``paged_attention_decode`` is the array-level op (vLLM ``paged_attention_v1`` semantics,
every jkv layout and cache format); ``PagedKVCache.attend`` calls :func:`decode_attention`
with the cache's own arrays. Semantics: :mod:`jkv.reference.attention`; kernel:
:mod:`pallas_kernels.attention` (split over the context, so long sequences in small
batches fill the GPU). Block sizes that are not powers of two read through the
reference, and so do FP4 caches on every back end: their kernel was removed, short of
the 1.5x over XLA's code for the reference that issue 28 asked (H100, 8 x 32K: MXFP4 1011
vs 782 us, NVFP4 751 vs 795 us; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import errors, fp4, layout as layout_lib, partitioning, quant
from jkv.ops import quant_write as quant_write_ops
from jkv.ops.write import as_cache, cache_lead, check_caches, check_rank, resolve_quant
from jkv.reference import attention as reference
from jkv.formats import CacheFormat
from pallas_kernels import attention as kernels
from pallas_kernels import lowering as lowering_lib
from pallas_kernels import mosaic_attention, mosaic_fp8_decode, mosaic_fp8_x_decode

# ``lowering="auto"`` picks the Mosaic GPU kernel on Hopper for caches in the query's dtype
# and FP8 caches with per-tensor / per-head scales, where it measured as fast as Triton's or
# faster (benchmarks/RESULTS.md, "lowering": FP8 since its keys stay FP8, H200).
MOSAIC_ATTENTION_FIRST = ("none", "tensor")


def mosaic_decode_kernel(cache_dtype, key_plane):
  """The module of the Mosaic GPU decode kernel for a cache of ``cache_dtype`` whose keys
  lie as ``key_plane`` (its ``supported`` and ``paged_attention_decode``):
  :mod:`pallas_kernels.mosaic_fp8_x_decode` for FP8 vLLM / ASM caches (x-vectorized keys),
  :mod:`pallas_kernels.mosaic_fp8_decode` (the keys as wgmma's M) for other FP8 caches,
  else :mod:`pallas_kernels.mosaic_attention`."""
  if np.dtype(cache_dtype) in mosaic_attention.FP8:
    return mosaic_fp8_x_decode if key_plane.kind == "KX" else mosaic_fp8_decode
  return mosaic_attention


def check_tables(block_tables, seq_lens, num_blocks: int, block_size: int,
                 lens_name: str = "seq_lens", table_name: str = "block_tables"):
  """Validated int32 (block_tables [B, W], seq_lens [B]; ``lens_name`` and ``table_name``
  name them in the messages). W >= 1. Eagerly: 0 <= seq_lens <= W * bs and every block
  id that seq_lens reads lies in the cache (and values fit in int32 as given, before JAX
  would wrap them). Under jit, positions past the table are not read and blocks outside the
  cache count as masked."""
  block_tables = errors.int_array(table_name, block_tables)
  seq_lens = errors.int_array(lens_name, seq_lens)
  errors.check_ndim(table_name, block_tables, 2, "[num_seqs, max_blocks_per_seq]")
  errors.check_int(table_name, block_tables)
  errors.check_ndim(lens_name, seq_lens, 1, "[num_seqs]")
  errors.check_int(lens_name, seq_lens)
  errors.check_shape(lens_name, seq_lens, block_tables.shape[:1])
  width = block_tables.shape[1]
  if width == 0:
    raise ValueError(f"{table_name} must have at least one column (a block per sequence), "
                     f"got shape {tuple(block_tables.shape)}")
  if errors.is_concrete(block_tables) and errors.is_concrete(seq_lens):
    table, lens = np.asarray(block_tables), np.asarray(seq_lens)
    bad = np.nonzero((lens < 0) | (lens > width * block_size))[0]
    if bad.size:
      i = int(bad[0])
      raise ValueError(f"{lens_name}[{i}] = {int(lens[i])} is out of range: {table_name} has "
                       f"{width} blocks of {block_size} tokens per sequence (valid: "
                       f"0..{width * block_size})")
    used = np.arange(width)[None, :] * block_size < lens[:, None]
    bad = np.argwhere(used & ((table < 0) | (table >= num_blocks)))
    if bad.size:
      i, j = (int(v) for v in bad[0])
      raise ValueError(f"{table_name}[{i}, {j}] = {int(table[i, j])} is outside the cache "
                       f"(valid: 0..{num_blocks - 1}) and {lens_name}[{i}] = {int(lens[i])} "
                       f"reads it")
  return block_tables.astype(jnp.int32), jnp.minimum(seq_lens.astype(jnp.int32),
                                                     width * block_size)


def check_batch(query, block_tables):
  """ValueError unless query [B, ...] has a row per block_tables row [B, W] (the kernels'
  grid follows the query: a row past the table would read past it)."""
  if query.shape[0] != block_tables.shape[0]:
    raise ValueError(f"query has {query.shape[0]} rows but block_tables has "
                     f"{block_tables.shape[0]}: decode attention takes one query row per "
                     f"sequence")


def layer_and_lengths(layer, num_layers: int, seq_lens):
  """(layer, seq_lens) for a read of one of ``num_layers`` stacked layers: ``layer`` an
  integer scalar, eagerly in range; a traced layer out of range reads nothing (seq_lens
  become 0, so the output is zeros) rather than another layer."""
  errors.check_index("layer", layer, num_layers)
  layer = jnp.asarray(layer, jnp.int32)
  seq_lens = jnp.where((layer >= 0) & (layer < num_layers), seq_lens, 0)
  return jnp.clip(layer, 0, num_layers - 1), seq_lens


REAL = (int, float, np.integer, np.floating)   # static float options (NumPy scalars too)


def check_options(num_q_heads: int, head_size: int, scale, alibi_slopes, logits_soft_cap,
                  sliding_window):
  """(scale, alibi_slopes, logits_soft_cap, sliding_window) validated; 0 / None switch the
  soft cap and the window off (AITER passes 0 for off)."""
  if scale is None:
    scale = head_size ** -0.5
  if not isinstance(scale, REAL) or not np.isfinite(scale):
    raise TypeError(f"scale must be a finite Python float (static), got {scale!r}")
  if alibi_slopes is not None:
    alibi_slopes = jnp.asarray(alibi_slopes)
    errors.check_float("alibi_slopes", alibi_slopes)
    errors.check_shape("alibi_slopes", alibi_slopes, (num_q_heads,))
    alibi_slopes = alibi_slopes.astype(jnp.float32)
  if logits_soft_cap is not None:
    if (not isinstance(logits_soft_cap, REAL) or not logits_soft_cap >= 0
        or not np.isfinite(logits_soft_cap)):
      raise ValueError(f"logits_soft_cap must be None or a finite float >= 0 (0: off), got "
                       f"{logits_soft_cap!r}")
    logits_soft_cap = float(logits_soft_cap) or None
  if sliding_window is not None:
    if not isinstance(sliding_window, (int, np.integer)) or sliding_window < 0:
      raise ValueError(f"sliding_window must be None or an int >= 0 (0: off), got "
                       f"{sliding_window!r}")
    sliding_window = int(sliding_window) or None
  return float(scale), alibi_slopes, logits_soft_cap, sliding_window


def check_query(query, num_kv_heads: int, head_size: int, rows: str = "num_seqs"):
  """query [rows, Hq, head_size] float, Hq a multiple of the cache's kv heads (``rows``
  names the first dim in the messages)."""
  query = jnp.asarray(query)
  errors.check_ndim("query", query, 3, f"[{rows}, num_q_heads, head_size]")
  errors.check_float("query", query)
  if query.shape[2] != head_size or query.shape[1] % num_kv_heads:
    raise ValueError(f"query must be [{rows}, num_q_heads, {head_size}] with num_q_heads a "
                     f"multiple of the cache's {num_kv_heads} kv heads, got shape "
                     f"{tuple(query.shape)}")
  return query


def kernel_geometry(fmt: CacheFormat, key_cache, block_size: int, num_heads: int,
                    head_size: int):
  """(key_plane, value_plane, rows) for the Triton read kernels: ``rows`` is {} for stacked
  caches [L, nb, ...], or the MAX collection's ``key_rows`` / ``value_rows`` (NHD pages,
  a row per (block, K|V, layer))."""
  if fmt.layout != layout_lib.MAX:
    return layout_lib.planes(fmt.layout, block_size, num_heads, head_size, key_cache.dtype,
                             fmt.kv_layout) + ({},)
  key_rows, value_rows = layout_lib.max_rows(layout_lib.max_dims(key_cache.shape)[1])
  return layout_lib.max_planes(block_size, num_heads, head_size) + (
      dict(key_rows=key_rows, value_rows=value_rows),)


def decode_attention(fmt: CacheFormat, query, key_cache, value_cache, k_scale, v_scale,
                     k_global_scale, v_global_scale, layer, block_tables, seq_lens, *,
                     num_blocks: int, block_size: int, num_heads: int, head_size: int,
                     scale: float, alibi_slopes, logits_soft_cap, sliding_window,
                     backend: str, lowering: str = "auto"):
  """Dispatch of validated arguments (caches and token / block scales with a leading
  num_layers dim, or the MAX collection [nb, 2, L, bs, H, D] as key_cache; ``layer`` an
  int32 scalar, k/v_scale [H] for ``tensor``); ``lowering``:
  :func:`jkv.backend.lowering` (the Mosaic GPU kernel where it takes the case)."""
  check_batch(query, block_tables)

  def mosaic_supported(query_dtype, cache_dtype, heads):
    if fmt.quant not in ("none", "tensor") or fmt.layout not in layout_lib.LAYOUTS:
      return False   # (Mojo MAX's collection has no Mosaic kernel)
    key_plane, value_plane = layout_lib.planes(fmt.layout, block_size, heads, head_size,
                                               cache_dtype, fmt.kv_layout)
    return mosaic_decode_kernel(cache_dtype, key_plane).supported(
        key_plane, value_plane, query_dtype, cache_dtype, query.shape[1] // num_heads,
        quant=fmt.quant, alibi=alibi_slopes is not None, soft_cap=logits_soft_cap is not None,
        window=sliding_window is not None)

  mosaic_ok = mosaic_supported(query.dtype, key_cache.dtype, num_heads)
  triton_ok = lowering_lib.triton_available()
  chosen = backend_lib.resolve(   # FP4 caches: no kernel; nor some MAX scale groups
      backend, kernel_supported=kernels.supports(block_size) and (triton_ok or mosaic_ok)
      and fmt.quant not in fp4.FORMATS
      and quant_write_ops.kernel_reads_format(fmt, head_size))
  mosaic_ok = mosaic_ok and not (chosen == "interpret" and partitioning.wraps_kernels())
  lowering = backend_lib.lowering(
      lowering, mosaic_supported=mosaic_ok,
      mosaic_first=fmt.quant in MOSAIC_ATTENTION_FIRST and backend_lib.hopper(),
      triton_available=triton_ok, kernel=chosen != "reference")
  options = dict(scale=scale, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
                 sliding_window=sliding_window)
  if query.shape[0] == 0:   # no sequences
    return jnp.zeros(query.shape, query.dtype)
  if chosen == "reference":
    return reference.paged_attention_decode(
        fmt, query, key_cache, value_cache, k_scale, v_scale, k_global_scale, v_global_scale,
        layer, block_tables, seq_lens, num_blocks=num_blocks, block_size=block_size,
        num_heads=num_heads, head_size=head_size, **options)

  caches = (key_cache,) if value_cache is None else (key_cache, value_cache)
  alibi = () if alibi_slopes is None else (alibi_slopes,)   # an operand only when given
  collection = fmt.layout == layout_lib.MAX   # [nb, 2, L, bs, H, D], not [L, nb, ...]
  lead = 0 if collection else 1

  def kernel(query, layer, block_tables, seq_lens, *arrays, block_axes):   # one shard's
    key_cache, value_cache = arrays[0], arrays[1] if len(caches) == 2 else None
    k_scale, v_scale = arrays[len(caches):len(caches) + 2]
    heads = key_cache.shape[lead + layout_lib.heads_dim(fmt.layout, fmt.kv_layout)]
    # A shard may leave the Mosaic kernel's shapes, and it does not combine block shards.
    if (lowering == "mosaic" and block_axes is None
        and mosaic_supported(query.dtype, key_cache.dtype, heads)):
      key_plane, value_plane = layout_lib.planes(fmt.layout, block_size, heads, head_size,
                                                 key_cache.dtype, fmt.kv_layout)
      return mosaic_decode_kernel(key_cache.dtype, key_plane).paged_attention_decode(
          query, key_cache, value_cache, k_scale, v_scale, layer, block_tables, seq_lens,
          key_plane=key_plane, value_plane=value_plane, num_blocks=key_cache.shape[1],
          scale=scale, interpret=chosen == "interpret")
    if not triton_ok:
      raise NotImplementedError("this shard of the decode attention is not the Mosaic GPU "
                                "kernel's and this JAX has no Pallas Triton; use "
                                "backend='reference'")
    key_plane, value_plane, rows = kernel_geometry(fmt, key_cache, block_size, heads,
                                                   head_size)
    return kernels.paged_attention_decode(
        fmt, query, key_cache, value_cache, k_scale, v_scale, layer, block_tables, seq_lens,
        key_plane=key_plane, value_plane=value_plane, num_blocks=key_cache.shape[lead],
        interpret=chosen == "interpret", combine_axes=block_axes, **rows,
        **dict(options, alibi_slopes=arrays[-1] if alibi else None))

  cache_role = partitioning.Cache(lead, lead + layout_lib.heads_dim(fmt.layout, fmt.kv_layout))
  if fmt.scale_collection:                   # [nb, 2, L, bs, H, G]
    scale_role = cache_role
  elif fmt.quant in ("token", "block"):      # [L, nb | units, H]
    scale_role = partitioning.Cache(1, 2)
  else:                                      # [H]
    scale_role = partitioning.HEAD_SCALE
  roles = ((partitioning.QUERY, partitioning.REPLICATED, partitioning.BLOCK_TABLE,
            partitioning.REPLICATED) + (cache_role,) * len(caches) + (scale_role,) * 2
           + (partitioning.QUERY_HEAD,) * len(alibi))
  return partitioning.per_shard(
      kernel, (query, layer, block_tables, seq_lens) + caches + (k_scale, v_scale) + alibi,
      roles, block_size=block_size, read=True)


def dequant_scales(k_dequant_scales, v_dequant_scales, asm_layout: bool, lead: int,
                    num_blocks: int, block_size: int, num_heads: int):
  """AITER's per-token / per-block scale arrays -> (quant, unit, k, v) in the cache
  pytree's layouts ([L, nb, H, bs] per token, [L, units, H] per block)."""
  slots = num_blocks * block_size
  out = []
  kinds = set()
  for name, s in (("k_dequant_scales", k_dequant_scales), ("v_dequant_scales", v_dequant_scales)):
    s = jnp.asarray(s)
    errors.check_float(name, s)
    shape = tuple(s.shape[lead:])
    layers = tuple(s.shape[:lead])
    if asm_layout and shape == (num_blocks, num_heads, block_size):
      kind, unit = "token", 1
    elif not asm_layout and shape == (num_heads, slots):
      kind, unit = "token", 1
      s = s.reshape(layers + (num_heads, num_blocks, block_size))
      s = jnp.moveaxis(s, lead, lead + 1)
    elif (len(shape) == 2 and shape[1 if asm_layout else 0] == num_heads
          and shape[0 if asm_layout else 1] > 0 and slots % shape[0 if asm_layout else 1] == 0
          and (slots // shape[0 if asm_layout else 1]) % block_size == 0):
      kind, unit = "block", slots // shape[0 if asm_layout else 1]
      if not asm_layout:
        s = jnp.swapaxes(s, lead, lead + 1)
    else:
      expected = ("[num_blocks, H, block_size] (per token) or [units, H] (per block)"
                  if asm_layout else "[H, num_blocks * block_size] (per token) or [H, units] "
                  "(per block)")
      raise ValueError(f"{name} must be {'[num_layers, ...] ' if lead else ''}{expected} with "
                       f"num_blocks={num_blocks}, H={num_heads}, block_size={block_size} "
                       f"(asm_layout={asm_layout}), got shape {tuple(s.shape)}")
    kinds.add((kind, unit))
    if lead == 0:
      s = s[None]
    out.append(s.astype(jnp.float32))
  if len(kinds) != 1:
    raise ValueError(f"k_dequant_scales and v_dequant_scales must have the same kind, got "
                     f"shapes {tuple(k_dequant_scales.shape)} and {tuple(v_dequant_scales.shape)}")
  (kind, unit), = kinds
  return kind, unit, out[0], out[1]


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, *,
                           layout="vllm", scale=None, kv_cache_dtype="auto", k_scale=None,
                           v_scale=None, k_dequant_scales=None, v_dequant_scales=None,
                           alibi_slopes=None, logits_soft_cap=None, sliding_window=None,
                           asm_layout=False, kv_layout="NHD", layer=None,
                           backend: str = "auto", lowering: str = "auto"):
  """Decode attention over a paged cache (vLLM ``paged_attention_v1`` semantics).

  Args:
    query: [num_seqs, Hq, D] float; Hq a multiple of the cache's kv heads Hkv.
    key_cache, value_cache: one layer's caches in ``layout`` (``vllm``, ``asm``, ``flash``,
      ``hnd``; ``packed``: the one K|V tensor as key_cache, value_cache None, stored as
      ``kv_layout``); with ``layer`` given, a leading num_layers dim. ``max``: Mojo MAX's
      collection ``[nb, 2, L, bs, H, D]`` as key_cache (value_cache None, ``layer``
      required; plain or FP8 per-tensor / per-head).
    block_tables: int [num_seqs, W]; seq_lens: int [num_seqs], at most W * block_size.
    scale: logit scale (default D ** -0.5).
    kv_cache_dtype, k_scale, v_scale: ``"auto"`` (cache in a float dtype) or an FP8 name
      with per-tensor ([1]) or per-head ([Hkv]) scales.
    k_dequant_scales, v_dequant_scales: per-token or per-block scales of an FP8 / INT8
      cache, in AITER's shapes: ``[Hkv, num_blocks * bs]`` / ``[Hkv, units]``, or with
      ``asm_layout`` ``[num_blocks, Hkv, bs]`` / ``[units, Hkv]`` (a unit is
      ``num_blocks * bs / units`` slots, a multiple of bs). Non-asm shapes are transposed
      (a copy of the scales, not of the cache).
    alibi_slopes: float [Hq] or None; logits_soft_cap: float (0 / None: off);
    sliding_window: int W (0 / None: off), keeps the last W positions.
    layer: None or an int (may be traced; out of range under jit: zeros).
    lowering: the kernel's lowering (:func:`jkv.backend.lowering`): ``"mosaic"`` runs the
      Mosaic GPU kernel (flash / hnd / packed caches of 8+ token pages, bf16 / fp16
      queries, plain or FP8 per-tensor / per-head caches; FP8 vllm caches of 16-token
      pages and asm ones of 16 or more; no ALiBi, soft cap or window) and raises
      ``NotImplementedError`` for other cases; ``"auto"`` follows
      ``$JKV_LOWERING``, else picks Mosaic on Hopper where it takes the case.
  Returns [num_seqs, Hq, D] in the query's dtype.

  >>> import jax.numpy as jnp, jkv
  >>> key_cache = jnp.zeros((4, 2, 8, 16, 8), jnp.bfloat16)   # vllm [nb, H, D / x, bs, x]
  >>> value_cache = jnp.ones((4, 2, 64, 16), jnp.bfloat16)    # [nb, H, D, bs]
  >>> query = jnp.ones((2, 4, 64), jnp.bfloat16)              # [B, Hq, D]: GQA, 2 per kv head
  >>> out = jkv.paged_attention_decode(query, key_cache, value_cache,
  ...                                  jnp.array([[0, 1], [2, 3]]), jnp.array([20, 7]))
  >>> out.shape, round(float(out[0, 0, 0]), 3)    # uniform weights over values of 1
  ((2, 4, 64), 1.0)
  """
  collection = layout == layout_lib.MAX
  lead = cache_lead(layout, layer, "read")
  fmt, key_cache, value_cache, k_scale, v_scale, (num_blocks, block_size, num_heads,
                                                  head_size) = read_format(
      layout, kv_layout, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale,
      k_dequant_scales, v_dequant_scales, asm_layout, lead)
  query = check_query(query, num_heads, head_size)
  block_tables, seq_lens = check_tables(block_tables, seq_lens, num_blocks, block_size)
  scale, alibi_slopes, logits_soft_cap, sliding_window = check_options(
      query.shape[1], head_size, scale, alibi_slopes, logits_soft_cap, sliding_window)
  if collection:
    layer, seq_lens = layer_and_lengths(layer, layout_lib.max_dims(key_cache.shape)[1],
                                        seq_lens)
  elif lead == 0:
    key_cache = key_cache[None]
    value_cache = None if value_cache is None else value_cache[None]
    layer = jnp.zeros((), jnp.int32)
  else:
    layer, seq_lens = layer_and_lengths(layer, key_cache.shape[0], seq_lens)
  return decode_attention(
      fmt, query, key_cache, value_cache, k_scale, v_scale, None, None, layer, block_tables,
      seq_lens, num_blocks=num_blocks, block_size=block_size, num_heads=num_heads,
      head_size=head_size, scale=scale, alibi_slopes=alibi_slopes,
      logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, backend=backend,
      lowering=lowering)


def max_token_format(kv_layout, collection, value_cache, scales, v_scales):
  """:func:`read_format` of a per-token quantized MAX collection ``[nb, 2, L, bs, H, D]``
  (FP8 / INT8) whose scale collection ``[nb, 2, L, bs, H, G]`` comes as the K scales
  (V: None); the scale collection goes back as both k and v scales."""
  num_blocks, _, block_size, num_heads, head_size = layout_lib.max_dims(collection.shape)
  check_caches(layout_lib.MAX, kv_layout, collection, value_cache, 0, num_heads, head_size)
  quant.check_scaled_dtype("kv_cache", collection.dtype)
  scales = quant_write_ops.check_max_scales("k_dequant_scales", scales, collection.shape,
                                            "v_dequant_scales", v_scales)
  fmt = CacheFormat(layout_lib.MAX, "NHD", "token", 0, scales.shape[5])
  return (fmt, collection, None, scales, scales, (num_blocks, block_size, num_heads, head_size))


def _check_dequant_format(kv_cache_dtype, k_scale, v_scale, cache_dtype, cache_name):
  """A read through per-token / per-block dequant scales takes no per-tensor scale, and a
  ``kv_cache_dtype`` other than "auto" must name the cache's dtype (both were ignored)."""
  if k_scale is not None or v_scale is not None:
    raise ValueError("k_scale / v_scale are per-tensor FP8 scales: pass them or "
                     "k_dequant_scales / v_dequant_scales, not both")
  if kv_cache_dtype == "int8":
    if np.dtype(cache_dtype) != np.dtype(jnp.int8):
      raise TypeError(f"{cache_name} must have dtype int8 for kv_cache_dtype='int8', got "
                      f"{np.dtype(cache_dtype).name}")
  elif kv_cache_dtype != "auto":
    resolve_quant(kv_cache_dtype, cache_dtype, cache_name)


def read_format(layout, kv_layout, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale,
                k_dequant_scales, v_dequant_scales, asm_layout: bool, lead: int):
  """The arguments of a cache read (decode or ragged attention) validated: returns
  ``(fmt, key_cache, value_cache, k_scale, v_scale, (num_blocks, block_size, num_heads,
  head_size))`` with the scales as :class:`CacheFormat` ``fmt.quant`` wants them (float32
  [H] per tensor; [L, nb, H, bs] per token / [L, units, H] per block with a leading layer
  dim); ``lead`` = 1: the caches carry a leading num_layers dim."""
  packed = layout in ("packed", layout_lib.MAX)
  key_cache = as_cache("kv_cache" if packed else "key_cache", key_cache)
  value_cache = as_cache("value_cache", value_cache)
  if k_dequant_scales is not None or v_dequant_scales is not None:
    _check_dequant_format(kv_cache_dtype, k_scale, v_scale, key_cache.dtype,
                          "kv_cache" if packed else "key_cache")
  if layout == layout_lib.MAX:
    num_heads, head_size = layout_lib.max_dims(key_cache.shape)[3:]
    if k_dequant_scales is not None or v_dequant_scales is not None:
      return max_token_format(kv_layout, key_cache, value_cache, k_dequant_scales,
                              v_dequant_scales)
  else:
    check_rank(layout, key_cache, lead)
    num_heads, head_size = layout_lib.heads_of(layout, key_cache.shape[lead:], kv_layout)
  num_blocks, block_size, _, _ = check_caches(layout, kv_layout, key_cache, value_cache, lead,
                                              num_heads, head_size)
  cache_name = "kv_cache" if packed else "key_cache"
  if (k_dequant_scales is None) != (v_dequant_scales is None):
    raise ValueError("pass both k_dequant_scales and v_dequant_scales, or neither")
  unit = 0
  if k_dequant_scales is not None:
    quant.check_scaled_dtype(cache_name, key_cache.dtype)
    kind, unit, k_scale, v_scale = dequant_scales(
        k_dequant_scales, v_dequant_scales, asm_layout, lead, num_blocks, block_size, num_heads)
    for name, scales in (("k_dequant_scales", k_dequant_scales),
                         ("v_dequant_scales", v_dequant_scales)):
      if tuple(jnp.shape(scales)[:lead]) != tuple(key_cache.shape[:lead]):
        raise ValueError(f"{name} must have the cache's {key_cache.shape[0]} layers as its "
                         f"leading dim, got shape {tuple(jnp.shape(scales))}")
  else:
    if kv_cache_dtype == "int8":
      raise ValueError("an int8 cache needs k_dequant_scales / v_dequant_scales (per token "
                       "or per block)")
    quant.check_kv_cache_dtype(kv_cache_dtype)
    fp8 = resolve_quant(kv_cache_dtype, key_cache.dtype, cache_name)
    kind = "none" if fp8 is None else "tensor"
    if fp8 is not None:
      errors.check_scales_positive("k_scale", k_scale, allow_zero=True)
      errors.check_scales_positive("v_scale", v_scale, allow_zero=True)
    k_scale = jnp.broadcast_to(quant.normalize_scale(k_scale, num_heads, "k_scale"), (num_heads,))
    v_scale = jnp.broadcast_to(quant.normalize_scale(v_scale, num_heads, "v_scale"), (num_heads,))
  fmt = CacheFormat(layout, kv_layout, kind, unit)
  return (fmt, key_cache, value_cache, k_scale, v_scale,
          (num_blocks, block_size, num_heads, head_size))
