"""Per-request state caches of hybrid models (Mamba, linear attention): :class:`StateCache`.

A recurrent layer keeps a fixed-size state per request instead of per-token K/V, e.g. a
Mamba2 layer's conv state ``[conv_width - 1, conv_dim]`` bf16 and SSM state
``[num_heads, head_dim, state_size]`` float32. vLLM (v1) stores them as it stores K/V:

* the KV-cache memory is raw bytes, ``torch.int8`` tensors allocated per layer (layers of
  different KV-cache groups may share one), cut into equal pages of ``page_size_bytes``;
  ``MambaSpec`` (``shapes``, ``dtypes``) sums the states' bytes, and ``page_size_padded``
  pads a Mamba page to the attention page size so both kinds share one pool;
* a Mamba layer gets its tensor as ``[num_blocks, page_size_bytes]`` int8 pages and its
  ``bind_kv_cache`` views each state's byte range, one state after the other in the spec's
  order, as ``[num_blocks, *shape]`` of the state's dtype: ``layer.kv_cache`` is the tuple
  of those views (older versions built the same views with ``torch.as_strided`` in the
  model runner before binding them);
* a request's state lives in one page, its state index (slot).

Here: ``pages`` is one uint8 tensor ``[num_layers, num_slots, page_bytes]``, one page per
request slot. JAX has no strided views of a buffer, so a state's typed view is
``jax.lax.bitcast_convert_type`` of its byte range (little-endian, as the device stores it):
reads gather those bytes, writes scatter them (``.at[].set``: in place when the cache is
donated, never a copy of the cache). Offsets are aligned to the largest itemsize, at least
8 bytes (vLLM packs the states tightly; each offset must be a multiple of its state's
itemsize there); the page is the last state's end rounded up to that alignment, or the
caller's ``page_bytes``.

Slots < 0 are padding: reads give zeros, writes are dropped. Under jit, out-of-range
slots or layer indices are treated the same way; eagerly they raise ValueError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jkv import errors, pytree

MIN_ALIGNMENT = 8


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """The named states of one layer's page and where each lives in it.

  states: ``{name: (shape, dtype)}`` in page order (or ``.states`` of another spec),
    normalized to ``((name, shape, np.dtype), ...)``. Dtypes: whole-byte integer or
    floating types of itemsize 1, 2, 4 or 8 (bf16, f16, f32, int8, int32, FP8, ...).
  page_bytes: the page size in bytes. None: the states' end rounded up to ``alignment``;
    given (e.g. vLLM's attention page size): a multiple of ``alignment`` that holds the
    states, else ValueError.
  offsets: byte offset of each state in the page (computed), a multiple of ``alignment``.
  """
  states: tuple[tuple[str, tuple[int, ...], np.dtype], ...]
  page_bytes: int | None = None
  offsets: tuple[int, ...] = dataclasses.field(init=False)

  def __post_init__(self):
    items = self.states.items() if isinstance(self.states, Mapping) else (
        (name, (shape, dtype)) for name, shape, dtype in self.states)
    states = tuple((name, _normalize_shape(name, shape), _normalize_dtype(name, dtype))
                   for name, (shape, dtype) in items)
    if not states:
      raise ValueError("states must name at least one state, got none")
    names = [name for name, _, _ in states]
    if len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
      raise ValueError(f"states must have distinct string names, got {names}")
    object.__setattr__(self, "states", states)
    alignment = self.alignment
    offsets, end = [], 0
    for _, shape, dtype in states:
      offsets.append(_round_up(end, alignment))
      end = offsets[-1] + _nbytes(shape, dtype)
    object.__setattr__(self, "offsets", tuple(offsets))
    needed = _round_up(end, alignment)
    if self.page_bytes is None:
      object.__setattr__(self, "page_bytes", needed)
    elif self.page_bytes < needed:
      raise ValueError(f"page_bytes is too small: the states need {needed} bytes, got "
                       f"{self.page_bytes}")
    elif self.page_bytes % alignment:
      raise ValueError(f"page_bytes must be a multiple of the alignment {alignment}, got "
                       f"{self.page_bytes}")

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(name for name, _, _ in self.states)

  @property
  def alignment(self) -> int:
    """Offsets are multiples of this: the largest itemsize, at least 8 bytes."""
    return max(MIN_ALIGNMENT, *(dtype.itemsize for _, _, dtype in self.states))

  def shape(self, name: str) -> tuple[int, ...]:
    return self.states[self._index(name)][1]

  def dtype(self, name: str) -> np.dtype:
    return self.states[self._index(name)][2]

  def offset(self, name: str) -> int:
    """Byte offset of state ``name`` in the page."""
    return self.offsets[self._index(name)]

  def nbytes(self, name: str) -> int:
    """Bytes of state ``name`` in one page."""
    _, shape, dtype = self.states[self._index(name)]
    return _nbytes(shape, dtype)

  def _index(self, name: str) -> int:
    names = self.names
    if name not in names:
      raise ValueError(f"name must be one of {names}, got {name!r}")
    return names.index(name)


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
  return int(np.prod(shape)) * dtype.itemsize


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _normalize_shape(name: str, shape) -> tuple[int, ...]:
  shape = tuple(int(d) for d in shape)
  if any(d <= 0 for d in shape):
    raise ValueError(f"state {name!r} must have a shape of positive sizes, got {shape}")
  return shape


def _normalize_dtype(name: str, dtype) -> np.dtype:
  dtype = np.dtype(dtype)
  whole_bytes = jax.dtypes.itemsize_bits(dtype) == 8 * dtype.itemsize
  numeric = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
  if not (numeric and whole_bytes and dtype.itemsize in (1, 2, 4, 8)):
    raise TypeError(f"state {name!r} must have a whole-byte integer or floating dtype of "
                    f"itemsize 1, 2, 4 or 8, got {dtype}")
  return dtype


@pytree.dataclass
class StateCache:
  """The per-request states of ``num_layers`` layers that share one :class:`StateSpec`.

  Fields: pages uint8 [num_layers, num_slots, spec.page_bytes]: one page per (layer,
  request slot) holding every state of the spec at its offset.
  Static: spec.

  Arguments of the methods: ``layer`` a Python int or a traced int32 scalar; ``slots``
  int [n], < 0 for padding (a slot twice in one write: which value lands is unspecified);
  ``values`` [n, *shape] of exactly the state's dtype. Methods return new caches; inside
  ``jax.jit(..., donate_argnums=...)`` the writes happen in place.
  """
  pages: jax.Array
  spec: StateSpec = pytree.static()

  @classmethod
  def create(cls, spec: StateSpec, num_layers: int, num_slots: int) -> "StateCache":
    """Zero-filled pages."""
    if not isinstance(spec, StateSpec):
      raise TypeError(f"spec must be a StateSpec, got {type(spec).__name__}")
    errors.check_size("num_layers", num_layers)
    errors.check_size("num_slots", num_slots)
    return cls(pages=jnp.zeros((num_layers, num_slots, spec.page_bytes), jnp.uint8), spec=spec)

  @property
  def num_layers(self) -> int:
    return self.pages.shape[0]

  @property
  def num_slots(self) -> int:
    return self.pages.shape[1]

  def split_dims(self) -> dict[str, tuple[int | None, int | None]]:
    """{array field: (dim split over dp, dim split over tp)}: where :mod:`jkv.sharding`
    puts this cache on a mesh (None: replicated over that axis)."""
    return {"pages": (1, None)}   # raw state bytes: replicated over tp

  def read(self, layer, name: str, slots):
    """State ``name`` of ``slots`` in ``layer``: [n, *shape] of its dtype, 0 for padding."""
    layer, rows = self._indices(layer, slots)
    start = self.spec.offset(name)
    data = self.pages.at[layer, rows, start:start + self.spec.nbytes(name)].get(
        mode="fill", fill_value=0)
    return self._view(name, data)

  def read_all(self, layer, slots) -> dict[str, jax.Array]:
    """Every state of ``slots`` in ``layer``: ``{name: [n, *shape]}`` (one gather of the pages)."""
    layer, rows = self._indices(layer, slots)
    page = self.pages.at[layer, rows].get(mode="fill", fill_value=0)     # [n, page_bytes]
    return {name: self._view(name, page[:, offset:offset + self.spec.nbytes(name)])
            for name, offset in zip(self.spec.names, self.spec.offsets)}

  def write(self, layer, name: str, slots, values) -> "StateCache":
    """Sets state ``name`` of ``slots`` in ``layer`` to ``values`` [n, *shape]; the other
    states, slots and layers keep their bytes."""
    layer, rows = self._indices(layer, slots)
    pages = self._scatter(self.pages, layer, rows, name, values, f"values for state {name!r}")
    return dataclasses.replace(self, pages=pages)

  def write_all(self, layer, slots, values: Mapping) -> "StateCache":
    """:meth:`write` of every state: ``values`` ``{name: [n, *shape]}`` names each once."""
    if set(values) != set(self.spec.names):
      raise ValueError(f"values must have the keys {self.spec.names}, got {tuple(values)}")
    layer, rows = self._indices(layer, slots)
    pages = self.pages
    for name in self.spec.names:
      pages = self._scatter(pages, layer, rows, name, values[name], f"values[{name!r}]")
    return dataclasses.replace(self, pages=pages)

  def reset(self, slots) -> "StateCache":
    """Zeroes the pages of ``slots`` in every layer (e.g. for requests that start)."""
    rows = self._rows(slots)
    return dataclasses.replace(self, pages=self.pages.at[:, rows].set(0, mode="drop"))

  def _rows(self, slots):
    """int32 [n] page rows: ``slots``, with padding / out-of-range slots at num_slots (a
    row past the end: filled with zeros by reads, dropped by writes)."""
    errors.check_slots_in_range("slots", slots, self.num_slots, "the state cache")
    slots = jnp.asarray(slots)
    errors.check_ndim("slots", slots, 1, "[n]")
    errors.check_int("slots", slots)
    slots = slots.astype(jnp.int32)
    return jnp.where((slots >= 0) & (slots < self.num_slots), slots, self.num_slots)

  def _indices(self, layer, slots):
    """(layer index, page rows); a traced layer out of range reads / writes nothing."""
    errors.check_layer_given(layer)
    rows = self._rows(slots)
    layer = errors.int_array("layer", layer)
    errors.check_ndim("layer", layer, 0, "integer")
    errors.check_int("layer", layer)
    errors.check_index("layer", layer, self.num_layers)
    layer = layer.astype(jnp.int32)
    layer_ok = (layer >= 0) & (layer < self.num_layers)
    return jnp.clip(layer, 0, self.num_layers - 1), jnp.where(layer_ok, rows, self.num_slots)

  def _view(self, name: str, data):
    """Typed view of uint8 [n, nbytes] bytes of state ``name``: [n, *shape]."""
    dtype = _usable_dtype(name, self.spec.dtype(name))
    itemsize = (dtype.itemsize,) if dtype.itemsize > 1 else ()
    data = data.reshape(data.shape[:1] + self.spec.shape(name) + itemsize)
    return jax.lax.bitcast_convert_type(data, dtype)

  def _scatter(self, pages, layer, rows, name: str, values, argument: str):
    """``pages`` with the bytes of ``values`` [n, *shape] at state ``name`` of ``rows``."""
    dtype = _usable_dtype(name, self.spec.dtype(name))
    given = getattr(values, "dtype", None)
    if given is None or np.dtype(given) != dtype:
      raise TypeError(f"{argument} must be an array of dtype {dtype}, got "
                      f"{type(values).__name__ if given is None else np.dtype(given)}")
    values = jnp.asarray(values)
    errors.check_shape(argument, values, rows.shape + self.spec.shape(name))
    nbytes = self.spec.nbytes(name)
    data = jax.lax.bitcast_convert_type(values, jnp.uint8).reshape(rows.shape[0], nbytes)
    start = self.spec.offset(name)
    return pages.at[layer, rows, start:start + nbytes].set(data, mode="drop")


def _usable_dtype(name: str, dtype: np.dtype) -> np.dtype:
  """``dtype``, if JAX can make arrays of it now (64-bit types need jax_enable_x64)."""
  if jax.dtypes.canonicalize_dtype(dtype) != dtype:
    raise ValueError(f"state {name!r} is {dtype}, which needs jax_enable_x64 (JAX would "
                     f"give {jax.dtypes.canonicalize_dtype(dtype)})")
  return dtype
