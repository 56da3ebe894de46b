"""Checked variants of jkv's ops: value errors reported under jit through ``checkify``.

Under ``jax.jit`` jkv never writes or reads out of bounds, and it says nothing either:
a paged write drops slots past the cache, attention treats blocks outside the cache as
masked and clamps ``seq_lens`` to the table, ``PagePool.append`` only sets the sticky
``out_of_pages`` flag. The wrappers here take the same arguments as the op they wrap,
add ``checkify.debug_check`` calls for those cases, then call the op:

* :func:`checked_write` (``PagedKVCache.write``), :func:`checked_write_kv`,
  :func:`checked_reshape_and_cache`, :func:`checked_reshape_and_cache_flash`: every slot
  of ``slot_mapping`` < num_blocks * block_size (< 0 is padding), ``layer`` in range.
* :func:`checked_attend` (``PagedKVCache.attend``): ``layer`` in range,
  0 <= seq_lens <= W * block_size, and every block id that ``seq_lens`` reads lies in
  [0, num_blocks).
* :func:`checked_append` (``PagePool.append``): the input pool's ``out_of_pages`` is not
  already set, ``seq_ids`` < max_seqs and without duplicates, ``num_tokens`` >= 0, and
  the append fits (block table width, free pages, ``max_new_pages``).
* :func:`checked_update_kv_cache` (``update_kv_cache``): 0 <= position and
  position + T <= the max context length, ``layer`` in range.

Wrap the step function with ``checkify.checkify`` to get the report::

    from jax.experimental import checkify
    step = lambda cache, k, v, slots: checked_write(cache, 0, k, v, slots)
    err, cache = jax.jit(checkify.checkify(step, errors=checkify.user_checks))(
        cache, k, v, slots)
    err.throw()   # checkify.JaxRuntimeError: slot_mapping[3] = 70 is out of range: ...

Without ``checkify`` the wrappers are the plain ops: ``debug_check`` lowers to nothing
(no callback, no host sync), and XLA drops the unused predicate arithmetic. Eagerly
(concrete values) the ops themselves raise ``ValueError``, so no check is added then.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import checkify

from jkv import errors, layout as layout_lib
from jkv.ops import contiguous as contiguous_ops
from jkv.ops import write as write_ops


def _traced(*xs) -> bool:
  """True when any of xs is a tracer (under jit / scan / checkify)."""
  return any(x is not None and not errors.is_concrete(x) for x in xs)


def check_layer(layer, num_layers: int) -> None:
  """Under tracing: 0 <= layer < num_layers (layer: int scalar or None)."""
  if not _traced(layer):
    return
  layer = jnp.asarray(layer, jnp.int32)
  checkify.debug_check((layer >= 0) & (layer < num_layers),
                       f"layer must be in [0, {num_layers}), got {{layer}}", layer=layer)


def check_slots(slot_mapping, num_blocks: int, block_size: int) -> None:
  """Under tracing: every slot of slot_mapping (int [T]) < num_blocks * block_size."""
  if not _traced(slot_mapping):
    return
  slots = jnp.asarray(slot_mapping).reshape(-1)
  if slots.size == 0:
    return
  capacity = num_blocks * block_size
  bad = slots >= capacity
  i = jnp.argmax(bad).astype(jnp.int32)
  checkify.debug_check(
      ~jnp.any(bad),
      "slot_mapping[{i}] = {slot} is out of range: a cache of "
      f"{num_blocks} blocks x {block_size} has {capacity} slots (valid: 0..{capacity - 1}, "
      "or < 0 for padding)", i=i, slot=slots[i])


def check_tables(block_table, seq_lens, num_blocks: int, block_size: int) -> None:
  """Under tracing: 0 <= seq_lens (int [B]) <= W * block_size, and every block id of
  block_table (int [B, W]) that seq_lens reads is in [0, num_blocks)."""
  if not _traced(block_table, seq_lens):
    return
  table = jnp.asarray(block_table, jnp.int32)
  lens = jnp.asarray(seq_lens, jnp.int32)
  width = table.shape[1]
  if lens.size == 0:
    return
  bad_len = (lens < 0) | (lens > width * block_size)
  b = jnp.argmax(bad_len).astype(jnp.int32)
  checkify.debug_check(
      ~jnp.any(bad_len),
      "seq_lens[{b}] = {n} is out of range: block_table has "
      f"{width} blocks of {block_size} tokens per sequence (valid: 0..{width * block_size})",
      b=b, n=lens[b])
  used = jnp.arange(width)[None, :] * block_size < lens[:, None]
  bad = used & ((table < 0) | (table >= num_blocks))
  flat = jnp.argmax(bad.reshape(-1)).astype(jnp.int32)
  b, j = flat // width, flat % width
  checkify.debug_check(
      ~jnp.any(bad),
      "block_table[{b}, {j}] = {block} is outside the cache "
      f"(valid: 0..{num_blocks - 1}) and seq_lens[{{b}}] = {{n}} reads it",
      b=b, j=j, block=table[b, j], n=lens[b])


def checked_write(cache, layer, key, value, slot_mapping, **kw):
  """``cache.write(layer, key, value, slot_mapping, **kw)`` (a :class:`PagedKVCache`;
  key/value [T, H, D], slot_mapping int [T]), checking the slots and ``layer``."""
  new = cache.write(layer, key, value, slot_mapping, **kw)
  check_layer(layer, cache.num_layers)
  check_slots(slot_mapping, cache.num_blocks, cache.block_size)
  return new


def checked_write_kv(key, value, key_cache, value_cache, slot_mapping, *, layout: str,
                     kv_layout: str = "NHD", **kw):
  """:func:`jkv.write_kv` (same arguments), checking the slots and ``layer``."""
  caches = write_ops.write_kv(key, value, key_cache, value_cache, slot_mapping, layout=layout,
                              kv_layout=kv_layout, **kw)
  _check_write(key, key_cache, value_cache, slot_mapping, layout, kv_layout, kw.get("layer"))
  return caches


def checked_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                              kv_cache_dtype="auto", k_scale=None, v_scale=None,
                              asm_layout=False, *, backend="auto"):
  """:func:`jkv.reshape_and_cache` (vLLM / AITER), checking the slots."""
  caches = write_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                       kv_cache_dtype, k_scale, v_scale, asm_layout,
                                       backend=backend)
  _check_write(key, key_cache, value_cache, slot_mapping, "asm" if asm_layout else "vllm",
               "NHD", None)
  return caches


def checked_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                    kv_cache_dtype="auto", k_scale=None, v_scale=None,
                                    kv_layout="NHD", *, backend="auto"):
  """:func:`jkv.reshape_and_cache_flash` (vLLM), checking the slots."""
  caches = write_ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                             kv_cache_dtype, k_scale, v_scale, kv_layout,
                                             backend=backend)
  _check_write(key, key_cache, value_cache, slot_mapping,
               "flash" if kv_layout == "NHD" else "hnd", "NHD", None)
  return caches


def _check_write(key, key_cache, value_cache, slot_mapping, layout, kv_layout, layer):
  """The checks of an array-level write (after the op validated the shapes)."""
  _, num_heads, head_size = jnp.shape(key)
  collection = layout == layout_lib.MAX   # [nb, 2, L, bs, H, D]: the layers inside
  lead = write_ops.cache_lead(layout, layer, "write")
  num_blocks, block_size, _, _ = write_ops.check_caches(
      layout, kv_layout, key_cache, value_cache, lead, num_heads, head_size)
  if layer is not None:
    check_layer(layer, layout_lib.max_dims(key_cache.shape)[1] if collection
                else key_cache.shape[0])
  check_slots(slot_mapping, num_blocks, block_size)


def checked_attend(cache, layer, query, block_table, seq_lens, **kw):
  """``cache.attend(layer, query, block_table, seq_lens, **kw)`` (query [B, Hq, D],
  block_table int [B, W], seq_lens int [B]), checking ``layer`` and the tables."""
  out = cache.attend(layer, query, block_table, seq_lens, **kw)
  check_layer(layer, cache.num_layers)
  check_tables(block_table, seq_lens, cache.num_blocks, cache.block_size)
  return out


def checked_append(pool, seq_ids, num_tokens, **kw):
  """``pool.append(seq_ids, num_tokens, **kw)`` (seq_ids, num_tokens int [B]) ->
  ``(pool, copies)``, checking that the ids are valid and that the append fits.

  ``out_of_pages`` is sticky: a pool that an earlier (unchecked) append under jit left
  out of pages is reported too.
  """
  new_pool, copies = pool.append(seq_ids, num_tokens, **kw)
  if not _traced(seq_ids, num_tokens, pool.seq_lens, pool.ref_count, pool.out_of_pages):
    return new_pool, copies
  given = jnp.asarray(seq_ids, jnp.int32).reshape(-1)
  if given.size == 0:
    return new_pool, copies
  ids, valid = pool._seq_ids("seq_ids", seq_ids)
  count = jnp.where(valid, jnp.asarray(num_tokens, jnp.int32).reshape(-1), 0)
  checkify.debug_check(~pool.out_of_pages,
                       "PagePool.out_of_pages is already set: an earlier append under jit "
                       "ran out of pages")
  over = given >= pool.max_seqs
  i = jnp.argmax(over).astype(jnp.int32)
  checkify.debug_check(~jnp.any(over),
                       "seq_ids[{i}] = {id} is out of range: the pool has "
                       f"{pool.max_seqs} sequence slots (< 0: ignored)", i=i, id=given[i])
  duplicate = (given >= 0) & (given < pool.max_seqs) & ~valid
  i = jnp.argmax(duplicate).astype(jnp.int32)
  checkify.debug_check(~jnp.any(duplicate),
                       "seq_ids has duplicate sequence ids: seq_ids[{i}] = {id}",
                       i=i, id=given[i])
  negative = count < 0
  i = jnp.argmax(negative).astype(jnp.int32)
  checkify.debug_check(~jnp.any(negative), "num_tokens must be >= 0, got num_tokens[{i}] = {n}",
                       i=i, n=count[i])
  # Why this append did not fit (recomputed as PagePool.append does, for the message).
  failed = new_pool.out_of_pages & ~pool.out_of_pages
  count = jnp.maximum(count, 0)
  lens = pool.seq_lens[ids]
  old_pages, new_pages = pool.pages_of(lens), pool.pages_of(lens + count)
  too_long = failed & (new_pages > pool.max_pages_per_seq)
  i = jnp.argmax(too_long).astype(jnp.int32)
  checkify.debug_check(~jnp.any(too_long),
                       "out of pages: sequence {id} would need {n} pages, its block table has "
                       f"{pool.max_pages_per_seq}", id=given[i], n=new_pages[i])
  last = pool.block_table[ids, jnp.maximum(old_pages - 1, 0)]
  cow = (count > 0) & (lens % pool.page_size != 0) & (pool.ref_count[last] > 1)
  need = jnp.sum(new_pages - old_pages + cow.astype(jnp.int32))
  bound = kw.get("max_new_pages") or ids.shape[0] * pool.max_pages_per_seq
  checkify.debug_check(~failed,
                       "out of pages: the append needs {need} pages, {free} are free "
                       f"(max_new_pages={bound})", need=need, free=pool.num_free_pages)
  return new_pool, copies


def checked_update_kv_cache(cache_keys, cache_values, new_keys, new_values, position, *,
                            layer=None, backend="auto"):
  """:func:`jkv.update_kv_cache` (same arguments), checking 0 <= position, that the
  T new tokens fit (position + T <= S) and ``layer``."""
  out = contiguous_ops.update_kv_cache(cache_keys, cache_values, new_keys, new_values,
                                       position, layer=layer, backend=backend)
  if layer is not None:
    check_layer(layer, jnp.shape(cache_keys)[0])
  if not _traced(position):
    return out
  num_tokens, max_len = jnp.shape(new_keys)[-3], jnp.shape(cache_keys)[-3]
  pos = jnp.asarray(position, jnp.int32).reshape(-1)
  checkify.debug_check(jnp.all(pos >= 0), "position must be >= 0, got {p}", p=jnp.min(pos))
  if num_tokens:
    over = num_tokens > max_len - pos                         # (pos + T could wrap)
    b = jnp.argmax(over).astype(jnp.int32)
    checkify.debug_check(
        jnp.all(~over),
        f"KV cache overflow: writing {num_tokens} tokens at position {{p}} of sequence {{b}} "
        f"exceeds max context length {max_len}", p=pos[b], b=b)
  return out
