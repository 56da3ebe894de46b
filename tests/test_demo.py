import pytest

import jkv.__main__ as demo
from conftest import KERNEL

SMALL = ["--layers", "2", "--batch", "2", "--prompt", "4", "--steps", "6", "--heads", "2",
         "--head-size", "16", "--hidden", "32", "--vocab", "64", "--block-size", "8",
         "--backend", KERNEL]


def test_demo_decodes_and_checks_itself(capsys, monkeypatch):
  assert demo.main(SMALL) == 0
  out = capsys.readouterr().out
  assert "check         OK" in out and "tokens/s" in out and "bytes" in out
  assert "layout vllm, quant tensor, kv_cache_dtype auto" in out
  monkeypatch.setitem(demo.BOUNDS, "float", -1.0)     # no difference passes: a mismatch
  assert demo.main(SMALL) == 1
  assert "check         MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--steps", "--prompt", "--batch", "--block-size"])
def test_demo_rejects_sizes_below_one(flag, capsys):
  with pytest.raises(SystemExit) as exit_info:
    demo.main(SMALL + [flag, "0"])
  assert exit_info.value.code == 2
  assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
