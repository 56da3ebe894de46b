"""Shapes and index math of every paged cache layout.

A paged cache holds ``num_blocks`` blocks of ``block_size`` token slots;
``slot = block * block_size + offset``. Inside one block, every layout stores
the ``(offset, head, dim)`` elements of a token at a fixed element offset
(the *plane* formulas below). The Pallas kernels scatter through these
formulas on a ``[rows, block_elems]`` view of the cache; the jnp references
index the cache arrays directly, so the two are independent checks of each
other.

Layouts (x = 16 // itemsize of the cache dtype):

=========  ===========================================  =====================================
name       key cache                                    value cache
=========  ===========================================  =====================================
vllm       [nb, h, d // x, bs, x]                       [nb, h, d, bs]
asm        [nb, h, d // x, bs, x]                       [nb, h, bs // x, d, x]
flash      [nb, bs, h, d]  (NHD)                        same
hnd        [nb, h, bs, d]                               same
packed     one tensor: NHD storage [nb, bs, h, 2d] or HND storage [nb, h, bs, 2d]; K in
           [..., :d], V in [..., d:]
=========  ===========================================  =====================================

A multi-layer cache stacks a leading ``num_layers`` dimension. Mojo MAX's paged *collection*
(layout ``"max"``) instead keeps every layer inside a block: one tensor
``[nb, 2, L, bs, H, D]`` (K at ``[:, 0]``, V at ``[:, 1]``), so one contiguous copy moves
a block of all layers; each (block, K|V, layer) page is NHD.

Kernels view a cache as ``[rows, page_elems]``; :class:`PageRows` says which row holds the
page of (layer, block).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("vllm", "asm", "flash", "hnd", "packed")
MAX = "max"   # Mojo MAX's all-layers collection [nb, 2, L, bs, H, D] (not a per-layer layout)
KV_LAYOUTS = ("NHD", "HND")


def _bits(dtype: np.dtype) -> int:
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.finfo(dtype).bits
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.iinfo(dtype).bits
  return 8 * dtype.itemsize


def vector_width(dtype) -> int:
  """x = 16 // itemsize: elements per 16-byte vector of the x-vectorized layouts.
  ValueError for sub-byte dtypes (4-bit values are stored packed, two per uint8)."""
  dtype = np.dtype(dtype)
  if _bits(dtype) < 8:
    raise ValueError(f"cache dtype {dtype} is narrower than a byte: paged layouts hold whole "
                     f"bytes; store 4-bit values packed (PagedKVCache quant='mxfp4' / 'nvfp4')")
  return 16 // dtype.itemsize


def check_kv_layout(kv_layout: str) -> None:
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")


def check_layout(layout: str, kv_layout: str = "NHD") -> None:
  """ValueError unless ``layout`` is one of :data:`LAYOUTS` and ``kv_layout`` one of
  :data:`KV_LAYOUTS` that the layout has: ``kv_layout`` picks the storage order of
  ``packed`` only. ``flash`` is NHD ``[nb, bs, H, D]`` (its HND form is layout ``hnd``),
  ``hnd`` is HND, and vllm / asm have their own fixed orders, so ``"HND"`` with flash,
  vllm or asm is refused rather than silently stored as NHD."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  check_kv_layout(kv_layout)
  if kv_layout == "HND" and layout == "flash":
    raise ValueError("layout 'flash' is NHD storage [nb, bs, H, D]; for a flash cache in HND "
                     "storage [nb, H, bs, D] pass layout='hnd'")
  if kv_layout == "HND" and layout in ("vllm", "asm"):
    raise ValueError(f"kv_layout='HND' picks the storage order of layout 'packed'; layout "
                     f"{layout!r} has a fixed order: leave kv_layout='NHD'")


