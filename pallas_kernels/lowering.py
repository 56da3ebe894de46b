"""The one module that decides how Pallas kernels are lowered.

Triton: every kernel calls :func:`pallas_call` / :func:`call_in_place` instead of
``pl.pallas_call`` (explicit Triton compiler params; a bare ``pallas_call`` silently picks
Triton too, but says nothing) and uses :func:`load` / :func:`store` (masked,
gather/scatter indexing). ``interpret=True`` runs the same kernel body through Pallas'
interpreter on any device. Pallas Triton is deprecated since jax 0.11.0;
:func:`triton_available` says whether this JAX still has it.

Mosaic GPU: :func:`mosaic_in_place` runs a ``plgpu.kernel`` over refs of the arrays it
updates (jax >= 0.11.2, :func:`mosaic_available`); ``interpret=True`` runs it in Pallas'
GPU interpreter (:func:`mosaic_interpret`).
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:   # deprecated since jax 0.11.0; a JAX without it runs the Mosaic GPU kernels only
  from jax.experimental.pallas import triton as pl_triton
except ImportError:   # pragma: no cover - every JAX tested still has it
  pl_triton = None

load = getattr(pl_triton, "load", None)
store = getattr(pl_triton, "store", None)


def triton_available() -> bool:
  """Whether this JAX still has Pallas' Triton back end."""
  return pl_triton is not None


def block_barrier(native: bool):
  """Orders the memory accesses of all threads of the program (``bar.sync``) where the
  kernel runs natively; the interpreter runs one program sequentially and needs none.
  Needed where a program stores to addresses its other threads have loaded: Triton
  spreads (and replicates) a vector over warps that do not wait for each other."""
  if native:
    pl_triton.debug_barrier()


# float32 -> int8 four at a time: toward zero (NaN -> 0, saturated to the int32 range),
# floored at -127, then saturated to [-128, 127] and packed into one register.
_INT8_TOWARD_ZERO_PTX = """{
.reg .s32 t<4>;
cvt.rzi.s32.f32 t0, $1;
cvt.rzi.s32.f32 t1, $2;
cvt.rzi.s32.f32 t2, $3;
cvt.rzi.s32.f32 t3, $4;
max.s32 t0, t0, -127;
max.s32 t1, t1, -127;
max.s32 t2, t2, -127;
max.s32 t3, t3, -127;
cvt.pack.sat.s8.s32.b32 t2, t3, t2, 0;
cvt.pack.sat.s8.s32.b32 $0, t1, t0, t2;
}"""


def int8_toward_zero(y):
  """float32 y -> int8 as :func:`jkv.quant.round_to_dtype` (toward zero, clamped to +-127,
  NaN -> 0), in the hardware's conversions (compiled Triton kernels only). JAX's own cast
  selects NaN and clamps before a conversion per value and packs the bytes after (INT8
  per-block flash write: 95 registers a thread against 80, static SASS for sm_90a)."""
  [result] = pl_triton.elementwise_inline_asm(
      _INT8_TOWARD_ZERO_PTX, args=[y.astype(jnp.float32)], constraints="=r,f,f,f,f", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, jnp.int8)])
  return result


_ABS_OR_NAN_PTX = "{ .reg .f32 a; abs.f32 a, $1; fma.rn.f32 $0, $1, 0f00000000, a; }"


