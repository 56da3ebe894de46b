"""Block copy kernel: ``dst[d] = src[s]`` for ``(s, d)`` pairs, over many arrays in one launch.

Every array is viewed as ``[rows, block_elems]``; a block of layer ``l`` with index ``i``
is row ``l * layer_stride + i * index_stride`` (caches ``[L, nb, ...]``: strides
``(nb, 1)``; a staging buffer ``[P, L, ...]``: ``(1, L)``). The grid is
``(pairs, layers, chunks)``; a program copies one ``chunk``-element piece of one block of
one layer for every array (so K, V and their scales move in the same program). Pairs
with a negative destination are skipped. The destination arrays are aliased to the
outputs (``input_output_aliases``) and may live in ``pinned_host`` memory: the GPU then
reads or writes host memory directly (zero-copy), which is how ``swap_blocks`` moves
scattered blocks between device and host at DMA speed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common, lowering

# Dtypes copied as they are; any other (every float dtype) is copied through an unsigned
# integer view of the same width, so its bits move unchanged (XLA:CPU, and with it the
# interpreter, would canonicalize NaN payloads of loaded / stored floats).
_NATIVE = tuple(np.dtype(d) for d in (jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.int32,
                                      jnp.uint32))
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@dataclasses.dataclass(frozen=True)
class Rows:
  """Where block ``i`` of layer ``l`` lives: row ``l * layer_stride + i * index_stride``."""
  layer_stride: int
  index_stride: int


def copyable_view(array, rows: int):
  """``array`` as ``[rows, elems]`` in a dtype Triton can copy (same bytes)."""
  view = array.reshape(rows, -1)
  if np.dtype(view.dtype) not in _NATIVE:
    if view.dtype.itemsize not in _UNSIGNED:
      raise TypeError(f"cannot copy blocks of dtype {view.dtype}")
    view = lax.bitcast_convert_type(view, _UNSIGNED[view.dtype.itemsize])
  return view


def restore(view, like_shape, like_dtype):
  if view.dtype != like_dtype:
    view = lax.bitcast_convert_type(view, like_dtype)
  return view.reshape(like_shape)


def _kernel(src_index_ref,    # int32 [N]: source block of pair p
            dst_index_ref,    # int32 [N]: destination block (< 0: skipped)
            use_staged_ref,   # int32 [N]: 1 where the source is the staging buffer
            *refs,            # per array: sources [rows, elems] (absent when copying
                              # within the destinations), staged [rows, elems] (absent
                              # without staging), destinations, outputs (aliased to them)
            num_arrays, has_srcs, elems, chunk, src_rows, staged_rows, dst_rows,
            dst_row_count):
  """Program (pair p, layer l, column chunk): ``chunk`` elements of block ``src[p]`` of
  layer l copied to block ``dst[p]`` of every array (a row each, :class:`Rows`)."""
  outs = refs[-num_arrays:]
  srcs = refs[:num_arrays] if has_srcs else refs[-2 * num_arrays:-num_arrays]
  first_staged = num_arrays if has_srcs else 0
  staged = refs[first_staged:first_staged + num_arrays] if staged_rows is not None else None
  pair, layer, piece = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  dst_index = dst_index_ref[pair]
  cols = piece * chunk + lax.iota(jnp.int32, chunk)
  dst_row = layer * dst_rows.layer_stride + dst_index * dst_rows.index_stride

  def copy_from(sources, rows: Rows, index):
    src_row = layer * rows.layer_stride + index * rows.index_stride
    for src, out, n in zip(sources, outs, elems):
      def copy(src=src, out=out, n=n):
        if n % chunk:
          ok = cols < n
          # Masked lanes point one row past the array (the interpreter drops them).
          x = lowering.load(src.at[jnp.full((chunk,), src_row), jnp.where(ok, cols, 0)], mask=ok)
          lowering.store(out.at[jnp.where(ok, dst_row, dst_row_count), jnp.where(ok, cols, 0)],
                         x, mask=ok)
        else:
          x = lowering.load(src.at[jnp.full((chunk,), src_row), cols])
          lowering.store(out.at[jnp.full((chunk,), dst_row), cols], x)
      if n < max(elems):          # this array's blocks are shorter: skip its empty pieces
        pl.when(piece * chunk < n)(copy)
      else:
        copy()

  if staged is None:
    pl.when(dst_index >= 0)(lambda: copy_from(srcs, src_rows, src_index_ref[pair]))
  else:
    use_staged = use_staged_ref[pair] != 0
    pl.when((dst_index >= 0) & ~use_staged)(
        lambda: copy_from(srcs, src_rows, src_index_ref[pair]))
    pl.when((dst_index >= 0) & use_staged)(lambda: copy_from(staged, staged_rows, pair))


def copy_rows(srcs, dsts, src_index, dst_index, *, num_layers: int, src_rows: Rows,
              dst_rows: Rows, interpret: bool, staged=None, staged_rows: Rows | None = None,
              use_staged=None, fresh_rows: int | None = None, chunk: int | None = None,
              num_warps: int = 4):
  """``dst[row(l, dst_index[p])] = src[row(l, src_index[p])]`` for every array, layer
  ``l < num_layers`` and pair ``p`` with ``dst_index[p] >= 0``.

  srcs, dsts: lists of ``[rows, elems]`` views (:func:`copyable_view`), ``dsts[a]`` with
    the dtype and ``elems`` of ``srcs[a]``. dsts are updated in place (aliased).
    ``srcs=None``: copy within the dsts (each array passed once: an array that is both a
    plain and an aliased operand would make XLA copy it first); sources that are also
    destinations must come from ``staged``.
    ``dsts=None``: the outputs are new ``[fresh_rows, elems]`` arrays whose rows not
    written hold whatever the allocator left there (a staging buffer).
  staged, staged_rows, use_staged: optional second sources (a staging buffer, rows
    ``staged_rows``): pair ``p`` with ``use_staged[p] != 0`` copies block ``p`` of them
    instead of its source block.
  src_index, dst_index, use_staged: int32 [P]; every used index must be in range.
  chunk: elements per program (a power of two); None: up to 4096.
  Returns the updated dsts.
  """
  has_srcs = srcs is not None
  srcs = list(srcs if has_srcs else dsts)
  elems = tuple(int(s.shape[1]) for s in srcs)
  chunk = chunk or min(4096, common.next_pow2(max(elems)))
  staged = list(staged or [])
  if use_staged is None:
    use_staged = jnp.zeros_like(dst_index)
  if dsts is None:
    out_shape = tuple(jax.ShapeDtypeStruct((fresh_rows, n), s.dtype) for s, n in zip(srcs, elems))
    aliases, dsts = {}, []
  else:
    out_shape = tuple(jax.ShapeDtypeStruct(d.shape, d.dtype) for d in dsts)
    aliases = {3 + len(srcs) * has_srcs + len(staged) + i: i for i in range(len(dsts))}
  kernel = functools.partial(
      _kernel, num_arrays=len(srcs), has_srcs=has_srcs, elems=elems, chunk=chunk, src_rows=src_rows,
      staged_rows=staged_rows if staged else None, dst_rows=dst_rows,
      dst_row_count=int(out_shape[0].shape[0]))
  return lowering.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(int(src_index.shape[0]), num_layers, pl.cdiv(max(elems), chunk)),
      input_output_aliases=aliases,
      interpret=interpret,
      num_warps=num_warps,
      name="jkv_copy_blocks",
  )(src_index.astype(jnp.int32), dst_index.astype(jnp.int32), use_staged.astype(jnp.int32),
    *(srcs if has_srcs else []), *staged, *dsts)