def cache_shapes(layout: str, num_blocks: int, block_size: int, num_heads: int,
                 head_size: int, dtype, kv_layout: str = "NHD"):
  """(key_shape, value_shape) of one layer; value_shape is None for ``packed``."""
  check_layout(layout, kv_layout)
  nb, bs, h, d = num_blocks, block_size, num_heads, head_size
  x = vector_width(dtype)
  if layout in ("vllm", "asm"):
    if d % x:
      raise ValueError(f"head_size {d} must be a multiple of x={x} for layout {layout!r}")
    key = (nb, h, d // x, bs, x)
    if layout == "vllm":
      return key, (nb, h, d, bs)
    if bs % x:
      raise ValueError(f"block_size {bs} must be a multiple of x={x} for layout 'asm'")
    return key, (nb, h, bs // x, d, x)
  if layout == "flash":
    return (nb, bs, h, d), (nb, bs, h, d)
  if layout == "hnd":
    return (nb, h, bs, d), (nb, h, bs, d)
  # packed
  if kv_layout == "NHD":
    return (nb, bs, h, 2 * d), None
  return (nb, h, bs, 2 * d), None


@dataclasses.dataclass(frozen=True)
class Plane:
  """Where the elements of one token's [num_heads, head_size] tensor live inside a block.

  kind:
    ``"NHD"``  element (o, h, d) at ``(o * H + h) * row + base + d``
    ``"HND"``  at ``(h * bs + o) * row + base + d``
    ``"KX"``   x-vectorized key ``[H, D/x, bs, x]``: ``h*D*bs + (d//x)*bs*x + o*x + d%x``
    ``"VD"``   vLLM value ``[H, D, bs]``: ``h*D*bs + d*bs + o``
    ``"VASM"`` ASM value ``[H, bs/x, D, x]``: ``h*D*bs + (o//x)*D*x + d*x + o%x``
  ``row`` is the stride of one (o, h) row (head_size, or 2*head_size when K and V
  share a row); ``base`` the offset of this tensor inside the row (or block).
  """
  kind: str
  block_size: int
  num_heads: int
  head_size: int
  x: int = 1
  row: int = 0
  base: int = 0

  @property
  def tokens_fastest(self) -> bool:
    """Whether consecutive tokens of a block are adjacent (vLLM / ASM values)."""
    return self.kind in ("VD", "VASM")

  def offset(self, o, h, d):
    """Element offset inside the block; o, h, d are broadcastable int32 arrays."""
    return self.token_offset(o) + self.elem_offset(h, d)

  # Every plane's offset separates into a part of the token's offset in its block and a
  # part of (head, dim): kernels add a [tokens, 1] and a [1, elems] vector per element.
  def token_offset(self, o):
    """The part of the offset that depends on the token's offset o in its block."""
    row, x = self.row or self.head_size, self.x
    if self.kind == "NHD":
      return o * (self.num_heads * row)
    if self.kind == "HND":
      return o * row
    if self.kind == "KX":
      return o * x
    if self.kind == "VD":
      return o
    if self.kind == "VASM":
      if self.block_size == x:   # one group of x tokens (o in [0, bs)): tokens adjacent,
        return o                 # as in VD (a GPU kernel's loads along tokens vectorize)
      group, lane = _div_mod(o, x)
      return group * (self.head_size * x) + lane
    raise ValueError(f"unknown plane kind {self.kind!r}")

  def elem_offset(self, h, d):
    """The part of the offset that depends on (head, dim)."""
    bs, hd, x = self.block_size, self.head_size, self.x
    row = self.row or hd
    if self.kind == "NHD":
      return h * row + (self.base + d)
    if self.kind == "HND":
      return h * (bs * row) + (self.base + d)
    if self.kind == "KX":
      chunk, lane = _div_mod(d, x)
      return h * (hd * bs) + chunk * (bs * x) + lane + self.base
    if self.kind == "VD":
      return h * (hd * bs) + d * bs + self.base
    if self.kind == "VASM":
      return h * (hd * bs) + d * x + self.base
    raise ValueError(f"unknown plane kind {self.kind!r}")

  def flat_elem_offset(self, e):
    """``elem_offset(e // head_size, e % head_size)`` of a flat element index e >= 0 (a
    token's [H * D] row), every part taken from e directly: Triton's pointer analysis
    loses the contiguity of a remainder of a remainder (``(e % D) % x``), so a kernel
    that split e into (head, dim) first stored its vLLM keys one element at a time."""
    bs, hd, x = self.block_size, self.head_size, self.x
    row = self.row or hd
    h, d = _div_mod(e, hd)
    if self.kind == "NHD":
      return e + self.base if row == hd else h * row + (self.base + d)
    if self.kind == "KX":
      chunks, lane = _div_mod(e, x)   # (e // x) % (D / x), not (e % D) // x
      return h * (hd * bs) + _div_mod(chunks, hd // x)[1] * (bs * x) + lane + self.base
    return self.elem_offset(h, d)


def _div_mod(a, n: int):
  """(a // n, a % n) for a >= 0. Inside a kernel (a jax array) as C's truncating division,
  lax.div / lax.rem: jnp's // and % add a sign correction (a select) that hides from
  Triton's pointer analysis that a // n is constant, and a % n contiguous, over aligned runs
  of n, so it could not vectorize an access through them (the vLLM key store was one byte
  per instruction)."""
  if isinstance(a, jax.Array):
    return lax.div(a, n), lax.rem(a, n)
  return a // n, a % n


def planes(layout: str, block_size: int, num_heads: int, head_size: int, dtype,
           kv_layout: str = "NHD") -> tuple[Plane, Plane]:
  """(key_plane, value_plane) of a layout; for ``packed`` both address the one tensor."""
  check_layout(layout, kv_layout)
  bs, h, d = block_size, num_heads, head_size
  x = vector_width(dtype)
  if layout in ("vllm", "asm"):
    value = Plane("VD", bs, h, d) if layout == "vllm" else Plane("VASM", bs, h, d, x=x)
    return Plane("KX", bs, h, d, x=x), value
  if layout == "flash":
    return Plane("NHD", bs, h, d), Plane("NHD", bs, h, d)
  if layout == "hnd":
    return Plane("HND", bs, h, d), Plane("HND", bs, h, d)
  kind = kv_layout
  return (Plane(kind, bs, h, d, row=2 * d, base=0), Plane(kind, bs, h, d, row=2 * d, base=d))


def block_elems(shape, leading: int) -> int:
  """Elements per block of a cache whose first ``leading`` dims index blocks."""
  return math.prod(shape[leading:])


def slot_to_block_offset(slot_mapping, block_size: int):
  """slot -> (block, offset); jit-able."""
  slot_mapping = jnp.asarray(slot_mapping)
  return slot_mapping // block_size, slot_mapping % block_size


def blocks_of(layout: str, key_cache_shape, kv_layout: str = "NHD") -> tuple[int, int]:
  """(num_blocks, block_size) read off one layer's key (or packed) cache shape."""
  check_layout(layout, kv_layout)
  shape = tuple(key_cache_shape)
  if layout in ("vllm", "asm"):
    if len(shape) != 5:
      raise ValueError(f"key_cache for layout {layout!r} must be 5-D [nb, h, d/x, bs, x], got {shape}")
    return shape[0], shape[3]
  if len(shape) != 4:
    raise ValueError(f"cache for layout {layout!r} must be 4-D, got {shape}")
  if layout == "flash" or (layout == "packed" and kv_layout == "NHD"):
    return shape[0], shape[1]
  return shape[0], shape[2]


def heads_dim(layout: str, kv_layout: str = "NHD") -> int:
  """The heads dim of one layer's key / value (or packed) cache (blocks are dim 0): 1 for
  vllm / asm / hnd / packed-HND, 2 for flash / packed-NHD; ``"paged5d"`` (FlashInfer's
  [P, 2, ...] tensor): 3 (NHD) or 2 (HND); ``"max"`` (the collection): 4."""
  if layout == "paged5d":
    check_kv_layout(kv_layout)
    return 3 if kv_layout == "NHD" else 2
  if layout == MAX:   # [nb, 2, L, bs, H, D]
    return 4
  check_layout(layout, kv_layout)
  return 2 if layout == "flash" or (layout == "packed" and kv_layout == "NHD") else 1


def heads_of(layout: str, key_cache_shape, kv_layout: str = "NHD") -> tuple[int, int]:
  """(num_heads, head_size) read off one layer's key (or packed) cache shape."""
  blocks_of(layout, key_cache_shape, kv_layout)  # validates rank and names
  shape = tuple(key_cache_shape)
  if layout in ("vllm", "asm"):
    return shape[1], shape[2] * shape[4]
  if layout == "flash":
    return shape[2], shape[3]
  if layout == "hnd":
    return shape[1], shape[3]
  if shape[3] % 2:
    raise ValueError(f"packed cache's last dim holds K and V ([..., 2 * head_size]); it must "
                     f"be even, got shape {shape}")
  heads = shape[2] if kv_layout == "NHD" else shape[1]
  return heads, shape[3] // 2


def token_index(layout: str, block, offset, head_size: int, x: int, kv_layout: str = "NHD"):
  """(key_index, value_index): index tuples into one layer's cache(s) that select the
  entries of tokens at (block, offset) (int arrays of one shape S).

  ``cache[index]`` is [*S, H, D], except the x-vectorized key (vllm / asm): [*S, H, D/x, x].
  For ``packed`` and ``paged5d`` (FlashInfer's [P, 2, ...] tensor) both index the one tensor.
  The jnp references write through these (``.at[index].set``) and ``gather`` reads.
  """
  _ = slice(None)
  b, o, d = block, offset, head_size
  if layout in ("vllm", "asm"):
    value = (b, _, _, o) if layout == "vllm" else (b, _, o // x, _, o % x)
    return (b, _, _, o, _), value
  if layout == "flash":
    return (b, o), (b, o)
  if layout == "hnd":
    return (b, _, o), (b, _, o)
  if layout == "packed":
    lead = (b, _, o) if kv_layout == "HND" else (b, o, _)
    return lead + (slice(0, d),), lead + (slice(d, 2 * d),)
  if layout == "paged5d":
    if kv_layout == "HND":
      return (b, 0, _, o), (b, 1, _, o)
    return (b, 0, o), (b, 1, o)
  raise ValueError(f"unknown layout {layout!r}")


def paged5d_planes(block_size: int, num_heads: int, head_size: int,
                   kv_layout: str = "NHD") -> tuple[Plane, Plane]:
  """Planes of FlashInfer's single-tensor cache [P, 2, ps, H, D] (NHD) / [P, 2, H, ps, D] (HND)."""
  check_kv_layout(kv_layout)
  half = block_size * num_heads * head_size
  return (Plane(kv_layout, block_size, num_heads, head_size, base=0),
          Plane(kv_layout, block_size, num_heads, head_size, base=half))


@dataclasses.dataclass(frozen=True)
class PageRows:
  """Which row of a cache viewed as ``[rows, page_elems]`` holds the page of (layer, block):
  ``layer * layer_stride + block * block_stride + offset``.

  Stacked caches ``[L, nb, ...]``: ``PageRows(layer_stride=nb)``. The MAX collection
  ``[nb, 2, L, bs, H, D]`` viewed as ``[nb * 2L, bs * H * D]``: K ``PageRows(1, 2L)``, V
  ``PageRows(1, 2L, L)`` (:func:`max_rows`).
  """
  layer_stride: int
  block_stride: int = 1
  offset: int = 0

  def row(self, layer, block):
    """Row of (layer, block); int32 scalars or arrays."""
    return layer * self.layer_stride + block * self.block_stride + self.offset


def max_shape(num_blocks: int, num_layers: int, block_size: int, num_heads: int,
              head_size: int) -> tuple[int, ...]:
  """Shape of a MAX collection: ``[num_blocks, 2, num_layers, block_size, H, D]``."""
  return (num_blocks, 2, num_layers, block_size, num_heads, head_size)


def max_dims(cache_shape) -> tuple[int, int, int, int, int]:
  """(num_blocks, num_layers, block_size, num_heads, head_size) of a MAX collection's
  shape; ValueError unless it is ``[nb, 2, L, bs, H, D]``."""
  shape = tuple(cache_shape)
  if len(shape) != 6 or shape[1] != 2:
    raise ValueError(f"a MAX collection (layout 'max') is 6-D [num_blocks, 2, num_layers, "
                     f"block_size, num_heads, head_size], got shape {shape}")
  num_blocks, _, num_layers, block_size, num_heads, head_size = shape
  return num_blocks, num_layers, block_size, num_heads, head_size


def max_planes(block_size: int, num_heads: int, head_size: int) -> tuple[Plane, Plane]:
  """(key_plane, value_plane) of a MAX collection's pages: NHD ``[bs, H, D]`` each."""
  plane = Plane("NHD", block_size, num_heads, head_size)
  return plane, plane


def max_rows(num_layers: int) -> tuple[PageRows, PageRows]:
  """(key_rows, value_rows) of a MAX collection viewed as ``[nb * 2L, bs * H * D]``."""
  return (PageRows(1, 2 * num_layers, 0), PageRows(1, 2 * num_layers, num_layers))