def abs_or_nan(x):
  """float32 x -> |x| where x is finite, NaN where not, in one instruction a value
  (``x * 0 + |x|``, a fused multiply-add; compiled Triton kernels only)."""
  [result] = pl_triton.elementwise_inline_asm(
      _ABS_OR_NAN_PTX, args=[x.astype(jnp.float32)], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return result


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


# ---- Mosaic GPU --------------------------------------------------------------------------

try:   # Pallas' Mosaic GPU back end as this module uses it: jax >= 0.11.2
  from jax.experimental.pallas import mosaic_gpu as plgpu
  _MOSAIC = hasattr(jax, "new_ref") and hasattr(plgpu, "InterpretGPUParams")
except ImportError:   # pragma: no cover - every supported jax has the module
  plgpu, _MOSAIC = None, False


MOSAIC_SEMANTICS = plgpu.LoweringSemantics.Lane if _MOSAIC else None


def mosaic_available() -> bool:
  """Whether the ``mosaic`` kernels can run here: this JAX has the Mosaic GPU kernel API they
  use (``plgpu.kernel`` over refs, and its GPU interpreter: jax >= 0.11.2), and JAX's
  default device is not a GPU they cannot compile for (they are written for Hopper: TMA and
  wgmma, compute capability 9.x). On a CPU they run in Pallas' GPU interpreter, or lower
  for CUDA."""
  return _MOSAIC and _device_runs_mosaic()


@functools.cache
def _device_runs_mosaic() -> bool:
  device = jax.devices()[0]
  return device.platform != "gpu" or str(getattr(device, "compute_capability", "")).startswith(
      "9")


def cpu_client_threads() -> int:
  """The threads of each of XLA's CPU client pools, as XLA sizes them when the client starts
  (``DefaultThreadPoolSize``): ``$PJRT_NPROC``, else ``$NPROC``, else one per CPU this
  process may run on."""
  for name in ("PJRT_NPROC", "NPROC"):
    value = os.environ.get(name, "").strip()
    if value.isdigit():
      return int(value)
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
      os.cpu_count() or 1)


def mosaic_interpret(interpret: bool, warpgroups: int = 1):
  """``plgpu.kernel``'s ``interpret=`` for a kernel of ``warpgroups`` warpgroups a program:
  Pallas' GPU interpreter params when ``interpret``, else False.

  The interpreter runs each warpgroup of a program as its own XLA program, started from a
  host callback of the calling one, and the warpgroups wait on each other's barriers. XLA
  may run each of them on its CPU client's execute pool, where the caller already holds a
  thread: with fewer than ``warpgroups + 1`` threads there, a warpgroup may never start and
  the kernel hangs (jax 0.12.0.1, 2 cores, ``pytest -n 2``: the 2-warpgroup ragged prefill
  hung once in a loop of the Mosaic tests; a 4-warpgroup variant hung in 3 of 3 runs and
  passed 6 of 6 with ``PJRT_NPROC=16``). Warns when the pool looks that small."""
  if not interpret:
    return False
  threads = cpu_client_threads()
  if warpgroups > 1 and threads < warpgroups + 1:
    warnings.warn(
        f"Pallas' GPU interpreter runs this kernel's {warpgroups} warpgroups as "
        f"{warpgroups} XLA programs beside their caller, and XLA's CPU pool has "
        f"{threads} threads here: it may hang. Set PJRT_NPROC={max(8, warpgroups + 1)} "
        "before JAX starts (see pallas_kernels/lowering.py).", RuntimeWarning, stacklevel=2)
  return plgpu.InterpretGPUParams()


def mosaic_in_place(kernel, inputs, in_place, *, grid: int, scratch, interpret: bool,
                    name: str):
  """Runs a Mosaic GPU ``kernel`` over a 1-D grid (axis name ``"program"``, one warpgroup per
  program) on the refs of ``inputs`` (read from global memory), then of ``in_place``, then
  of ``scratch`` (``plgpu.SMEM`` / ``plgpu.Barrier`` types). Each ``in_place`` array is
  wrapped in a ref the kernel writes (``jax.new_ref``): the custom call aliases it, so a
  donated array is updated in place. Returns the ``in_place`` arrays after the kernel.
  ``interpret``: Pallas' GPU interpreter (any device)."""
  if not _MOSAIC:
    raise NotImplementedError("the Mosaic GPU kernels need jax >= 0.11.2 (jax.new_ref and "
                              f"Pallas' GPU interpreter); this is jax {jax.__version__}")
  refs = [jax.new_ref(a) for a in in_place]
  params = plgpu.CompilerParams(lowering_semantics=MOSAIC_SEMANTICS)
  plgpu.kernel(
      kernel, out_type=(), grid=(grid,), grid_names=("program",), scratch_types=scratch,
      compiler_params=params, interpret=mosaic_interpret(interpret),
      kernel_name=name,
  )(*inputs, *refs)
  return [ref[...] for ref in refs]
