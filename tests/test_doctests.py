"""The examples in the docstrings run (doctest) and every public op has one."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

import jkv


def _modules():
  names = ["jkv"] + [m.name for m in pkgutil.walk_packages(jkv.__path__, "jkv.")
                     if not m.name.startswith("jkv.__main__")]
  return [importlib.import_module(name) for name in names]


def _examples():
  finder = doctest.DocTestFinder(exclude_empty=True)
  tests = {}
  for module in _modules():
    for test in finder.find(module):
      if test.examples:
        tests.setdefault(test.name, test)   # a re-exported object: once
  return sorted(tests.values(), key=lambda t: t.name)


EXAMPLES = _examples()


@pytest.mark.parametrize("test", EXAMPLES, ids=lambda t: t.name)
def test_docstring_example(test):
  runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
  output = []
  runner.run(test, out=output.append, clear_globs=True)
  assert runner.failures == 0, "".join(output)


def test_every_public_op_has_an_example():
  missing = [name for name in jkv.__all__ if inspect.isfunction(getattr(jkv, name))
             and "backend" in inspect.signature(getattr(jkv, name)).parameters
             and ">>>" not in (getattr(jkv, name).__doc__ or "")]
  assert missing == []
