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
