"""Reference contiguous cache update (seed ``contiguous_kv_cache.md``: ``launch_update_kv_cache``)."""

from __future__ import annotations

import jax.numpy as jnp


def update_kv_cache(cache_keys, cache_values, new_keys, new_values, position, *, layer=None):
  """Writes new [B, T, H, D] at positions ``position[b] + t`` of caches [(L,) B, S, H, D].

  Positions outside [0, S) are dropped. Returns (cache_keys, cache_values).
  """
  batch, num_tokens = new_keys.shape[:2]
  max_len = cache_keys.shape[-3]
  pos = jnp.asarray(position, jnp.int32)[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)
  pos = jnp.where((pos >= 0) & (pos < max_len), pos, max_len)  # max_len: dropped
  rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
  index = (rows, pos) if layer is None else (layer, rows, pos)
  return (cache_keys.at[index].set(new_keys.astype(cache_keys.dtype), mode="drop"),
          cache_values.at[index].set(new_values.astype(cache_values.dtype), mode="drop"))
