"""Immutable cache pytrees: :class:`PagedKVCache` and :class:`ContiguousKVCache`.

Arrays are pytree data; layout, sizes and dtypes are static metadata. Methods return
new caches; inside ``jax.jit(..., donate_argnums=...)`` the writes happen in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jkv import errors, formats, fp4, layout as layout_lib, pytree
from jkv import quant as quant_lib
from jkv.ops import attention as attention_ops
from jkv.ops import blocks as blocks_ops
from jkv.ops import contiguous as contiguous_ops
from jkv.ops import quant_write as quant_write_ops
from jkv.ops import ragged_attention as ragged_ops
from jkv.ops import write as write_ops
from jkv.reference import attention as attention_reference



QUANT_MODES = ("tensor", "token", "block", "mxfp4", "nvfp4")


@pytree.dataclass
class PagedKVCache:
  """A paged KV cache in one of the layouts of :mod:`jkv.layout`, optionally quantized.

  Quantization modes (``quant``, static):

  ==========  ====================  ===============================================
  quant       kv_cache_dtype        k_scale / v_scale (float32 unless noted)
  ==========  ====================  ===============================================
  ``tensor``  auto or an FP8 name   [1] or [num_heads] (per tensor / per head)
  ``token``   FP8 name or ``int8``  [L, num_blocks, H, block_size]: one per (token, head)
  ``block``   FP8 name or ``int8``  [L, units, H]: one per (scale block, head); a scale
                                    block is ``scale_block_tokens`` slots (default
                                    block_size; AITER's asm_pa uses 128 / 256)
  ``mxfp4``   auto (storage fixed)  float8_e8m0fnu [L, num_blocks, H, block_size, D/32]
  ``nvfp4``   auto (storage fixed)  float8_e4m3fn [L, num_blocks, H, block_size, D/16],
                                    and k/v_global_scale float32 [1]
  ==========  ====================  ===============================================

  FP4 modes store K and V as uint8 [L, num_blocks, H, block_size, D/2] (layout
  ``hnd`` of packed E2M1 pairs, :mod:`jkv.fp4`), written and read through the jnp
  reference (XLA; no Pallas kernel: ``backend="pallas"`` raises). ``write`` quantizes as
  it writes (scales updated in place, the rest of the cache untouched); ``gather`` returns
  dequantized K/V. Semantics: :mod:`jkv.reference.quant_write`, :mod:`jkv.fp4`.

  Layout ``"max"`` (Mojo MAX's collection, :mod:`jkv.layout`): key_cache is the one tensor
  ``[num_blocks, 2, num_layers, block_size, H, D]`` holding every layer of a block (value_cache
  None, blocks on axis 0); quant ``tensor`` (plain or FP8 per tensor / per head) or
  ``token`` (FP8 / INT8): then k_scale is one scale collection ``[num_blocks, 2, num_layers,
  block_size, H, D / G]`` (v_scale None), a scale per (token, head, group of G head-dim
  elements), G being MAX's ``quantization_granularity`` (``create``'s keyword; default D).

  Fields:
    key_cache: [num_layers, *key shape] (``packed``: the one K|V tensor; ``max``: the
      collection).
    value_cache: [num_layers, *value shape], or None for ``packed`` and ``max``.
    k_scale, v_scale: the scale arrays above.
    k_global_scale, v_global_scale: float32 [1] for nvfp4, else None.
  Static: layout, kv_layout (storage of ``packed``), kv_cache_dtype, dtype (what
  ``gather`` returns), quant, scale_block_tokens. Sizes are read off the arrays'
  shapes; the leading num_layers axis is always there (1 for a single layer).
  """
  key_cache: jax.Array
  value_cache: jax.Array | None
  k_scale: jax.Array
  v_scale: jax.Array | None
  k_global_scale: jax.Array | None
  v_global_scale: jax.Array | None
  layout: str = pytree.static()
  kv_layout: str = pytree.static()
  kv_cache_dtype: str = pytree.static()
  dtype: np.dtype = pytree.static()
  quant: str = pytree.static(default="tensor")
  scale_block_tokens: int = pytree.static(default=0)

  @classmethod
  def create(cls, num_blocks: int, block_size: int, num_heads: int, head_size: int, *,
             num_layers: int = 1, layout: str = "flash", kv_layout: str = "NHD",
             dtype=jnp.bfloat16, kv_cache_dtype: str = "auto", k_scale=1.0, v_scale=1.0,
             quant: str = "tensor", scale_block_tokens: int | None = None,
             k_global_scale=1.0, v_global_scale=1.0,
             quantization_granularity: int | None = None):
    """A zero-filled cache. ``dtype`` is the model's K/V dtype (stored as is for
    ``kv_cache_dtype="auto"``). ``k_scale`` / ``v_scale`` are the per-tensor scales of
    ``quant="tensor"``; the other modes start with zero scales (E8M0 2**-127 for mxfp4)
    and set them as tokens arrive (a block scale of 0 means a block's first write sets its
    scale whatever the offset it starts at). ``k_global_scale`` /
    ``v_global_scale``: nvfp4's per-tensor scales. ``layout="max"``: one collection
    ``[num_blocks, 2, num_layers, block_size, H, D]``, quant ``tensor`` or ``token``; with
    ``token``, ``quantization_granularity`` G (dividing D; default D) head-dim elements
    share a scale (MAX's name), in a scale collection ``[num_blocks, 2, num_layers,
    block_size, H, D / G]``."""
    if layout not in layout_lib.LAYOUTS + (layout_lib.MAX,):
      raise ValueError(f"layout must be one of {layout_lib.LAYOUTS + (layout_lib.MAX,)}, got "
                       f"{layout!r}")
    collection = layout == layout_lib.MAX
    if collection:
      layout_lib.check_kv_layout(kv_layout)
      if kv_layout != "NHD" or quant not in ("tensor", "token"):
        raise ValueError(f"layout 'max' stores NHD pages, plain or FP8 per tensor / per head "
                         f"(quant 'tensor') or FP8 / INT8 per token (quant 'token'): pass "
                         f"kv_layout='NHD' and one of those (got {kv_layout!r}, {quant!r})")
    else:
      layout_lib.check_layout(layout, kv_layout)
    if quant not in QUANT_MODES:
      raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    if quantization_granularity is not None and not (collection and quant == "token"):
      raise ValueError("quantization_granularity is a per-token quantized MAX collection's "
                       "(layout='max', quant='token')")
    if scale_block_tokens and quant != "block":   # (0: none, as stored)
      raise ValueError(f"scale_block_tokens ({scale_block_tokens}) is for quant='block', got "
                       f"quant={quant!r}")
    for name, size in (("num_blocks", num_blocks), ("block_size", block_size),
                       ("num_heads", num_heads), ("head_size", head_size),
                       ("num_layers", num_layers)):
      errors.check_size(name, size)
    check_float_dtype("dtype", dtype)
    lead = (num_layers,)
    if quant in fp4.FORMATS:
      if kv_cache_dtype != "auto" or layout != "hnd":
        raise ValueError(f"quant={quant!r} stores packed E2M1 in layout 'hnd'; pass "
                         f"layout='hnd' and kv_cache_dtype='auto' (got {layout!r}, "
                         f"{kv_cache_dtype!r})")
      data, scales = quant_write_ops.fp4_cache_shapes(num_blocks, block_size, num_heads,
                                                      head_size, quant)
      scale_dtype = fp4.SCALE_DTYPE[quant]
      global_scales = [None, None]
      if quant == "nvfp4":
        global_scales = [quant_lib.normalize_scale(g, 1, name) for g, name in
                         ((k_global_scale, "k_global_scale"), (v_global_scale, "v_global_scale"))]
      return cls(key_cache=jnp.zeros(lead + data, jnp.uint8),
                 value_cache=jnp.zeros(lead + data, jnp.uint8),
                 k_scale=jnp.zeros(lead + scales, scale_dtype),
                 v_scale=jnp.zeros(lead + scales, scale_dtype),
                 k_global_scale=global_scales[0], v_global_scale=global_scales[1],
                 layout=layout, kv_layout=kv_layout, kv_cache_dtype="auto",
                 dtype=np.dtype(dtype), quant=quant, scale_block_tokens=0)
    if quant == "tensor":
      fp8 = quant_lib.fp8_dtype(kv_cache_dtype)
      storage = np.dtype(fp8 if fp8 is not None else dtype)
    else:
      storage = _scaled_storage(kv_cache_dtype, quant)
    if collection:
      k_shape, v_shape, lead = layout_lib.max_shape(num_blocks, num_layers, block_size,
                                                    num_heads, head_size), None, ()
    else:
      k_shape, v_shape = layout_lib.cache_shapes(layout, num_blocks, block_size, num_heads,
                                                 head_size, storage, kv_layout)
    unit = 0
    if quant == "tensor":
      k_scales = quant_lib.normalize_scale(k_scale, num_heads, "k_scale")
      v_scales = quant_lib.normalize_scale(v_scale, num_heads, "v_scale")
      if quant_lib.fp8_dtype(kv_cache_dtype) is not None:
        errors.check_scales_positive("k_scale", k_scales)
        errors.check_scales_positive("v_scale", v_scales)
    elif quant == "token" and collection:
      group = head_size if quantization_granularity is None else quantization_granularity
      errors.check_size("quantization_granularity", group)
      if head_size % group:
        raise ValueError(f"quantization_granularity {group} must divide head_size {head_size}")
      k_scales = jnp.zeros(k_shape[:5] + (head_size // group,), jnp.float32)
      v_scales = None   # the scale collection holds K and V scales
    elif quant == "token":
      k_scales, v_scales = (jnp.zeros(lead + (num_blocks, num_heads, block_size), jnp.float32)
                            for _ in range(2))   # two buffers: both leaves can be donated
    else:
      unit = scale_block_tokens or block_size
      if unit % block_size or (num_blocks * block_size) % unit:
        raise ValueError(f"scale_block_tokens {unit} must be a multiple of block_size "
                         f"{block_size} that divides the cache's {num_blocks * block_size} slots")
      units = num_blocks * block_size // unit
      k_scales, v_scales = (jnp.zeros(lead + (units, num_heads), jnp.float32) for _ in range(2))
    return cls(
        key_cache=jnp.zeros(lead + k_shape, storage),
        value_cache=None if v_shape is None else jnp.zeros(lead + v_shape, storage),
        k_scale=k_scales, v_scale=v_scales, k_global_scale=None, v_global_scale=None,
        layout=layout, kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype,
        dtype=np.dtype(dtype), quant=quant, scale_block_tokens=unit)

  @property
  def block_axis(self) -> int:
    """The axis of blocks in the block arrays: 1 (after the layers), 0 for ``max``."""
    return 0 if self.layout == layout_lib.MAX else 1

  @property
  def scale_collection(self) -> bool:
    """A per-token quantized MAX collection: ``k_scale`` is its one scale collection
    ``[num_blocks, 2, num_layers, block_size, H, D / G]`` (v_scale None)."""
    return self.layout == layout_lib.MAX and self.quant == "token"

  @property
  def num_layers(self) -> int:
    if self.layout == layout_lib.MAX:
      return layout_lib.max_dims(self.key_cache.shape)[1]
    return self.key_cache.shape[0]

  @property
  def num_blocks(self) -> int:
    return self.key_cache.shape[self.block_axis]

  @property
  def block_size(self) -> int:
    if self.layout == layout_lib.MAX:
      return layout_lib.max_dims(self.key_cache.shape)[2]
    return layout_lib.blocks_of(self.layout, self.key_cache.shape[1:], self.kv_layout)[1]

  @property
  def num_heads(self) -> int:
    if self.layout == layout_lib.MAX:
      return layout_lib.max_dims(self.key_cache.shape)[3]
    return layout_lib.heads_of(self.layout, self.key_cache.shape[1:], self.kv_layout)[0]

  @property
  def head_size(self) -> int:
    if self.layout == layout_lib.MAX:
      return layout_lib.max_dims(self.key_cache.shape)[4]
    size = layout_lib.heads_of(self.layout, self.key_cache.shape[1:], self.kv_layout)[1]
    return 2 * size if self.quant in fp4.FORMATS else size

  @property
  def nbytes(self) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self))

  def replace(self, **changes) -> "PagedKVCache":
    return dataclasses.replace(self, **changes)

  def split_dims(self) -> dict[str, tuple[int | None, int | None]]:
    """{array field: (dim split over dp, dim split over tp)}: where :mod:`jkv.sharding`
    puts this cache on a mesh (None: replicated over that axis)."""
    heads = (self.block_axis
             + layout_lib.heads_dim(self.layout, self.kv_layout))   # FP4: layout hnd
    dims = {"key_cache": (self.block_axis, heads), "value_cache": (self.block_axis, heads),
            "k_global_scale": (None, None), "v_global_scale": (None, None)}
    for name in ("k_scale", "v_scale"):
      if self.scale_collection:   # [nb, 2, L, bs, H, G]
        dims[name] = (0, 4)
      elif self.quant != "tensor":
        dims[name] = (1, 2)
      else:   # [1] (per tensor) or [H] (per head); a 1-head cache's [1] is both
        per_head = getattr(self, name).shape[0] == self.num_heads > 1
        dims[name] = (None, 0 if per_head else None)
    return dims

  def write(self, layer, key, value, slot_mapping, *, backend: str = "auto") -> "PagedKVCache":
    """Writes key/value [T, num_heads, head_size] of ``layer`` (an int, may be traced)
    at ``slot_mapping`` [T] (< 0: padding), quantizing as the cache's mode says."""
    errors.check_layer_given(layer)
    if self.quant in fp4.FORMATS:
      kc, vc, ks, vs = quant_write_ops.reshape_and_cache_fp4(
          key, value, self.key_cache, self.value_cache, self.k_scale, self.v_scale, slot_mapping,
          self.quant, self.k_global_scale, self.v_global_scale, layer=layer, backend=backend)
      return self.replace(key_cache=kc, value_cache=vc, k_scale=ks, v_scale=vs)
    if self.quant in ("token", "block"):
      kc, vc, ks, vs = quant_write_ops.write_quant_kv(
          key, value, self.key_cache, self.value_cache, self.k_scale, self.v_scale, slot_mapping,
          granularity=self.quant, layout=self.layout, kv_layout=self.kv_layout,
          scales_block_major=True, tokens_per_scale_block=self.scale_block_tokens or None,
          layer=layer, backend=backend)
      return self.replace(key_cache=kc, value_cache=vc, k_scale=ks, v_scale=vs)
    caches = write_ops.write_kv(
        key, value, self.key_cache, self.value_cache, slot_mapping, layout=self.layout,
        kv_layout=self.kv_layout, kv_cache_dtype=self.kv_cache_dtype, k_scale=self.k_scale,
        v_scale=self.v_scale, layer=layer, backend=backend)
    if self.value_cache is None:
      return self.replace(key_cache=caches[0])
    return self.replace(key_cache=caches[0], value_cache=caches[1])

  def block_array_names(self) -> list[str]:
    """Names of the arrays indexed by block on axis :attr:`block_axis` (data, and per-token
    / per-block / FP4 scales): what moves when blocks are copied, swapped or offloaded
    (a block of a ``max`` collection: every layer's K and V). A ``block``
    cache whose scale spans several blocks (``scale_block_tokens > block_size``) cannot
    move single blocks: NotImplementedError."""
    if self.quant == "block" and self.scale_block_tokens != self.block_size:
      raise NotImplementedError("moving single blocks of a cache whose block scale spans "
                                f"{self.scale_block_tokens // self.block_size} blocks")
    names = ["key_cache", "value_cache"]
    if self.quant != "tensor":
      names += ["k_scale", "v_scale"]
    return [n for n in names if getattr(self, n) is not None]

  def copy_blocks(self, block_mapping, *, backend: str = "auto") -> "PagedKVCache":
    """``block[dst] = block[src]`` for every (src, dst) pair of ``block_mapping`` [N, 2] in
    every layer, scales included (e.g. the copy-on-write pairs of ``PagePool.append``;
    negative pairs are skipped), in one kernel (:func:`jkv.copy_blocks`)."""
    names = self.block_array_names()
    copied, _ = blocks_ops.copy_blocks([getattr(self, n) for n in names], None, block_mapping,
                                       block_axis=self.block_axis, backend=backend)
    return self.replace(**dict(zip(names, copied)))

  def zero_blocks(self, block_ids) -> "PagedKVCache":
    """Zeros blocks ``block_ids`` (int, any shape; < 0 or past the cache: skipped) in every
    layer, scales included (a zero scale is what ``create`` starts with), e.g. the pages
    ``PagePool.free(..., return_freed=True)`` freed. In place when the cache is donated."""
    block_ids = errors.int_array("block_ids", block_ids)
    errors.check_int("block_ids", block_ids)
    ids = block_ids.reshape(-1).astype(jnp.int32)
    ids = jnp.where(ids >= 0, ids, self.num_blocks)
    index = (slice(None),) * self.block_axis + (ids,)
    zeroed = {n: getattr(self, n).at[index].set(0, mode="drop")
              for n in self.block_array_names()}
    return self.replace(**zeroed)

  def gather(self, layer, block_table, seq_lens):
    """Contiguous, dequantized K and V of a batch: two [batch, max_len, H, D] arrays
    of ``self.dtype``, ``max_len = block_table.shape[1] * block_size``; positions at
    or past ``seq_lens[b]`` are 0. Reads only the blocks in ``block_table``."""
    errors.check_layer_given(layer)
    block_table = errors.int_array("block_table", block_table)
    seq_lens = errors.int_array("seq_lens", seq_lens)
    errors.check_int("block_table", block_table)
    errors.check_int("seq_lens", seq_lens)
    block_table, seq_lens = block_table.astype(jnp.int32), seq_lens.astype(jnp.int32)
    errors.check_ndim("block_table", block_table, 2, "[batch, max_blocks_per_seq]")
    errors.check_shape("seq_lens", seq_lens, block_table.shape[:1])
    errors.check_index("layer", layer, self.num_layers)
    if errors.is_concrete(block_table) and errors.is_concrete(seq_lens):
      table, lens = np.asarray(block_table), np.asarray(seq_lens)
      used = np.arange(table.shape[1])[None, :] * self.block_size < lens[:, None]
      if (used & ((table < 0) | (table >= self.num_blocks))).any():
        raise ValueError(f"block_table has entries outside [0, {self.num_blocks}) that "
                         f"seq_lens would read")
    keys, values = attention_reference.read_tokens(
        self.cache_format(), self.key_cache, self.value_cache, self.k_scale, self.v_scale,
        self.k_global_scale, self.v_global_scale, layer, block_table, self.num_blocks,
        self.block_size, self.num_heads, self.head_size)
    pos = jnp.arange(keys.shape[1], dtype=jnp.int32)
    valid = (pos[None, :] < seq_lens[:, None])[:, :, None, None]
    return (jnp.where(valid, keys.astype(self.dtype), 0),
            jnp.where(valid, values.astype(self.dtype), 0))

  def attend(self, layer, query, block_table, seq_lens, *, scale=None, alibi_slopes=None,
             logits_soft_cap=None, sliding_window=None, backend: str = "auto"):
    """Decode attention of one query token per sequence over this cache's ``layer``.

    query: [batch, Hq, D] (Hq a multiple of num_heads); block_table int [batch, W];
    seq_lens int [batch] (<= W * block_size). Options as
    :func:`jkv.ops.attention.paged_attention_decode`. Returns [batch, Hq, D] in the
    query's dtype. ``layer`` may be traced (out of range under jit: zeros).
    """
    errors.check_layer_given(layer)
    block_table, seq_lens = attention_ops.check_tables(block_table, seq_lens, self.num_blocks,
                                                       self.block_size)
    layer, seq_lens = attention_ops.layer_and_lengths(layer, self.num_layers, seq_lens)
    query = attention_ops.check_query(query, self.num_heads, self.head_size)
    scale, alibi_slopes, logits_soft_cap, sliding_window = attention_ops.check_options(
        query.shape[1], self.head_size, scale, alibi_slopes, logits_soft_cap, sliding_window)
    k_scale, v_scale = self.read_scales()
    return attention_ops.decode_attention(
        self.cache_format(), query, self.key_cache, self.value_cache, k_scale, v_scale,
        self.k_global_scale, self.v_global_scale, layer, block_table, seq_lens,
        num_blocks=self.num_blocks, block_size=self.block_size, num_heads=self.num_heads,
        head_size=self.head_size, scale=scale, alibi_slopes=alibi_slopes,
        logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, backend=backend)

  def read_scales(self):
    """(k_scale, v_scale) as the attention ops take them: [num_heads] per tensor (a [1]
    scale broadcast), the per-token / per-block / FP4 scale arrays as stored."""
    if self.scale_collection:
      return self.k_scale, self.k_scale
    if self.quant != "tensor":
      return self.k_scale, self.v_scale
    return (jnp.broadcast_to(self.k_scale, (self.num_heads,)),
            jnp.broadcast_to(self.v_scale, (self.num_heads,)))

  def attend_ragged(self, layer, query, block_table, kv_lens, cu_q_lens, *, num_seqs=None,
                    scale=None, alibi_slopes=None, logits_soft_cap=None, sliding_window=None,
                    sinks=None, backend: str = "auto"):
    """Ragged attention (chunked prefill and decode rows of many sequences) over this
    cache's ``layer``: :func:`jkv.ops.ragged_attention.ragged_paged_attention` with the
    cache's arrays.

    query: [T, Hq, D], the new tokens of all sequences, sequence after sequence;
    block_table int [S, W]; kv_lens int [S] (cached + new); cu_q_lens int [S + 1];
    num_seqs: int (may be traced; default S). Returns [T, Hq, D] in the query's dtype.
    ``layer`` may be traced (out of range under jit: zeros).
    """
    errors.check_layer_given(layer)
    query, block_table, kv_lens, cu_q_lens, num_seqs = ragged_ops.check_ragged(
        query, block_table, kv_lens, cu_q_lens, num_seqs, self.num_heads, self.head_size,
        self.num_blocks, self.block_size)
    layer, kv_lens = attention_ops.layer_and_lengths(layer, self.num_layers, kv_lens)
    scale, alibi_slopes, logits_soft_cap, sliding_window = attention_ops.check_options(
        query.shape[1], self.head_size, scale, alibi_slopes, logits_soft_cap, sliding_window)
    k_scale, v_scale = self.read_scales()
    return ragged_ops.ragged_attention(
        self.cache_format(), query, self.key_cache, self.value_cache, k_scale, v_scale, layer,
        block_table, kv_lens, cu_q_lens, num_seqs, num_blocks=self.num_blocks,
        block_size=self.block_size, num_heads=self.num_heads, head_size=self.head_size,
        scale=scale, alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window, sinks=ragged_ops.check_sinks(sinks, query.shape[1]),
        backend=backend, k_global_scale=self.k_global_scale,
        v_global_scale=self.v_global_scale)

  def write_and_attend_ragged(self, layer, query, key, value, slot_mapping, block_table,
                              kv_lens, cu_q_lens, *, num_seqs=None, backend: str = "auto",
                              **options):
    """:meth:`write` of this step's key / value [T, num_heads, head_size] at
    ``slot_mapping`` [T], then :meth:`attend_ragged` over the updated cache (options as
    there). Returns ``(out [T, Hq, D], cache)``."""
    cache = self.write(layer, key, value, slot_mapping, backend=backend)
    out = cache.attend_ragged(layer, query, block_table, kv_lens, cu_q_lens,
                              num_seqs=num_seqs, backend=backend, **options)
    return out, cache

  def cache_format(self) -> formats.CacheFormat:
    """How the arrays store K and V (static), for the attention ops."""
    quant = self.quant
    if quant == "tensor" and quant_lib.fp8_dtype(self.kv_cache_dtype) is None:
      quant = "none"
    return formats.CacheFormat(self.layout, self.kv_layout, quant, self.scale_block_tokens,
                               self.k_scale.shape[-1] if self.scale_collection else 1)


