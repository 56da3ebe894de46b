"""Eager validation helpers shared by the ops: errors name the argument, expected and got."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
  """True when this process can read x's values now: not a tracer (under jit / scan /
  checkify), nor an array spanning other processes' devices (multi-process JAX). Value
  checks skip the others, as under jit (out-of-range entries are then dropped)."""
  if isinstance(x, (list, tuple)):   # (a list may hold tracers)
    return all(is_concrete(leaf) for leaf in jax.tree_util.tree_leaves(x))
  if isinstance(x, jax.core.Tracer):
    return False
  return not isinstance(x, jax.Array) or x.is_fully_addressable


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


def fits_int32(name: str, x):
  """Returns x unchanged, eagerly (x concrete, as given) checked to fit in int32: JAX
  without x64 converts int64 values by wrapping (2**32 + 1 becomes 1), so a range check
  after the conversion would pass. Non-integer input is left to :func:`check_int`."""
  if not is_concrete(x):
    return x
  values = np.asarray(x)
  if values.dtype.kind not in "iu" or values.size == 0:
    return x
  int32 = np.iinfo(np.int32)
  wide = np.argwhere((values < int32.min) | (values > int32.max))
  if len(wide):   # (a 0-D array's hit is an empty index)
    where = f"[{', '.join(str(int(i)) for i in wide[0])}]" if values.ndim else ""
    raise ValueError(f"{name}{where} = {int(values[tuple(wide[0])])} does not fit in int32")
  return x


def int_array(name: str, x):
  """x as a JAX array, its values checked as given to fit in int32 (:func:`fits_int32`)."""
  return jnp.asarray(fits_int32(name, x))


def check_slots_in_range(name: str, slots, capacity: int, what: str,
                         unit: str = "slots") -> None:
  """Eagerly: every slot must be < capacity (negative = padding is fine). The message
  says "``what`` has ``capacity`` ``unit``"."""
  if not is_concrete(slots):
    return
  fits_int32(name, slots)
  values = np.asarray(slots)
  bad = np.nonzero(values >= capacity)[0]
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"{name}[{i}] = {int(values[i])} is out of range: {what} has "
                     f"{capacity} {unit} (valid: "
                     f"{f'0..{capacity - 1}, or ' if capacity else ''}< 0 for padding)")


def check_layer_given(layer) -> None:
  """A stacked cache's methods take the layer: ValueError for None (it would otherwise
  surface as a shape error of the whole stack)."""
  if layer is None:
    raise ValueError("layer is required: the cache stacks its layers (pass an int, which "
                     "may be traced)")


def check_index(name: str, index, size: int) -> None:
  """index is an integer scalar (a Python / numpy int or a 0-D integer array, possibly
  traced); eagerly also 0 <= index < size. None passes."""
  if index is None:
    return
  check_int_scalar(name, index)
  if not is_concrete(index):
    return
  value = int(np.asarray(index))
  if not 0 <= value < size:
    raise ValueError(f"{name} must be in [0, {size}), got {value}")


def check_int_scalar(name: str, x) -> None:
  """x is a Python / numpy int or a 0-D integer array (possibly traced); not a bool."""
  if isinstance(x, (bool, np.bool_)):
    raise TypeError(f"{name} must be an integer, got {x!r}")
  if isinstance(x, (int, np.integer)):
    return
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name} must be an integer, got {type(x).__name__} {x!r}")
  if tuple(x.shape) != ():
    raise ValueError(f"{name} must be a scalar, got shape {tuple(x.shape)}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer, got dtype {x.dtype}")


def check_size(name: str, size, minimum: int = 1) -> None:
  """A size (block_size, num_blocks, nnz, ...): a Python / numpy int or a 0-D integer
  array, and eagerly >= minimum (a traced size passes)."""
  check_int_scalar(name, size)
  if not is_concrete(size):
    return
  value = int(np.asarray(size))
  if value < minimum:
    what = "positive" if minimum == 1 else f">= {minimum}"
    raise ValueError(f"{name} must be {what}, got {value}")


def check_scales_positive(name: str, scale, allow_zero: bool = False) -> None:
  """Eagerly: every entry of a (de)quantization scale is finite and > 0 (a 0, negative,
  Inf or NaN scale turns every quantized value into garbage). ``allow_zero``: >= 0 (a
  read's FP8 scale: 0 reads zeros, as the math says; a zero key scale gives uniform
  attention). Traced scales pass."""
  if scale is None or not is_concrete(scale):
    return
  values = np.asarray(scale, np.float32).reshape(-1)
  ok = (values >= 0) if allow_zero else (values > 0)
  bad = np.nonzero(~(np.isfinite(values) & ok))[0]
  if bad.size:
    i = int(bad[0])
    where = f"{name}[{i}]" if values.size > 1 else name
    raise ValueError(f"{where} must be finite and {'>=' if allow_zero else '>'} 0, "
                     f"got {values[i]}")


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
