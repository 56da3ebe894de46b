"""Pictures of benchmarks/RESULTS.md: one PNG per section, every row as a bar of its
'of ceiling' fraction (jkv's kernels, jkv's references, the peers: each its own colour).

    python benchmarks/plot.py [--results benchmarks/RESULTS.md] [--out benchmarks/plots]

The figures are drawn from the tables ``benchmarks/run.py`` writes (never typed in);
``run.py --results`` redraws them after each run when matplotlib is installed
(``pip install ".[bench]"``). Rows without a fraction (time-only rows) are left out.
"""

from __future__ import annotations

import argparse
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent
SECTION = re.compile(r"<!-- section: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- end: (?P=name) -->",
                     re.S)
RUN = re.compile(r"Run on (?P<date>[\d-]+): device \*\*(?P<device>[^*]+)\*\*")


def sections(text: str):
  """{name: (title, run line, rows)} with rows (case, implementation, fraction)."""
  out = {}
  for match in SECTION.finditer(text):
    body = match["body"]
    title = next((line[3:] for line in body.splitlines() if line.startswith("## ")),
                 match["name"])
    run = RUN.search(body)
    rows = []
    for line in body.splitlines():
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if len(cells) != 5 or cells[0] in ("case", "---"):
        continue
      try:
        fraction = float(cells[4])
      except ValueError:
        continue
      rows.append((cells[0], cells[1], fraction))
    if rows:
      out[match["name"]] = (title, f"{run['device']}, {run['date']}" if run else "", rows)
  return out


def kind(implementation: str) -> str:
  """'jkv' (a jkv kernel or op), 'reference' (jkv's jnp twin / XLA) or 'peer'."""
  name = implementation.lower()
  if "reference" in name or name.startswith("xla") or "jnp" in name:
    return "reference"
  if name.startswith(("jkv", "paged_attention_decode")) or "pallas" in name:
    return "jkv"
  return "peer"


COLOURS = {"jkv": "#1f77b4", "reference": "#ff7f0e", "peer": "#2ca02c"}


def plot_section(name: str, title: str, run: str, rows, out_dir: pathlib.Path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  labels = [f"{case} | {implementation}" if len(case) + len(implementation) < 48
            else f"{case}\n{implementation}" for case, implementation, _ in rows]
  height = 1.2 + 0.3 * len(rows)
  figure, axes = plt.subplots(figsize=(12, height))
  positions = list(range(len(rows)))[::-1]
  axes.barh(positions, [f for _, _, f in rows],
            color=[COLOURS[kind(impl)] for _, impl, _ in rows])
  for y, (_, _, fraction) in zip(positions, rows):
    axes.text(fraction + 0.01, y, f"{fraction:.2f}", va="center", fontsize=7)
  axes.set_yticks(positions, labels, fontsize=7)
  axes.set_xlim(0, max(1.05, max(f for _, _, f in rows) + 0.1))
  axes.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
  axes.set_xlabel("fraction of the ceiling measured in the same run (see RESULTS.md)")
  axes.set_title(f"{title}\n{run}", fontsize=9)
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
  axes.legend(handles, ["jkv", "jkv reference / XLA", "peers"], fontsize=7,
              loc="lower right")
  figure.tight_layout()
  path = out_dir / f"{name}.png"
  figure.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(figure)
  return path


def write_plots(results: pathlib.Path, out_dir: pathlib.Path, names=None):
  """A PNG per section of ``results`` (or of ``names``) in ``out_dir``; returns the paths."""
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = []
  for name, (title, run, rows) in sections(results.read_text()).items():
    if names is None or name in names:
      paths.append(plot_section(name, title, run, rows, out_dir))
  return paths


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--results", default=str(ROOT / "RESULTS.md"))
  parser.add_argument("--out", default=str(ROOT / "plots"))
  args = parser.parse_args(argv)
  for path in write_plots(pathlib.Path(args.results), pathlib.Path(args.out)):
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
