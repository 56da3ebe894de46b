"""Rotary position embeddings (RoPE): cos / sin caches and the NeoX / GPT-J rotations.

Caches are AITER's: ``cos_cache``, ``sin_cache`` ``[max_pos, rot_dim / 2]`` with
``angle[p, i] = p * base ** (-2 i / rot_dim)``. vLLM keeps one ``cos_sin_cache [max_pos,
rot_dim]`` (cos in the first half, sin in the second): :func:`split_cos_sin_cache`.

Rotations, on the last axis of ``x`` (``rot_dim`` values), in float32:

* NeoX (``is_neox=True``) pairs ``i`` and ``i + rot_dim/2``:
  ``out[i] = x[i] c[i] - x[i+h] s[i]``, ``out[i+h] = x[i+h] c[i] + x[i] s[i]``;
* GPT-J pairs ``2i`` and ``2i+1``:
  ``out[2i] = x[2i] c[i] - x[2i+1] s[i]``, ``out[2i+1] = x[2i+1] c[i] + x[2i] s[i]``.

:func:`rotate_element` is the same formula for one output element given its partner, the
form the Pallas kernels use; :func:`apply_rope` is built from it, so both round alike.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def rope_cache(max_position: int, rot_dim: int, *, base: float = 10000.0,
               dtype=jnp.float32):
  """``(cos_cache, sin_cache)``, each ``[max_position, rot_dim // 2]`` of ``dtype``
  (angles computed in float64 on the host, then rounded once)."""
  if rot_dim <= 0 or rot_dim % 2:
    raise ValueError(f"rot_dim must be a positive even number, got {rot_dim}")
  if max_position <= 0:
    raise ValueError(f"max_position must be positive, got {max_position}")
  inv_freq = base ** (-np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
  angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
  return jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype)


def split_cos_sin_cache(cos_sin_cache):
  """vLLM's ``cos_sin_cache [max_pos, rot_dim]`` -> ``(cos_cache, sin_cache)``."""
  if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] % 2:
    raise ValueError("cos_sin_cache must be [max_pos, rot_dim] with rot_dim even, got shape "
                     f"{tuple(cos_sin_cache.shape)}")
  half = cos_sin_cache.shape[1] // 2
  return cos_sin_cache[:, :half], cos_sin_cache[:, half:]


def partner_and_pair(index, rot_dim: int, is_neox: bool):
  """For element ``index`` (int array, 0 <= index < rot_dim): ``(partner, pair, first)``:
  the element it rotates with, its cos / sin column and whether it is the pair's first."""
  half = rot_dim // 2
  if is_neox:
    first = index < half
    return (jnp.where(first, index + half, index - half), jnp.where(first, index, index - half),
            first)
  first = index % 2 == 0
  return jnp.where(first, index + 1, index - 1), index // 2, first


def rotate_element(x, partner, cos, sin, first):
  """One rotated element (float32): ``x c - partner s`` for a pair's first element,
  ``x c + partner s`` for its second."""
  x, partner = x.astype(jnp.float32), partner.astype(jnp.float32)
  cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
  return jnp.where(first, x * cos - partner * sin, x * cos + partner * sin)


def apply_rope(x, cos, sin, *, is_neox: bool):
  """Rotates ``x [..., rot_dim]`` by ``cos``, ``sin`` ``[..., rot_dim / 2]`` (broadcasting
  over the leading axes); float32 result."""
  rot_dim = x.shape[-1]
  if rot_dim % 2 or cos.shape[-1] * 2 != rot_dim or sin.shape[-1] != cos.shape[-1]:
    raise ValueError(f"rope needs cos / sin of {rot_dim // 2} values for {rot_dim} dims, got "
                     f"{cos.shape[-1]} and {sin.shape[-1]}")
  index = jnp.arange(rot_dim)
  partner, pair, first = partner_and_pair(index, rot_dim, is_neox)
  return rotate_element(x, jnp.take(x, partner, axis=-1), jnp.take(cos, pair, axis=-1),
                        jnp.take(sin, pair, axis=-1), first)
