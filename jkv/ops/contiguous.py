"""Contiguous (one row per position) cache update, after the seed ``contiguous_kv_cache.md``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import errors, quant
from jkv.layout import Plane
from jkv.ops import write as write_ops
from jkv.reference import contiguous as reference
from pallas_kernels import write as kernels


def update_kv_cache(cache_keys, cache_values, new_keys, new_values, position, *, layer=None,
                    backend="auto"):
  """Writes new tokens at ``position`` onwards; returns (cache_keys, cache_values).

  Shapes (optionally with a leading num_layers dim on the caches, selected by ``layer``):

  * one sequence: caches [S, H, D], new [T, H, D], position int scalar;
  * a batch: caches [B, S, H, D], new [B, T, H, D], position int [B] (or a scalar).

  Tokens land at ``position (+ t)``; values are cast to the cache dtype. Tokens past
  S raise ``ValueError`` eagerly ("KV cache overflow ...") and are dropped under jit.
  The Pallas back end runs the paged write kernel with one-token blocks.

  >>> import jax.numpy as jnp, jkv
  >>> cache_keys = cache_values = jnp.zeros((2, 8, 1, 4))      # [B, S, H, D]
  >>> new = jnp.ones((2, 1, 1, 4))                            # one new token per sequence
  >>> cache_keys, cache_values = jkv.update_kv_cache(cache_keys, cache_values, new, new,
  ...                                                jnp.array([3, 5]))
  >>> cache_keys[:, :, 0, 0]
  Array([[0., 0., 0., 1., 0., 0., 0., 0.],
         [0., 0., 0., 0., 0., 1., 0., 0.]], dtype=float32)
  """
  new_keys, new_values = jnp.asarray(new_keys), jnp.asarray(new_values)
  single = new_keys.ndim == 3
  errors.check_shape("new_values", new_values, new_keys.shape)
  if single:
    new_keys, new_values = new_keys[None], new_values[None]
  errors.check_ndim("new_keys", new_keys, 4, "[B, T, H, D] (or [T, H, D])")
  errors.check_float("new_keys", new_keys)
  errors.check_float("new_values", new_values)
  batch, num_tokens, num_heads, head_dim = new_keys.shape
  lead = 0 if layer is None else 1
  cache_keys = write_ops.as_cache("cache_keys", cache_keys)
  cache_values = write_ops.as_cache("cache_values", cache_values)
  want_ndim = (3 if single else 4) + lead
  layers_dim = "num_layers, " if lead else ""
  errors.check_ndim("cache_keys", cache_keys, want_ndim,
                    f"[{layers_dim}{'' if single else 'B, '}S, H, D] (new_keys is "
                    f"{new_keys.ndim - single}-D{', layer is given' if lead else ''})")
  errors.check_shape("cache_values", cache_values, cache_keys.shape)
  if cache_values.dtype != cache_keys.dtype:
    raise TypeError(f"cache_values dtype {cache_values.dtype} differs from cache_keys dtype "
                    f"{cache_keys.dtype}")
  if quant.is_fp8(cache_keys.dtype) or not jnp.issubdtype(cache_keys.dtype, jnp.floating):
    raise TypeError(f"cache_keys must be a float (non-FP8) cache, got {cache_keys.dtype}")
  given_shape = tuple(cache_keys.shape)
  if single:  # reshapes (not slices): free, so donated caches stay in place
    cache_keys = cache_keys.reshape(cache_keys.shape[:-3] + (1,) + cache_keys.shape[-3:])
    cache_values = cache_values.reshape(cache_values.shape[:-3] + (1,) + cache_values.shape[-3:])
  max_len = cache_keys.shape[-3]
  cache_batch, _, cache_heads, cache_head_dim = cache_keys.shape[lead:]
  if (batch, num_heads, head_dim) != (cache_batch, cache_heads, cache_head_dim):
    want = (cache_batch,) * (not single) + ("T", cache_heads, cache_head_dim)
    raise ValueError(f"new_keys must be [{', '.join(map(str, want))}] to match cache_keys of "
                     f"shape {given_shape}, got shape {tuple(new_keys.shape)[single:]}")
  given_position = position  # checked as given: int64 values would wrap in int32
  position = jnp.asarray(position)
  errors.check_int("position", position)
  if position.ndim > 1 or (position.ndim == 1 and position.shape[0] not in (1, batch)):
    raise ValueError(f"position must be a scalar or [B={batch}] (one per sequence), got shape "
                     f"{tuple(position.shape)}")
  position = jnp.broadcast_to(position.astype(jnp.int32), (batch,))
  if errors.is_concrete(given_position) and num_tokens:
    pos = np.broadcast_to(np.asarray(given_position), (batch,)).astype(np.int64)
    if (pos < 0).any():
      raise ValueError(f"position must be >= 0, got {pos.tolist()}")
    over = np.nonzero(pos + num_tokens > max_len)[0]
    if over.size:
      b = int(over[0])
      raise ValueError(f"KV cache overflow: position {int(pos[b]) + num_tokens} exceeds max "
                       f"context length {max_len} (tried to write {num_tokens} tokens at "
                       f"position {int(pos[b])} of sequence {b})")
  if layer is not None:
    errors.check_index("layer", layer, cache_keys.shape[0])
    # A traced layer out of range writes nothing (rather than another layer).
    layer = jnp.asarray(layer, jnp.int32)
    num_layers = cache_keys.shape[0]
    position = jnp.where((layer >= 0) & (layer < num_layers), position, max_len)
    layer = jnp.clip(layer, 0, num_layers - 1)

  if num_tokens:
    chosen = backend_lib.resolve(backend)
    if chosen == "reference":
      cache_keys, cache_values = reference.update_kv_cache(
          cache_keys, cache_values, new_keys, new_values, position, layer=layer)
    else:
      pos = position[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)
      rows = jnp.arange(batch, dtype=jnp.int32)[:, None] * max_len + pos
      slots = jnp.where((pos >= 0) & (pos < max_len), rows, -1).reshape(-1)
      plane = Plane("NHD", 1, num_heads, head_dim)
      cache_keys, cache_values = kernels.scatter_kv(
          new_keys.reshape(-1, num_heads, head_dim), new_values.reshape(-1, num_heads, head_dim),
          cache_keys, cache_values, slots, 0 if layer is None else layer,
          jnp.ones((1,), jnp.float32), jnp.ones((1,), jnp.float32), key_plane=plane,
          value_plane=plane, num_blocks=batch * max_len, quant_dtype=None,
          interpret=chosen == "interpret")
  if single:
    cache_keys = cache_keys.reshape(cache_keys.shape[:-4] + cache_keys.shape[-3:])
    cache_values = cache_values.reshape(cache_values.shape[:-4] + cache_values.shape[-3:])
  return cache_keys, cache_values
