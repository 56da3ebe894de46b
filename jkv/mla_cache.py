"""DeepSeek cache pytrees: :class:`MLACache` (latent ``[kv_c | k_pe]`` entries),
:class:`IndexerKCache` (the V3.2 indexer's FP8 byte cache) and :class:`FP4IndexerCache`
(the V4 pool's NVFP4 indexer keys).

Arrays are pytree leaves (layers stacked on a leading axis, indexed by a possibly traced
``layer``); sizes and formats are static. ``write`` methods return a new cache, updated in
place when the caller donates it; ``gather`` reads only the blocks in a block table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jkv import errors, formats, fp4, pages, pytree, quant
from jkv.ops import attention as attention_ops
from jkv.ops import indexer as indexer_ops
from jkv.ops import mla as mla_ops
from jkv.reference import mla as mla_reference


def _pages_over_dp(cache) -> dict[str, tuple[int | None, int | None]]:
  """Every array field's page dim (1) split over dp, nothing over tp: the DeepSeek caches
  keep the latent / indexer keys whole on every tp device."""
  return dict.fromkeys(pytree.fields(cache)[0], (1, None))


@pytree.dataclass
class MLACache:
  """Paged MLA latent cache: entries ``[kv_c (R) | k_pe (P)]`` per token (and KV head).

  Fields:
    kv_cache: [L, NB, bs, R + P] (or [L, NB, bs, H, R + P]); ``dtype``, or FP8; for
      ``kv_cache_dtype="fp8_ds_mla"`` uint8 [L, NB, bs, R + R/128 * 4 + 2 P] entries
      (FP8 kv_c with a float32 scale per 128 values, bf16 k_pe; single head; ``write``
      only, the fused RoPE path writes the other formats).
      ``kv_cache_dtype="fp8_split"`` (the DeepSeek-V4 pool): float8_e4m3fn content
      [L, NB, bs, (H,) R] only, with ``rope_cache`` and ``entry_scale`` beside it.
    scale: float32 [1], the FP8 scale (1.0 otherwise).
    rope_cache: "fp8_split" only: bfloat16 [L, NB, bs, (H,) P], the (rotated) RoPE part.
    entry_scale: "fp8_split" only: float32 [L, NB, bs, (H,)], one dequantization scale
      per entry (``max(amax / 448, FLT_MIN)`` of its content).
  Static: kv_lora_rank (R), pe_dim (P), kv_cache_dtype ("auto", an FP8 name,
  "fp8_ds_mla" or "fp8_split"), dtype (what ``gather`` returns). Entries are stored nope
  first.
  """
  kv_cache: jax.Array
  scale: jax.Array
  rope_cache: jax.Array | None
  kv_lora_rank: int = pytree.static()
  pe_dim: int = pytree.static()
  kv_cache_dtype: str = pytree.static()
  dtype: np.dtype = pytree.static()
  entry_scale: jax.Array | None = None

  @classmethod
  def create(cls, num_blocks: int, block_size: int, kv_lora_rank: int = 512, pe_dim: int = 64,
             *, num_layers: int = 1, num_heads: int | None = None, dtype=jnp.bfloat16,
             kv_cache_dtype: str = "auto", scale: float = 1.0) -> "MLACache":
    """An empty cache; ``num_heads`` None: single-head entries [.., bs, R + P]."""
    for name, size in (("num_blocks", num_blocks), ("block_size", block_size),
                       ("kv_lora_rank", kv_lora_rank), ("pe_dim", pe_dim),
                       ("num_layers", num_layers)):
      errors.check_size(name, size)
    if num_heads is not None:
      errors.check_size("num_heads", num_heads)
    heads = () if num_heads is None else (num_heads,)
    blocks = (num_layers, num_blocks, block_size) + heads
    if kv_cache_dtype == formats.MLA_SPLIT:
      return cls(kv_cache=jnp.zeros(blocks + (kv_lora_rank,), jnp.float8_e4m3fn),
                 scale=jnp.ones((1,), jnp.float32),
                 rope_cache=jnp.zeros(blocks + (pe_dim,), jnp.bfloat16),
                 entry_scale=jnp.ones(blocks, jnp.float32), kv_lora_rank=kv_lora_rank,
                 pe_dim=pe_dim, kv_cache_dtype=formats.MLA_SPLIT, dtype=np.dtype(dtype))
    if kv_cache_dtype == formats.MLA_DS_MLA:
      if heads or kv_lora_rank % formats.DS_MLA_TILE:
        raise ValueError(f"{formats.MLA_DS_MLA} caches are single-head with kv_lora_rank a "
                         f"multiple of {formats.DS_MLA_TILE}")
      storage = jnp.uint8
      entry = formats.ds_mla_entry_bytes(kv_lora_rank, pe_dim)
    else:
      quant.check_kv_cache_dtype(kv_cache_dtype)
      storage = quant.fp8_dtype(kv_cache_dtype) or dtype
      entry = kv_lora_rank + pe_dim
    shape = (num_layers, num_blocks, block_size) + heads + (entry,)
    return cls(kv_cache=jnp.zeros(shape, storage), rope_cache=None,
               scale=jnp.full((1,), scale, jnp.float32), kv_lora_rank=kv_lora_rank,
               pe_dim=pe_dim, kv_cache_dtype=kv_cache_dtype, dtype=np.dtype(dtype))

  @property
  def num_blocks(self) -> int:
    return self.kv_cache.shape[1]

  @property
  def block_size(self) -> int:
    return self.kv_cache.shape[2]

  @property
  def per_tensor_fp8(self) -> bool:
    """True for an FP8 cache with the one ``scale``."""
    return formats.mla_per_tensor_fp8(self.kv_cache_dtype)

  def replace(self, **changes) -> "MLACache":
    return dataclasses.replace(self, **changes)

  def split_dims(self) -> dict[str, tuple[int | None, int | None]]:
    """{array field: (dim split over dp, dim split over tp)}: where :mod:`jkv.sharding`
    puts this cache on a mesh (None: replicated over that axis)."""
    return {**_pages_over_dp(self), "scale": (None, None)}

  def write(self, layer, kv_c, k_pe, slot_mapping, *, backend: str = "auto") -> "MLACache":
    """``concat_and_cache_mla`` into layer ``layer``: kv_c [T, (H,) R], k_pe [T, (H,) P]
    (k_pe already rotated)."""
    errors.check_layer_given(layer)
    if self.kv_cache_dtype == formats.MLA_SPLIT:
      return self._write_split(layer, kv_c, k_pe, slot_mapping, backend=backend)
    scale = self.scale if self.per_tensor_fp8 else None
    return self.replace(kv_cache=mla_ops.concat_and_cache_mla(
        kv_c, k_pe, self.kv_cache, slot_mapping, self.kv_cache_dtype, scale, layer=layer,
        backend=backend))

  def write_rope(self, layer, q_nope, q_pe, kv_c, k_pe, slot_mapping, positions, cos_cache,
                 sin_cache, *, is_neox: bool = True, q_scale=None, q_out_dtype=None,
                 backend: str = "auto"):
    """The fused path: RoPE on q_pe and k_pe at ``positions``, ``q_out`` [T, Hq, R + P]
    (``[q_nope | rope(q_pe)]``) and the rotated entries into layer ``layer``.
    Returns ``(q_out, cache)``."""
    errors.check_layer_given(layer)
    if self.kv_cache_dtype == formats.MLA_DS_MLA:
      raise NotImplementedError(f"write_rope into an {formats.MLA_DS_MLA} cache: rotate k_pe "
                                "and use write")
    if self.kv_cache_dtype == formats.MLA_SPLIT:
      raise NotImplementedError(f"write_rope into an {formats.MLA_SPLIT} cache: use "
                                "write_split_rope")
    k_scale = self.scale if self.per_tensor_fp8 else None
    q_out, kv_cache = mla_ops.fused_qk_rope_concat_and_cache_mla(
        q_nope, q_pe, kv_c, k_pe, self.kv_cache, slot_mapping, k_scale, q_scale, positions,
        cos_cache, sin_cache, is_neox=is_neox, is_nope_first=True, q_out_dtype=q_out_dtype,
        layer=layer, backend=backend)
    return q_out, self.replace(kv_cache=kv_cache)

  def _write_split(self, layer, kv_c, k_pe, slot_mapping, positions=None, cos_cache=None,
                   sin_cache=None, *, is_neox=True, backend="auto"):
    kv_c, k_pe = jnp.asarray(kv_c), jnp.asarray(k_pe)
    heads = self.kv_cache.shape[3:-1]
    errors.check_float("kv_c", kv_c)
    errors.check_float("k_pe", k_pe)
    errors.check_shape("kv_c", kv_c, kv_c.shape[:1] + heads + (self.kv_lora_rank,))
    errors.check_shape("k_pe", k_pe, kv_c.shape[:1] + heads + (self.pe_dim,))
    if not heads:
      kv_c, k_pe = kv_c[:, None], k_pe[:, None]
    caches = mla_ops.write_split(kv_c, k_pe, self.kv_cache, self.rope_cache, self.entry_scale,
                                 slot_mapping, positions, cos_cache, sin_cache, layer=layer,
                                 is_neox=is_neox, backend=backend)
    return self.replace(kv_cache=caches[0], rope_cache=caches[1], entry_scale=caches[2])

  def write_split_rope(self, layer, kv_c, k_pe, slot_mapping, positions, cos_cache, sin_cache,
                       *, is_neox: bool = True, backend: str = "auto") -> "MLACache":
    """"fp8_split" caches: RoPE on k_pe at ``positions`` (float32), then FP8 content with
    its per-entry scale and the bf16 rotated part, by one Pallas kernel (``"auto"`` on a
    GPU; the reference elsewhere)."""
    errors.check_layer_given(layer)
    if self.kv_cache_dtype != formats.MLA_SPLIT:
      raise ValueError(f"write_split_rope needs kv_cache_dtype={formats.MLA_SPLIT!r}, this "
                       f"cache is {self.kv_cache_dtype!r}")
    return self._write_split(layer, kv_c, k_pe, slot_mapping, positions, cos_cache,
                             sin_cache, is_neox=is_neox, backend=backend)

  def gather(self, layer, block_table, seq_lens):
    """Contiguous, dequantized ``(kv_c [B, S, (H,) R], k_pe [B, S, (H,) P])`` of ``dtype``,
    S = max_blocks * block_size; positions at or past ``seq_lens`` are 0. Reads only the
    blocks in ``block_table``."""
    errors.check_layer_given(layer)
    errors.check_index("layer", layer, self.kv_cache.shape[0])
    block_table, seq_lens = attention_ops.check_tables(block_table, seq_lens, self.num_blocks,
                                                       self.block_size,
                                                       table_name="block_table")
    # (a traced layer out of range reads zeros, as attend does, not another layer)
    layer, seq_lens = attention_ops.layer_and_lengths(layer, self.kv_cache.shape[0], seq_lens)
    blocks, offsets, valid = pages.table_positions(block_table, seq_lens, self.block_size)
    entries = mla_reference.read_entries(   # float32 [B, S, (H,) R + P]
        self.kv_cache, self.rope_cache, self.entry_scale, self.scale, layer, blocks, offsets,
        kv_cache_dtype=self.kv_cache_dtype, kv_lora_rank=self.kv_lora_rank, pe_dim=self.pe_dim)
    mask = valid.reshape(valid.shape + (1,) * (entries.ndim - 2))
    entries = jnp.where(mask, entries, 0.0).astype(self.dtype)
    return entries[..., :self.kv_lora_rank], entries[..., self.kv_lora_rank:]

  def attend(self, layer, query, block_table, seq_lens, *, scale: float,
             backend: str = "auto", lowering: str = "auto"):
    """MLA decode attention in the absorbed form over layer ``layer``.

    query: [B, Hq, R + P] float, ``[q_nope . W_UK | rope(q_pe)]`` (nope first, like the
    entries); Hq a multiple of the cache's kv heads (1 for a single-head cache).
    block_table int [B, W], seq_lens int [B] (<= W * block_size). Logits are
    ``scale * <query, [kv_c | k_pe]>``, values ``kv_c``. Returns the latent output
    [B, Hq, R] in the query's dtype (multiply by W_UV for the heads' values). The
    Every format has a Pallas kernel (``fp8_split`` and ``fp8_ds_mla`` dequantize in it:
    their scales multiply the logits and the probabilities). ``layer`` may be traced (out
    of range under jit: zeros). ``lowering``: as :func:`jkv.ops.mla.mla_attention`.
    """
    errors.check_layer_given(layer)
    return mla_ops.mla_attention(
        query, self.kv_cache, self.rope_cache, self.entry_scale, self.scale, layer, block_table,
        seq_lens, kv_cache_dtype=self.kv_cache_dtype, kv_lora_rank=self.kv_lora_rank,
        pe_dim=self.pe_dim, scale=scale, backend=backend, lowering=lowering)


@pytree.dataclass
class IndexerKCache:
  """The DeepSeek-V3.2 indexer key cache (bytes; layout in :mod:`jkv.reference.indexer`).

  Fields: kv_cache uint8 [L, NB, bs, head_dim + head_dim // quant_block_size * 4].
  Static: head_dim, quant_block_size, scale_fmt ("ue8m0" or "float32").
  """
  kv_cache: jax.Array
  head_dim: int = pytree.static()
  quant_block_size: int = pytree.static()
  scale_fmt: str = pytree.static()

  @classmethod
  def create(cls, num_blocks: int, block_size: int, head_dim: int = 128, *,
             quant_block_size: int = 128, scale_fmt: str = "ue8m0",
             num_layers: int = 1) -> "IndexerKCache":
    for name, size in (("num_blocks", num_blocks), ("block_size", block_size),
                       ("head_dim", head_dim), ("num_layers", num_layers)):
      errors.check_size(name, size)
    if quant_block_size <= 0 or head_dim % quant_block_size:
      raise ValueError(f"quant_block_size must divide head_dim={head_dim}, got "
                       f"{quant_block_size}")
    if scale_fmt not in indexer_ops.SCALE_FMTS:
      raise ValueError(f"scale_fmt must be one of {indexer_ops.SCALE_FMTS}, got {scale_fmt!r}")
    stride = formats.indexer_stride(head_dim, quant_block_size)
    return cls(kv_cache=jnp.zeros((num_layers, num_blocks, block_size, stride), jnp.uint8),
               head_dim=head_dim, quant_block_size=quant_block_size, scale_fmt=scale_fmt)

  def split_dims(self) -> dict[str, tuple[int | None, int | None]]:
    """{array field: (dim split over dp, dim split over tp)}: where :mod:`jkv.sharding`
    puts this cache on a mesh (None: replicated over that axis)."""
    return _pages_over_dp(self)

  def write(self, layer, k, slot_mapping, *, backend: str = "auto") -> "IndexerKCache":
    """Quantizes k [T, head_dim] and writes values and scales into layer ``layer``."""
    errors.check_layer_given(layer)
    k = jnp.asarray(k)
    errors.check_ndim("k", k, 2, "[num_tokens, head_dim]")
    errors.check_shape("k", k, (k.shape[0], self.head_dim))
    return dataclasses.replace(self, kv_cache=indexer_ops.indexer_k_quant_and_cache(
        k, self.kv_cache, slot_mapping, self.quant_block_size, self.scale_fmt, layer=layer,
        backend=backend))

  def gather(self, layer, block_table, cu_seq_lens, num_tokens: int):
    """``(values float8_e4m3fn [num_tokens, head_dim], scales float32 [num_tokens, G])`` of
    the sequences (``cp_gather_indexer_k_quant_cache``; rows past cu_seq_lens[-1] are 0)."""
    errors.check_layer_given(layer)
    errors.check_size("num_tokens", num_tokens, minimum=0)
    groups = self.head_dim // self.quant_block_size
    return indexer_ops.cp_gather_indexer_k_quant_cache(
        self.kv_cache, jnp.zeros((num_tokens, self.head_dim), jnp.float8_e4m3fn),
        jnp.zeros((num_tokens, groups), jnp.float32), block_table, cu_seq_lens, layer=layer)

  def read(self, layer, block_table, cu_seq_lens, num_tokens: int):
    """Dequantized keys float32 [num_tokens, head_dim] (values x their group's scale)."""
    values, scales = self.gather(layer, block_table, cu_seq_lens, num_tokens)
    values = values.astype(jnp.float32).reshape(num_tokens, -1, self.quant_block_size)
    return (values * scales[..., None]).reshape(num_tokens, self.head_dim)


@pytree.dataclass
class FP4IndexerCache:
  """The DeepSeek-V4 FP4 indexer pool: keys as NVFP4 (E2M1 values packed two per byte, low
  nibble first; one E4M3 scale per 16 values) with one float32 global scale per block.
  Its block ids are the content pool's (one block table serves both), its block size its
  own. Semantics of the values and scales: :mod:`jkv.fp4` (nvfp4).

  Fields:
    keys: uint8 [L, NB, bs, head_dim // 2].
    scales: float8_e4m3fn [L, NB, bs, head_dim // 16].
    global_scale: float32 [L, NB]; set a block's before writing to it
      (:meth:`with_global_scale`, e.g. at allocation); ``sf = e4m3(amax16 / (6 g))``, so g
      should be at least amax / (6 * 448) for the block's keys to avoid saturation.
  Static: head_dim. ``write`` and ``read`` are jnp code (XLA): no Pallas kernel.
  """
  keys: jax.Array
  scales: jax.Array
  global_scale: jax.Array
  head_dim: int = pytree.static()

  @classmethod
  def create(cls, num_blocks: int, block_size: int, head_dim: int = 128, *, num_layers: int = 1,
             global_scale: float = 1.0) -> "FP4IndexerCache":
    for name, size in (("num_blocks", num_blocks), ("block_size", block_size),
                       ("head_dim", head_dim), ("num_layers", num_layers)):
      errors.check_size(name, size)
    if head_dim % 16:
      raise ValueError(f"head_dim must be a multiple of 16 (NVFP4 groups), got {head_dim}")
    blocks = (num_layers, num_blocks, block_size)
    return cls(keys=jnp.zeros(blocks + (head_dim // 2,), jnp.uint8),
               scales=jnp.zeros(blocks + (head_dim // 16,), jnp.float8_e4m3fn),
               global_scale=jnp.full(blocks[:2], global_scale, jnp.float32), head_dim=head_dim)

  @property
  def block_size(self) -> int:
    return self.keys.shape[2]

  def split_dims(self) -> dict[str, tuple[int | None, int | None]]:
    """{array field: (dim split over dp, dim split over tp)}: where :mod:`jkv.sharding`
    puts this cache on a mesh (None: replicated over that axis)."""
    return _pages_over_dp(self)

  def with_global_scale(self, layer, block_ids, values) -> "FP4IndexerCache":
    """Sets the global scales of blocks ``block_ids`` [n] (< 0 skipped) to ``values``."""
    errors.check_layer_given(layer)
    errors.check_index("layer", layer, self.keys.shape[0])
    block_ids = errors.int_array("block_ids", block_ids)
    errors.check_int("block_ids", block_ids)
    block_ids = block_ids.astype(jnp.int32).reshape(-1)
    num_blocks = self.keys.shape[1]
    ids = jnp.where(block_ids >= 0, block_ids, num_blocks)
    values = jnp.broadcast_to(jnp.asarray(values, jnp.float32), ids.shape)
    errors.check_scales_positive("values", values)
    return dataclasses.replace(
        self, global_scale=self.global_scale.at[layer, ids].set(values, mode="drop"))

  def write(self, layer, k, slot_mapping, *, backend: str = "auto") -> "FP4IndexerCache":
    """Quantizes k [T, head_dim] with each slot's block's global scale and writes it
    (slots < 0, and past the cache under jit, skipped). jnp code (XLA) only: ``"pallas"`` /
    ``"interpret"`` raise ``NotImplementedError`` (the kernel was removed, slower than XLA's
    code: benchmarks/RESULTS.md)."""
    errors.check_layer_given(layer)
    errors.check_index("layer", layer, self.keys.shape[0])
    k, slot_mapping = jnp.asarray(k), errors.int_array("slot_mapping", slot_mapping)
    errors.check_shape("k", k, (k.shape[0], self.head_dim))
    errors.check_float("k", k)
    errors.check_shape("slot_mapping", slot_mapping, (k.shape[0],))
    errors.check_int("slot_mapping", slot_mapping)
    num_blocks = self.keys.shape[1]
    errors.check_slots_in_range("slot_mapping", slot_mapping, num_blocks * self.block_size,
                                f"a cache of {num_blocks} blocks x {self.block_size}")
    keys, scales = indexer_ops.fp4_pool_write(k, self.keys, self.scales, self.global_scale,
                                              slot_mapping, layer=layer, backend=backend)
    return dataclasses.replace(self, keys=keys, scales=scales)

  def read(self, layer, block_table, seq_lens):
    """Dequantized keys float32 [B, S, head_dim], S = max_blocks * block_size; positions at
    or past ``seq_lens`` are 0. Reads only the blocks in ``block_table``."""
    errors.check_layer_given(layer)
    errors.check_index("layer", layer, self.keys.shape[0])
    block_table, seq_lens = attention_ops.check_tables(block_table, seq_lens,
                                                       self.keys.shape[1], self.block_size,
                                                       table_name="block_table")
    layer, seq_lens = attention_ops.layer_and_lengths(layer, self.keys.shape[0], seq_lens)
    blocks, offsets, valid = pages.table_positions(block_table, seq_lens, self.block_size)
    scale_bytes = jax.lax.bitcast_convert_type(self.scales[layer, blocks, offsets], jnp.uint8)
    g = self.global_scale[layer, blocks]
    keys = jax.vmap(jax.vmap(lambda p, s, gs: fp4.dequantize_groups(p, s, "nvfp4", gs)))(
        self.keys[layer, blocks, offsets], scale_bytes, g)
    return jnp.where(valid[..., None], keys, 0.0)
