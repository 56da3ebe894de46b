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


def resolve(backend: str = "auto", *, kernel_supported: bool = True) -> str:
  """Returns ``"pallas"``, ``"interpret"`` or ``"reference"``.

  ``kernel_supported=False`` says the op has no kernel for this case: ``auto``
  then falls back to the reference, and an explicit kernel back end raises.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  explicit = backend != "auto"
  if backend == "auto":
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
      if env not in BACKENDS:
        raise ValueError(f"${ENV_VAR} must be one of {BACKENDS}, got {env!r}")
      backend = env
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
