"""Block copies between pages of the same caches: ``copy_blocks``.

Semantics in :mod:`jkv.reference.blocks`. There is no Pallas kernel yet: ``backend="auto"``
runs the jnp reference (an XLA gather + scatter, in place on donated caches); asking for
``"pallas"`` / ``"interpret"`` raises ``NotImplementedError``.
"""

from __future__ import annotations

import jax.numpy as jnp

from jkv import backend as backend_lib
from jkv import errors
from jkv.reference import blocks as reference


def copy_blocks(key_caches, value_caches, block_mapping, *, block_axis: int = 0,
                backend: str = "auto"):
  """vLLM / AITER ``copy_blocks``: for every layer and ``(src, dst)`` pair of
  ``block_mapping`` int [N, 2], ``cache[dst] = cache[src]`` (K and V).

  key_caches, value_caches: lists of arrays (one per layer; any layout and dtype) whose
  axis ``block_axis`` indexes blocks (1 for layer-stacked [L, nb, ...] arrays; scale
  arrays with a block axis may be passed along). value_caches may be None (packed / MLA
  caches). Returns ``(key_caches, value_caches)`` as lists.
  """
  key_caches = list(key_caches)
  value_caches = None if value_caches is None else list(value_caches)
  block_mapping = jnp.asarray(block_mapping)
  errors.check_ndim("block_mapping", block_mapping, 2, "[num_pairs, 2]")
  errors.check_int("block_mapping", block_mapping)
  if block_mapping.shape[1] != 2:
    raise ValueError(f"block_mapping must be [num_pairs, 2], got shape "
                     f"{tuple(block_mapping.shape)}")
  caches = key_caches + (value_caches or [])
  if not caches:
    raise ValueError("copy_blocks needs at least one cache")
  num_blocks = caches[0].shape[block_axis]
  for i, c in enumerate(caches):
    if c.ndim <= block_axis or c.shape[block_axis] != num_blocks:
      raise ValueError(f"every cache must have {num_blocks} blocks on axis {block_axis}, "
                       f"array {i} has shape {tuple(c.shape)}")
  errors.check_pairs_in_range("block_mapping", block_mapping, num_blocks)
  backend_lib.resolve(backend, kernel_supported=False)
  out = reference.copy_blocks(caches, block_mapping, block_axis=block_axis)
  k = out[:len(key_caches)]
  return k, (None if value_caches is None else out[len(key_caches):])
