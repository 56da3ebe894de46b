import jkv.__main__ as demo
from conftest import KERNEL


def test_demo_runs_and_checks_itself(capsys):
  assert demo.main(["--steps", "12", "--layers", "2", "--batch", "3", "--backend", KERNEL]) == 0
  out = capsys.readouterr().out
  assert "read back     OK" in out and "steps/s" in out and "cache bytes" in out
