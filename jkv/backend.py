"""The one place that chooses a back end.

``backend`` on every op (static):

* ``"pallas"``    the compiled Pallas kernel (GPU).
* ``"interpret"`` the same kernel through Pallas' interpreter (any device; for tests).
* ``"reference"`` the pure-jnp twin in :mod:`jkv.reference`.
* ``"auto"``      ``$JKV_BACKEND`` if set, else ``"pallas"`` when JAX's default
  back end is a GPU and the kernel supports the case, else ``"reference"``.
"""

from __future__ import annotations

import os

import jax

BACKENDS = ("auto", "pallas", "interpret", "reference")
ENV_VAR = "JKV_BACKEND"


def _from_env(var: str, choices) -> str:
  """``$var`` (one of ``choices``), or ``"auto"`` when unset or empty."""
  value = os.environ.get(var, "").strip() or "auto"
  if value not in choices:
    raise ValueError(f"${var} must be one of {choices}, got {value!r}")
  return value


def resolve(backend: str = "auto", *, kernel_supported: bool = True) -> str:
  """Returns ``"pallas"``, ``"interpret"`` or ``"reference"``.

  ``kernel_supported=False`` says the op has no kernel for this case: ``auto``
  then falls back to the reference, and an explicit kernel back end raises.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  explicit = backend != "auto"
  if backend == "auto":
    backend = _from_env(ENV_VAR, BACKENDS)
  if backend == "auto":
    backend = "pallas" if jax.default_backend() == "gpu" else "reference"
  if backend in ("pallas", "interpret") and not kernel_supported:
    if not explicit:
      return "reference"
    raise NotImplementedError("no Pallas kernel for this case; use backend='reference' or 'auto'")
  return backend


def jnp_only(backend: str = "auto") -> None:
  """Checks ``backend`` for a helper that has no kernel (page tables, transcoding, head
  repeats): ``"auto"`` / ``"reference"`` run its jnp code; ``"pallas"`` / ``"interpret"``
  raise ``NotImplementedError``, as an op does for a case its kernel lacks."""
  resolve(backend, kernel_supported=False)


def hopper() -> bool:
  """Whether JAX's default device is a Hopper GPU (compute capability 9.x: H100 / H200)."""
  device = jax.devices()[0]
  return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


LOWERINGS = ("auto", "triton", "mosaic")
LOWERING_ENV_VAR = "JKV_LOWERING"


def lowering(lowering: str = "auto", *, mosaic_supported: bool, mosaic_first: bool = False,
             triton_available: bool = True, kernel: bool = True) -> str:
  """Which Pallas lowering runs a kernel back end: ``"triton"`` or ``"mosaic"`` (Mosaic GPU).

  ``lowering`` (static): ``"triton"``, ``"mosaic"``, or ``"auto"``: ``$JKV_LOWERING`` if
  set, else Mosaic GPU where the op has a Mosaic kernel for the case
  (``mosaic_supported``) and it is the measured faster one on this device
  (``mosaic_first``) or this JAX has no Pallas Triton (``triton_available`` False); else
  Triton. An op without a Mosaic kernel for the case runs Triton under
  ``$JKV_LOWERING=mosaic`` (and raises ``NotImplementedError`` when ``lowering="mosaic"``
  is passed to it). ``kernel=False`` (the op runs its reference): only checks the
  argument, and returns it.
  """
  if lowering not in LOWERINGS:
    raise ValueError(f"lowering must be one of {LOWERINGS}, got {lowering!r}")
  if not kernel:
    return lowering
  if lowering == "mosaic" and not mosaic_supported:
    raise NotImplementedError("no Mosaic GPU kernel for this case (it needs jax >= 0.11.2, the "
                              "op's supported layouts / dtypes and, interpreted, one device); "
                              "use lowering='triton'")
  if lowering == "auto":
    lowering = _from_env(LOWERING_ENV_VAR, LOWERINGS)
  if lowering == "auto":
    use_mosaic = mosaic_supported and (mosaic_first or not triton_available)
    lowering = "mosaic" if use_mosaic else "triton"
  if lowering == "mosaic" and not mosaic_supported:
    lowering = "triton"
  if lowering == "triton" and not triton_available:
    raise NotImplementedError("this JAX has no Pallas Triton back end; use lowering='mosaic' "
                              "where the op has a Mosaic GPU kernel, or backend='reference'")
  return lowering
