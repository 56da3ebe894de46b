"""The one way jkv's pytrees are declared: frozen dataclasses whose fields are array data,
except those made with :func:`static` (layout names, sizes, dtypes: pytree metadata)."""

from __future__ import annotations

import dataclasses

import jax


def static(**kwargs):
  """A static (metadata) field: part of the pytree structure, not a leaf."""
  return dataclasses.field(metadata={"static": True}, **kwargs)


def fields(obj_or_cls) -> tuple[list[str], list[str]]:
  """(array field names, static field names) of a :func:`dataclass` pytree."""
  all_fields = dataclasses.fields(obj_or_cls)
  return ([f.name for f in all_fields if not f.metadata.get("static")],
          [f.name for f in all_fields if f.metadata.get("static")])


def dataclass(cls):
  """A frozen dataclass registered with ``jax.tree_util.register_dataclass``."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  data, meta = fields(cls)
  return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
