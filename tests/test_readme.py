from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  ci = (ROOT / ".ci" / "run").read_text()
  command = [line for line in ci.splitlines() if line.startswith("python3 -m venv")]
  assert len(command) == 1 and command[0] in readme
  assert 'pip install ".[test]"' in command[0] and "pytest" in command[0]
  assert "pip install . && python -m jkv" in readme


def test_quickstart_runs():
  readme = (ROOT / "README.md").read_text()
  code = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
  namespace = {}
  exec(compile(code, "README quickstart", "exec"), namespace)
  k = namespace["k"]
  assert k.shape == (2, 64, 8, 128)
  assert float(k[1, 5].astype(float).sum()) == 8 * 128  # the written token
  assert not k[1, 6:].any()
