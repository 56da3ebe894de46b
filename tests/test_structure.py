"""The house rules of the package's imports (issue 25), checked on the source.

* No module in ``jkv`` or ``pallas_kernels`` uses another module's private names (a
  leading underscore), by ``from m import _name`` or ``m._name``: what several modules
  share is public in one place (:mod:`pallas_kernels.common`, :mod:`jkv.formats`).
* No kernel module imports :mod:`jkv.reference`: kernels and references are twins that
  share formats, never code paths.
* Only :mod:`jkv.ops` imports the kernels: back-end dispatch lives there, and the cache
  pytrees call the ops.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jkv", "pallas_kernels")
MODULES = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def _imports(tree):
  """(line, module, names, local names bound) of every import statement."""
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.level == 0:
      yield (node.lineno, node.module, [a.name for a in node.names],
             [a.asname or a.name for a in node.names])
    elif isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name, [], [alias.asname or alias.name.split(".")[0]]


def _violations(source: str, name: str):
  """The rule breaks in module ``name`` (its path under the repository) of ``source``."""
  tree = ast.parse(source, filename=name)
  found, imported = [], set()
  for line, module, names, bound in _imports(tree):
    imported.update(bound)
    if module == "__future__":
      continue
    found += [f"{name}:{line} imports {module}.{n}" for n in names if _private(n)]
    to_reference = module.startswith("jkv.reference") or (module == "jkv" and "reference" in names)
    if name.startswith("pallas_kernels/") and to_reference:
      found.append(f"{name}:{line} (a kernel) imports {module}")
    if (name.startswith("jkv/") and not name.startswith("jkv/ops/")
        and module.split(".")[0] == "pallas_kernels"):
      found.append(f"{name}:{line} imports {module} outside jkv/ops")
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and _private(node.attr)
        and isinstance(node.value, ast.Name) and node.value.id in imported):
      found.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
  return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_imports_follow_the_house_rules(path):
  assert _violations(path.read_text(), path.relative_to(ROOT).as_posix()) == []


def test_the_checker_catches_each_rule():
  """The checker itself: each rule on a module that breaks it."""
  source = ("from pallas_kernels.write import _hidden\nfrom jkv.reference import mla\n"
            "from pallas_kernels import common\nx = common._secret\n")
  found = _violations(source, "pallas_kernels/probe.py")
  assert len(found) == 3, found
  assert any("write._hidden" in f for f in found)
  assert any("(a kernel) imports jkv.reference" in f for f in found)
  assert any("common._secret" in f for f in found)
  found = _violations("from pallas_kernels import write\n", "jkv/cache.py")
  assert found == ["jkv/cache.py:1 imports pallas_kernels outside jkv/ops"]
  assert _violations("from pallas_kernels import write\n", "jkv/ops/write.py") == []


# Exported functions that are not ops on cache data: they describe shardings or shapes, or
# move whole caches between devices and files.
NOT_OPS = {"cache_partition_spec", "cache_sharding", "shard_cache", "fp4_cache_shapes", "save",
           "load", "save_sharded", "load_sharded"}
# jkv.pages functions the ops and references build on (not exported from jkv).
BUILDING_BLOCKS = {"count_at_most", "inclusive_sum", "table_positions", "gather_sources",
                   "check_indptr"}


def test_every_public_op_and_helper_takes_backend():
  import inspect

  import jkv
  from jkv import pages, transcode

  functions = {name: getattr(jkv, name) for name in jkv.__all__}
  functions.update({f"pages.{name}": getattr(pages, name) for name in dir(pages)
                    if not name.startswith("_") and inspect.getmodule(getattr(pages, name))
                    is pages and name not in BUILDING_BLOCKS})
  functions.update({f"transcode.{name}": getattr(transcode, name)
                    for name in ("to_canonical", "from_canonical", "transcode")})
  missing = [name for name, fn in sorted(functions.items())
             if inspect.isfunction(fn) and name not in NOT_OPS
             and "backend" not in inspect.signature(fn).parameters]
  assert missing == []
