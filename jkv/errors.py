"""Eager validation helpers shared by the ops: errors name the argument, expected and got."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
  """True when x holds values now (not a tracer under jit / scan / checkify)."""
  return not isinstance(x, jax.core.Tracer)


def check_shape(name: str, x, expected) -> None:
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(x.shape)}")


def check_ndim(name: str, x, ndim: int, what: str) -> None:
  if x.ndim != ndim:
    raise ValueError(f"{name} must be {ndim}-D {what}, got shape {tuple(x.shape)}")


def check_int(name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")


def check_float(name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")


def check_slots_in_range(name: str, slots, capacity: int, what: str) -> None:
  """Eagerly: every slot must be < capacity (negative = padding is fine)."""
  if not is_concrete(slots):
    return
  values = np.asarray(slots)
  int32 = np.iinfo(np.int32)
  wide = np.nonzero((values < int32.min) | (values > int32.max))[0]
  if wide.size:  # would wrap when JAX (without x64) converts to int32
    i = int(wide[0])
    raise ValueError(f"{name}[{i}] = {int(values[i])} does not fit in int32")
  bad = np.nonzero(values >= capacity)[0]
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"{name}[{i}] = {int(values[i])} is out of range: {what} has "
                     f"{capacity} slots (valid: 0..{capacity - 1}, or < 0 for padding)")


def check_index(name: str, index, size: int) -> None:
  """Eagerly: 0 <= index < size."""
  if index is None or not is_concrete(index):
    return
  value = int(np.asarray(index))
  if not 0 <= value < size:
    raise ValueError(f"{name} must be in [0, {size}), got {value}")


def check_token_inputs(key, value, slot_mapping) -> None:
  """key, value float [T, H, D] of one shape; slot_mapping int [T'] with T' <= T."""
  check_ndim("key", key, 3, "[num_tokens, num_heads, head_size]")
  check_shape("value", value, key.shape)
  check_float("key", key)
  check_float("value", value)
  check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
  check_int("slot_mapping", slot_mapping)
  if slot_mapping.shape[0] > key.shape[0]:
    raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but key has only "
                     f"{key.shape[0]} tokens")


def check_pairs_in_range(name: str, pairs, size: int, dst_size: int | None = None) -> None:
  """Eagerly: in a [N, 2] (src, dst) pair array, sources are < size and destinations <
  dst_size (default size); negative entries are skipped pairs."""
  if not is_concrete(pairs):
    return
  values = np.asarray(pairs)
  limits = np.array([size, size if dst_size is None else dst_size])
  bad = np.argwhere(values >= limits[None, :])
  if bad.size:
    i, j = (int(v) for v in bad[0])
    which = ("source", "destination")[j] if dst_size is not None else "the cache"
    raise ValueError(f"{name}[{i}, {j}] = {int(values[i, j])} is out of range: {which} has "
                     f"{int(limits[j])} blocks")