def check_float_dtype(name: str, dtype) -> None:
  """A model dtype: floating point and not FP8 (FP8 is a cache format: kv_cache_dtype)."""
  dtype = np.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
    raise TypeError(f"{name} must be a floating-point dtype of 16 bits or more (bf16, f16, "
                    f"f32), got {dtype.name}")


def _scaled_storage(kv_cache_dtype: str, quant: str):
  """Storage dtype of a per-token / per-block cache."""
  if kv_cache_dtype == "int8":
    return np.dtype(jnp.int8)
  fp8 = quant_lib.FP8_DTYPES.get(kv_cache_dtype)
  if fp8 is None:
    raise ValueError(f"quant={quant!r} needs kv_cache_dtype 'int8' or one of "
                     f"{tuple(quant_lib.FP8_DTYPES)}, got {kv_cache_dtype!r}")
  return np.dtype(fp8)


@pytree.dataclass
class ContiguousKVCache:
  """One contiguous row per position (seed ``contiguous_kv_cache.md``), for a batch.

  Fields: keys, values [num_layers, batch, max_context_length, H, D]; position int32
  [batch] (tokens stored per sequence). ``update`` writes at ``position``;
  ``advance`` moves it. Eager calls raise the seed's errors; under jit the same
  checks run through ``jax.experimental.checkify`` (``checkify.checkify(fn)``) and
  are free otherwise; writes past the end are dropped, never out of bounds.
  """
  keys: jax.Array
  values: jax.Array
  position: jax.Array

  @classmethod
  def create(cls, num_layers: int, max_context_length: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.bfloat16, batch_size: int = 1):
    for name, size in (("num_layers", num_layers), ("max_context_length", max_context_length),
                       ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                       ("batch_size", batch_size)):
      errors.check_size(name, size)
    check_float_dtype("dtype", dtype)
    shape = (num_layers, batch_size, max_context_length, num_kv_heads, head_dim)
    return cls(keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype),
               position=jnp.zeros((batch_size,), jnp.int32))

  @property
  def num_layers(self) -> int:
    return self.keys.shape[0]

  def split_dims(self) -> dict[str, tuple[int | None, int | None]]:
    """{array field: (dim split over dp, dim split over tp)}: where :mod:`jkv.sharding`
    puts this cache on a mesh (None: replicated over that axis)."""
    return {"keys": (1, 3), "values": (1, 3), "position": (0, None)}

  @property
  def max_context_length(self) -> int:
    return self.keys.shape[2]

  @property
  def is_full(self):
    """bool [batch]: no room left."""
    return self.position >= self.max_context_length

  @property
  def remaining_capacity(self):
    """int32 [batch]."""
    return self.max_context_length - self.position

  def advance(self, num_tokens=1) -> "ContiguousKVCache":
    """position += num_tokens (int or int [batch]); must be positive and fit."""
    num_tokens = errors.int_array("num_tokens", num_tokens)
    errors.check_int("num_tokens", num_tokens)
    if num_tokens.shape not in ((), self.position.shape):
      raise ValueError(f"num_tokens must be a scalar or [batch={self.position.shape[0]}], got "
                       f"shape {tuple(num_tokens.shape)}")
    num_tokens = num_tokens.astype(jnp.int32)
    new = self.position + num_tokens
    limit = self.max_context_length
    if errors.is_concrete(num_tokens) and errors.is_concrete(self.position):
      n = np.broadcast_to(np.asarray(num_tokens), self.position.shape)
      if (n <= 0).any():
        raise ValueError("num_tokens must be positive")
      reached = np.asarray(self.position, np.int64) + n      # (int64: no wrap)
      over = np.nonzero(reached > limit)[0]
      if over.size:
        b = int(over[0])
        raise ValueError(f"KV cache overflow: position {int(reached[b])} exceeds max "
                         f"context length {limit} (tried to advance by {int(n[b])} tokens)")
    else:
      checkify.debug_check(jnp.all(num_tokens > 0), "num_tokens must be positive")
      room = limit - self.position                              # (no int32 wrap)
      checkify.debug_check(jnp.all(num_tokens <= room),
                           "KV cache overflow: position {p} exceeds max context length "
                           f"{limit}", p=jnp.max(new))
    return dataclasses.replace(self, position=new)

  def reset(self) -> "ContiguousKVCache":
    """Position 0 and zeroed memory (as the seed's ``reset``)."""
    return dataclasses.replace(self, keys=jnp.zeros_like(self.keys),
                               values=jnp.zeros_like(self.values),
                               position=jnp.zeros_like(self.position))

  def update(self, layer, new_keys, new_values, *, backend: str = "auto") -> "ContiguousKVCache":
    """Writes new [batch, T, H, D] (or [T, H, D] for batch 1) of ``layer`` at the
    current positions; does not advance."""
    errors.check_int_scalar("layer", layer)
    if errors.is_concrete(layer):
      value = int(np.asarray(layer))
      if not 0 <= value < self.num_layers:
        raise ValueError(f"Layer index out of range: {value} (must be 0-{self.num_layers - 1})")
    else:
      checkify.debug_check((layer >= 0) & (layer < self.num_layers),
                           "Layer index out of range: {l} "
                           f"(must be 0-{self.num_layers - 1})", l=layer)
    new_keys = jnp.asarray(new_keys)
    if new_keys.ndim == 3:
      new_keys, new_values = new_keys[None], jnp.asarray(new_values)[None]
    if not errors.is_concrete(self.position):
      checkify.debug_check(
          jnp.all(new_keys.shape[1] <= self.max_context_length - self.position),
          f"KV cache overflow: writing {new_keys.shape[1]} tokens at position {{p}} exceeds "
          f"max context length {self.max_context_length}", p=jnp.max(self.position))
    keys, values = contiguous_ops.update_kv_cache(
        self.keys, self.values, new_keys, new_values, self.position,
        layer=layer, backend=backend)
    return dataclasses.replace(self, keys=keys, values=values)
