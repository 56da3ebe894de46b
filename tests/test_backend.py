import jax
import pytest

from jkv import backend


def test_resolve(monkeypatch):
  monkeypatch.delenv("JKV_BACKEND", raising=False)
  expected = "pallas" if jax.default_backend() == "gpu" else "reference"
  assert backend.resolve("auto") == expected
  for name in ("pallas", "interpret", "reference"):
    assert backend.resolve(name) == name
  with pytest.raises(ValueError, match="backend must be one of"):
    backend.resolve("triton")


def test_env_overrides_auto_only(monkeypatch):
  monkeypatch.setenv("JKV_BACKEND", "interpret")
  assert backend.resolve("auto") == "interpret"
  assert backend.resolve("reference") == "reference"
  monkeypatch.setenv("JKV_BACKEND", "bogus")
  with pytest.raises(ValueError, match=r"\$JKV_BACKEND must be one of"):
    backend.resolve("auto")


def test_unsupported_case(monkeypatch):
  monkeypatch.setenv("JKV_BACKEND", "pallas")
  assert backend.resolve("auto", kernel_supported=False) == "reference"
  with pytest.raises(NotImplementedError):
    backend.resolve("pallas", kernel_supported=False)


class _Device:
  def __init__(self, platform, compute_capability=None):
    self.platform, self.compute_capability = platform, compute_capability


@pytest.mark.parametrize("device,runs", [
    (_Device("gpu", "9.0"), True),     # H100 / H200
    (_Device("gpu", "8.0"), False),    # A100: no TMA / wgmma
    (_Device("gpu", "10.0"), False),   # Blackwell: no wgmma (the kernels were not written
                                       # for it)
    (_Device("cpu"), True)])           # Pallas' GPU interpreter, or lowering for CUDA
def test_mosaic_kernels_only_where_they_compile(monkeypatch, device, runs):
  from pallas_kernels import lowering
  monkeypatch.setattr(jax, "devices", lambda *a: [device])
  lowering._device_runs_mosaic.cache_clear()
  try:
    assert lowering._device_runs_mosaic() is runs
    if not runs:   # every Mosaic kernel's supported() then refuses; auto picks Triton
      assert not lowering.mosaic_available()
      assert backend.lowering("auto", mosaic_supported=lowering.mosaic_available(),
                              mosaic_first=True) == "triton"
  finally:
    lowering._device_runs_mosaic.cache_clear()


def test_interpreted_mosaic_kernels_warn_when_the_cpu_pool_may_hang_them(monkeypatch):
  """Pallas' GPU interpreter runs each warpgroup as an XLA program beside its caller: a
  pool of fewer threads than warpgroups + 1 may hang it, and says so."""
  import warnings

  from pallas_kernels import lowering
  assert lowering.mosaic_interpret(False, 3) is False   # compiled: no interpreter
  if not lowering.mosaic_available():
    pytest.skip("Pallas' GPU interpreter needs jax >= 0.11.2")
  monkeypatch.delenv("NPROC", raising=False)
  monkeypatch.setenv("PJRT_NPROC", "3")
  assert lowering.cpu_client_threads() == 3
  with pytest.warns(RuntimeWarning, match="3 warpgroups .* 3 threads"):
    lowering.mosaic_interpret(True, 3)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    lowering.mosaic_interpret(True, 2)   # 3 threads: the caller and 2 warpgroups
    lowering.mosaic_interpret(True, 1)   # one warpgroup runs inside its caller
  monkeypatch.delenv("PJRT_NPROC")
  monkeypatch.setenv("NPROC", "5")
  assert lowering.cpu_client_threads() == 5
  monkeypatch.delenv("NPROC")
  assert lowering.cpu_client_threads() >= 1
