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

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

load = pl_triton.load
store = pl_triton.store


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
