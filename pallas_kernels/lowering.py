"""The one module that decides how Pallas kernels are lowered.

Every kernel in this package calls :func:`pallas_call` instead of
``pl.pallas_call``. Today that lowers through Triton with explicit compiler
params (a bare ``pallas_call`` silently picks Triton too, but says nothing);
``interpret=True`` runs the same kernel body through Pallas' interpreter on
any device. Moving a kernel to Mosaic GPU later changes this module only.

Kernels use :func:`load` / :func:`store` (masked, gather/scatter indexing)
from here as well.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

load = pl_triton.load
store = pl_triton.store


def block_barrier(native: bool):
  """Orders the memory accesses of all threads of the program (``bar.sync``) where the
  kernel runs natively; the interpreter runs one program sequentially and needs none.
  Needed where a program stores to addresses its other threads have loaded: Triton
  spreads (and replicates) a vector over warps that do not wait for each other."""
  if native:
    pl_triton.debug_barrier()


def dot(a, b, trans_b: bool = False):
  """2-D matmul with float32 accumulation (exact float32 products for float32 inputs,
  not TF32)."""
  dims = (((1,), (1 if trans_b else 0,)), ((), ()))
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=jnp.float32)


def pallas_call(kernel, *, out_shape, grid, input_output_aliases, interpret: bool,
                num_warps: int = 4, num_stages: int = 1, name: str | None = None):
  """``pl.pallas_call`` with whole-array refs and Triton compiler params."""
  return pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      input_output_aliases=input_output_aliases,
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      name=name,
  )


def call_in_place(kernel, inputs, in_place, *, grid, interpret: bool, num_warps: int = 4,
                  num_stages: int = 1, name: str | None = None, new_outputs=()):
  """Runs ``kernel`` on the refs of ``(*inputs, *in_place)`` and then its outputs: first
  one per array of ``in_place``, aliased to it (updated in place when the caller donates
  it), then ``new_outputs`` (``jax.ShapeDtypeStruct`` each). The alias indices follow from
  the arguments, so adding an input cannot misplace them. Returns the outputs (a list)."""
  aliased = tuple(in_place)
  out_shape = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aliased) + tuple(
      new_outputs)
  return list(pallas_call(
      kernel, out_shape=out_shape, grid=grid,
      input_output_aliases={len(inputs) + i: i for i in range(len(aliased))},
      interpret=interpret, num_warps=num_warps, num_stages=num_stages, name=name,
  )(*inputs, *aliased))


def padded_columns(size: int, padded: int | None = None):
  """Column vectors of a ``[size]`` part padded to ``padded`` lanes (default: the next
  power of two): ``(clamped, raw, mask)``. ``clamped`` (for loads) keeps masked lanes in
  range; ``raw`` (for stores) gives them distinct columns past the part, which the
  interpreter drops or leaves alone and the GPU never touches. An unpadded part keeps
  plain iota columns and ``mask`` None, so Triton sees contiguous addresses and
  vectorizes."""
  padded = padded or 1 << max(size - 1, 0).bit_length()
  lanes = jax.lax.iota(jnp.int32, padded)
  if padded == size:
    return lanes, lanes, None
  ok = lanes < size
  return jnp.where(ok, lanes, 0), lanes, ok
