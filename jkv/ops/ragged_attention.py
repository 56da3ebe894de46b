"""Ragged paged attention: chunked prefill and decode of many sequences in one op.

``ragged_paged_attention`` is the array-level op (vLLM ``unified_attention`` semantics over
every jkv layout and cache format that :func:`jkv.paged_attention_decode` reads, FP4 aside);
``ragged_paged_attention_with_write`` writes the step's new K/V first (the layout's write
op, bit-exact with it) and attends over them; ``PagedKVCache.attend_ragged`` and
``PagedKVCache.write_and_attend_ragged`` call :func:`ragged_attention` with the cache's own
arrays. Semantics: :mod:`jkv.reference.ragged_attention`; kernel:
:mod:`pallas_kernels.ragged_attention`. Block sizes that are not powers of two read
through the reference.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import errors, layout as layout_lib, partitioning
from jkv.ops.attention import (MOSAIC_ATTENTION_FIRST, check_options, check_query,
                               check_tables, dequant_scales, kernel_geometry,
                               layer_and_lengths, read_format)
from jkv.ops.quant_write import kernel_reads_format, write_quant_kv
from jkv.ops.write import cache_lead, write_kv
from jkv.reference import ragged_attention as reference
from jkv.formats import CacheFormat
from pallas_kernels import lowering as lowering_lib, mosaic_attention, mosaic_ragged
from pallas_kernels import ragged_attention as kernels

# The cache formats (``quant``) whose prefill tiles ``lowering="auto"`` runs on Mosaic GPU on
# a Hopper GPU (where its kernel takes the case): the measured faster lowering there
# (benchmarks/RESULTS.md, ragged: H200, 4 x 2048 over 6144 cached, bf16 1960 us against
# 3160 on Triton).
MOSAIC_PREFILL_FIRST = ("none", "tensor")
# The cache formats whose short items (decodes) ``lowering="auto"`` runs on the Mosaic GPU
# decode kernel on Hopper: those :func:`jkv.paged_attention_decode` runs there.
MOSAIC_DECODE_FIRST = MOSAIC_ATTENTION_FIRST


def check_ragged(query, block_tables, kv_lens, cu_q_lens, num_seqs, num_kv_heads: int,
                 head_size: int, num_blocks: int, block_size: int):
  """Validated ``(query, block_tables, kv_lens, cu_q_lens, num_seqs)`` (int32 arrays).

  Eagerly (concrete values): ``cu_q_lens[0] == 0``, non-decreasing over the first
  ``num_seqs + 1`` entries, ``cu_q_lens[num_seqs] <= T``, ``q_len <= kv_len`` for those
  sequences, and what :func:`jkv.ops.attention.check_tables` checks of ``kv_lens`` (values
  as given: int64 ones would wrap in int32). Under jit such values are not checked: nothing
  is read out of bounds (rows before position 0 see no key), but what the rows read is
  unspecified (the kernel and the reference may differ)."""
  query = check_query(query, num_kv_heads, head_size, rows="num_tokens")
  block_tables, kv_lens = check_tables(block_tables, kv_lens, num_blocks, block_size,
                                       lens_name="kv_lens")
  cu_q_lens = errors.int_array("cu_q_lens", cu_q_lens)
  errors.check_ndim("cu_q_lens", cu_q_lens, 1, "[num_seqs + 1]")
  errors.check_int("cu_q_lens", cu_q_lens)
  num_slots = block_tables.shape[0]
  errors.check_shape("cu_q_lens", cu_q_lens, (num_slots + 1,))
  if num_seqs is None:
    num_seqs = num_slots
  errors.check_int_scalar("num_seqs", num_seqs)
  if errors.is_concrete(num_seqs) and not 0 <= int(num_seqs) <= num_slots:   # (as given)
    raise ValueError(f"num_seqs = {int(num_seqs)} is out of range (valid: 0..{num_slots}, "
                     f"the rows of block_tables)")
  num_seqs = jnp.asarray(num_seqs, jnp.int32)
  if errors.is_concrete(cu_q_lens) and errors.is_concrete(num_seqs):
    cu = np.asarray(cu_q_lens)[:int(num_seqs) + 1]
    if cu[0] != 0:
      raise ValueError(f"cu_q_lens[0] must be 0, got {int(cu[0])}")
    down = np.nonzero(np.diff(cu) < 0)[0]
    if down.size:
      i = int(down[0])
      raise ValueError(f"cu_q_lens must be non-decreasing: cu_q_lens[{i + 1}] = "
                       f"{int(cu[i + 1])} < cu_q_lens[{i}] = {int(cu[i])}")
    if cu[-1] > query.shape[0]:
      raise ValueError(f"cu_q_lens[num_seqs] = {int(cu[-1])} exceeds the {query.shape[0]} "
                       f"query rows")
    if errors.is_concrete(kv_lens):
      lens = np.asarray(kv_lens)[:int(num_seqs)]
      bad = np.nonzero(np.diff(cu) > lens)[0]
      if bad.size:
        i = int(bad[0])
        raise ValueError(f"sequence {i} has {int(cu[i + 1] - cu[i])} query rows but kv_lens"
                         f"[{i}] = {int(lens[i])}: kv_lens counts the cached and the new "
                         f"tokens, so it is at least the query length")
  return query, block_tables, kv_lens, cu_q_lens.astype(jnp.int32), num_seqs


def check_sinks(sinks, num_q_heads: int):
  if sinks is None:
    return None
  sinks = jnp.asarray(sinks)
  errors.check_float("sinks", sinks)
  errors.check_shape("sinks", sinks, (num_q_heads,))
  return sinks.astype(jnp.float32)


def ragged_attention(fmt: CacheFormat, query, key_cache, value_cache, k_scale, v_scale, layer,
                     block_tables, kv_lens, cu_q_lens, num_seqs, *, num_blocks: int,
                     block_size: int, num_heads: int, head_size: int, scale: float,
                     alibi_slopes, logits_soft_cap, sliding_window, sinks, backend: str,
                     k_global_scale=None, v_global_scale=None, lowering: str = "auto"):
  """Dispatch of validated arguments (caches and token / block scales with a leading
  num_layers dim, or the MAX collection [nb, 2, L, bs, H, D] as key_cache; ``layer`` an
  int32 scalar, k/v_scale [H] for ``tensor``). FP4 caches
  (``mxfp4`` / ``nvfp4``, NVFP4 with its global scales) read through the reference.
  ``lowering`` (:func:`jkv.backend.lowering`), per kind of work item: ``"mosaic"`` runs the
  prefill tiles and the short items (decodes) on their Mosaic GPU kernels where those take
  the case, the rest on Triton (``NotImplementedError`` when neither takes it)."""
  chosen = backend_lib.resolve(   # some MAX scale groups: the reference
      backend, kernel_supported=kernels.supports(block_size) and fmt.quant in (
          "none", "tensor", "token", "block")
      and kernel_reads_format(fmt, head_size))
  if query.shape[0] == 0 or block_tables.shape[0] == 0:   # no rows, or every row padding
    backend_lib.lowering(lowering, mosaic_supported=False, kernel=False)   # checks it
    return jnp.zeros(query.shape, query.dtype)
  options = dict(scale=scale, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
                 sliding_window=sliding_window, sinks=sinks)
  if chosen == "reference":
    backend_lib.lowering(lowering, mosaic_supported=False, kernel=False)   # checks it
    return reference.ragged_paged_attention(
        fmt, query, key_cache, value_cache, k_scale, v_scale, layer, block_tables, kv_lens,
        cu_q_lens, num_seqs, num_blocks=num_blocks, block_size=block_size,
        num_heads=num_heads, head_size=head_size, k_global_scale=k_global_scale,
        v_global_scale=v_global_scale, **options)
  key_plane, value_plane, rows = kernel_geometry(fmt, key_cache, block_size, num_heads,
                                                 head_size)
  group = query.shape[1] // num_heads
  flags = dict(alibi=alibi_slopes is not None, soft_cap=logits_soft_cap is not None,
               window=sliding_window is not None)
  mosaic_here = (fmt.layout != layout_lib.MAX
                 and not (chosen == "interpret" and partitioning.wraps_kernels()))
  prefill_ok = mosaic_here and mosaic_ragged.supported(
      key_plane, value_plane, query.dtype, key_cache.dtype, group, block_tables.shape[1],
      scale=scale, quant=fmt.quant, sinks=sinks is not None, **flags)
  decode_ok = mosaic_here and mosaic_attention.supported(   # sinks join in the combine
      key_plane, value_plane, query.dtype, key_cache.dtype, group, quant=fmt.quant, **flags)
  if lowering == "mosaic" and not (prefill_ok or decode_ok):
    backend_lib.lowering(lowering, mosaic_supported=False)   # raises NotImplementedError
  triton_ok = lowering_lib.triton_available()
  prefill_lowering, decode_lowering = (
      backend_lib.lowering("auto" if lowering == "mosaic" and not ok else lowering,
                           mosaic_supported=ok, mosaic_first=first and backend_lib.hopper(),
                           triton_available=triton_ok)
      for ok, first in ((prefill_ok, fmt.quant in MOSAIC_PREFILL_FIRST),
                        (decode_ok, fmt.quant in MOSAIC_DECODE_FIRST)))
  return kernels.ragged_paged_attention(
      fmt, query, key_cache, value_cache, k_scale, v_scale, layer, block_tables, kv_lens,
      cu_q_lens, num_seqs, key_plane=key_plane, value_plane=value_plane,
      num_blocks=num_blocks, interpret=chosen == "interpret", prefill_lowering=prefill_lowering,
      decode_lowering=decode_lowering, **rows, **options)


def _prepare(query, key_cache, value_cache, block_tables, kv_lens, cu_q_lens, num_seqs, layout,
             kv_layout, scale, kv_cache_dtype, k_scale, v_scale, k_dequant_scales,
             v_dequant_scales, asm_layout, sliding_window, logits_soft_cap, alibi_slopes, sinks,
             layer):
  """The validated arguments of :func:`ragged_paged_attention` as :func:`ragged_attention`
  takes them (caches with a leading layer dim, or the MAX collection)."""
  collection = layout == layout_lib.MAX
  lead = cache_lead(layout, layer, "read")
  fmt, key_cache, value_cache, k_scale, v_scale, (num_blocks, block_size, num_heads,
                                                  head_size) = read_format(
      layout, kv_layout, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale,
      k_dequant_scales, v_dequant_scales, asm_layout, lead)
  query, block_tables, kv_lens, cu_q_lens, num_seqs = check_ragged(
      query, block_tables, kv_lens, cu_q_lens, num_seqs, num_heads, head_size, num_blocks,
      block_size)
  scale, alibi_slopes, logits_soft_cap, sliding_window = check_options(
      query.shape[1], head_size, scale, alibi_slopes, logits_soft_cap, sliding_window)
  sinks = check_sinks(sinks, query.shape[1])
  if collection:
    layer, kv_lens = layer_and_lengths(layer, layout_lib.max_dims(key_cache.shape)[1],
                                       kv_lens)
  elif lead == 0:
    key_cache = key_cache[None]
    value_cache = None if value_cache is None else value_cache[None]
    layer = jnp.zeros((), jnp.int32)
  else:
    layer, kv_lens = layer_and_lengths(layer, key_cache.shape[0], kv_lens)
  args = (fmt, query, key_cache, value_cache, k_scale, v_scale, layer, block_tables, kv_lens,
          cu_q_lens, num_seqs)
  return args, dict(num_blocks=num_blocks, block_size=block_size, num_heads=num_heads,
                    head_size=head_size, scale=scale, alibi_slopes=alibi_slopes,
                    logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                    sinks=sinks)


def ragged_paged_attention(query, key_cache, value_cache, block_tables, kv_lens, cu_q_lens, *,
                           num_seqs=None, layout="flash", kv_layout="NHD", scale=None,
                           kv_cache_dtype="auto", k_scale=None, v_scale=None,
                           k_dequant_scales=None, v_dequant_scales=None, asm_layout=False,
                           sliding_window=None, logits_soft_cap=None, alibi_slopes=None,
                           sinks=None, layer=None, backend: str = "auto",
                           lowering: str = "auto"):
  """Attention of a ragged batch of query tokens over a paged cache: chunked prefill and
  decode of many sequences in one call (vLLM ``unified_attention`` semantics).

  Args:
    query: [T, Hq, D] float, the new tokens of all sequences, sequence after sequence.
    key_cache, value_cache: one layer's caches in ``layout`` (as
      :func:`jkv.paged_attention_decode`; ``packed``: value_cache None); with ``layer``, a
      leading num_layers dim. ``max``: the MAX collection ``[nb, 2, L, bs, H, D]`` as
      key_cache (value_cache None, ``layer`` required).
    block_tables: int [S, W]; kv_lens: int [S], each sequence's length after this step
      (cached + new), at most W * block_size.
    cu_q_lens: int [S + 1] (vLLM ``query_start_loc``): sequence s owns query rows
      ``cu_q_lens[s]:cu_q_lens[s + 1]`` (0 rows allowed); its row j sits at position
      ``kv_lens[s] - q_len + j`` and sees the keys at positions up to its own.
    num_seqs: int scalar (may be traced; default S): sequences past it own no rows; rows
      at or past ``cu_q_lens[num_seqs]`` are padding and read exactly 0.
    scale, kv_cache_dtype, k_scale, v_scale, k_dequant_scales, v_dequant_scales,
      asm_layout, alibi_slopes (slope * (k - p)), logits_soft_cap, sliding_window: as
      :func:`jkv.paged_attention_decode` (the window keeps keys ``p - W + 1..p``).
    sinks: float [Hq] or None: attention sinks, ``exp(sink_h)`` joins each row's softmax
      denominator (gpt-oss).
    lowering: ``"auto"``, ``"triton"`` or ``"mosaic"`` (:func:`jkv.backend.lowering`):
      ``"mosaic"`` runs the prefill tiles (flash / hnd / packed caches of the query's
      dtype, or FP8 with tensor scales at head size 128; no ALiBi, soft cap, window or
      sinks) and the short items (decodes; the same caches, sinks allowed) on their
      Mosaic GPU kernels, the rest on Triton.
  Returns [T, Hq, D] in the query's dtype.

  >>> import jax.numpy as jnp, jkv
  >>> key_cache = value_cache = jnp.ones((4, 16, 2, 64), jnp.float32)     # flash layout
  >>> query = jnp.ones((5, 4, 64), jnp.float32)     # sequence 0: 3 new tokens, 1: 2
  >>> out = jkv.ragged_paged_attention(query, key_cache, value_cache,
  ...     jnp.array([[0, 1], [2, 3]]), jnp.array([20, 7]), jnp.array([0, 3, 5]))
  >>> out.shape
  (5, 4, 64)
  """
  args, options = _prepare(query, key_cache, value_cache, block_tables, kv_lens, cu_q_lens,
                           num_seqs, layout, kv_layout, scale, kv_cache_dtype, k_scale,
                           v_scale, k_dequant_scales, v_dequant_scales, asm_layout,
                           sliding_window, logits_soft_cap, alibi_slopes, sinks, layer)
  return ragged_attention(*args, **options, backend=backend, lowering=lowering)


def ragged_paged_attention_with_write(query, key, value, key_cache, value_cache, slot_mapping,
                                      block_tables, kv_lens, cu_q_lens, *, num_seqs=None,
                                      layout="flash", kv_layout="NHD", scale=None,
                                      kv_cache_dtype="auto", k_scale=None, v_scale=None,
                                      k_dequant_scales=None, v_dequant_scales=None,
                                      asm_layout=False, sliding_window=None,
                                      logits_soft_cap=None, alibi_slopes=None, sinks=None,
                                      layer=None, backend: str = "auto",
                                      lowering: str = "auto"):
  """Writes this step's key / value [T, Hkv, D] at ``slot_mapping`` [T] (< 0: padding),
  then :func:`ragged_paged_attention` over the updated caches (``lowering``: its kernel's).

  The write is the layout's write op (``reshape_and_cache(_flash / _packed)`` semantics,
  per-token / per-block quantization with ``k_dequant_scales``), bit-exact with it; both
  run in the caller's jit, the caches aliased (donated: updated in place). Two kernel
  launches, the write first: every program of the attention sees every new entry.
  Returns ``(out, key_cache, value_cache)`` (value_cache None for ``packed``), and the
  updated ``k_dequant_scales, v_dequant_scales`` after them when those are given.

  >>> import jax.numpy as jnp, jkv
  >>> key_cache = value_cache = jnp.zeros((4, 16, 2, 64), jnp.float32)   # flash layout
  >>> query = jnp.ones((3, 4, 64))                  # sequence 0: 1 new token, 1: 2
  >>> key = value = jnp.ones((3, 2, 64))
  >>> out, key_cache, value_cache = jkv.ragged_paged_attention_with_write(
  ...     query, key, value, key_cache, value_cache, jnp.array([4, 32, 33]),
  ...     jnp.array([[0, 1], [2, 3]]), jnp.array([5, 2]), jnp.array([0, 1, 3]))
  >>> out.shape, float(key_cache[2, 1, 0, 0])       # slot 33: block 2, offset 1
  ((3, 4, 64), 1.0)
  """
  # The read's checks first (scales, cache dtype, rank with ``layer``): the write would
  # report a mistake of the read's arguments as one of its own.
  *_, (num_blocks, block_size, num_heads, _) = read_format(
      layout, kv_layout, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale,
      k_dequant_scales, v_dequant_scales, asm_layout, cache_lead(layout, layer, "read"))
  if jnp.ndim(key) >= 1 and jnp.ndim(query) >= 1 and jnp.shape(key)[0] != jnp.shape(query)[0]:
    raise ValueError(f"key and value must have one row per query row (the step's new "
                     f"tokens): query has {jnp.shape(query)[0]} rows, key "
                     f"{jnp.shape(key)[0]}")
  if layout == layout_lib.MAX and k_dequant_scales is not None:   # the scale collection
    key_cache, value_cache, k_dequant_scales, v_dequant_scales = write_quant_kv(
        key, value, key_cache, value_cache, k_dequant_scales, v_dequant_scales, slot_mapping,
        granularity="token", layout=layout, kv_layout=kv_layout, layer=layer, backend=backend)
    extra = (k_dequant_scales, v_dequant_scales)
  elif k_dequant_scales is not None and v_dequant_scales is not None:
    # The granularity and scale block as decode attention reads them off AITER's shapes.
    granularity, unit, _, _ = dequant_scales(k_dequant_scales, v_dequant_scales, asm_layout,
                                              0 if layer is None else 1, num_blocks,
                                              block_size, num_heads)
    key_cache, value_cache, k_dequant_scales, v_dequant_scales = write_quant_kv(
        key, value, key_cache, value_cache, k_dequant_scales, v_dequant_scales, slot_mapping,
        granularity=granularity, layout=layout, kv_layout=kv_layout,
        scales_block_major=asm_layout,
        tokens_per_scale_block=unit if granularity == "block" else None,
        layer=layer, backend=backend)
    extra = (k_dequant_scales, v_dequant_scales)
  else:
    caches = write_kv(key, value, key_cache, value_cache, slot_mapping, layout=layout,
                      kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                      v_scale=v_scale, layer=layer, backend=backend)
    key_cache, value_cache = caches[0], caches[1] if len(caches) == 2 else None
    extra = ()
  out = ragged_paged_attention(
      query, key_cache, value_cache, block_tables, kv_lens, cu_q_lens, num_seqs=num_seqs,
      layout=layout, kv_layout=kv_layout, scale=scale, kv_cache_dtype=kv_cache_dtype,
      k_scale=k_scale, v_scale=v_scale, k_dequant_scales=k_dequant_scales,
      v_dequant_scales=v_dequant_scales, asm_layout=asm_layout, sliding_window=sliding_window,
      logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks, layer=layer,
      backend=backend, lowering=lowering)
  return (out, key_cache, value_cache) + extra
