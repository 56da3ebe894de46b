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
