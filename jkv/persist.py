"""Saving and loading jkv pytrees (caches, PagePool): arrays, static fields, a checksum.

    jkv.save("cache.npz", cache)
    cache = jkv.load("cache.npz")                  # or load(path, like=template)

The file holds each array field as raw bytes (so FP8, E8M0 and other ml_dtypes types
round-trip exactly, NaN payloads and -0 included) with its dtype and shape, and one JSON
header: format version, cache class, static fields, array specs and a SHA-256 over the
header and every array's bytes. ``load`` refuses, with a ``ValueError`` naming what is
wrong, files that are not jkv caches, of another format version or class, whose
checksum does not match (corrupted or edited), whose arrays disagree with the header,
or, given ``like=``, whose class, static fields, shapes or dtypes differ from the template.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

from jkv import pytree

FORMAT = "jkv-cache"
VERSION = 1
_HEADER = "__jkv_header__"


def _classes():
  from jkv import cache, page_pool  # the pytrees import the ops; resolve lazily
  return {cls.__name__: cls for cls in (cache.PagedKVCache, cache.ContiguousKVCache,
                                        page_pool.PagePool)}


def _nested_classes():
  """Pytrees that may sit in a field (stored as ``field.subfield`` arrays)."""
  from jkv import prefix_index
  return {"PrefixIndex": prefix_index.PrefixIndex}


def _flat_arrays(obj) -> tuple[dict, dict]:
  """({name: array or None}, {field: nested class name}): array fields, a nested pytree's
  own arrays named ``field.subfield``."""
  arrays, nested = {}, {}
  for field in pytree.fields(obj)[0]:
    value = getattr(obj, field)
    if type(value).__name__ in _nested_classes():
      nested[field] = type(value).__name__
      for sub in pytree.fields(value)[0]:
        arrays[f"{field}.{sub}"] = getattr(value, sub)
    else:
      arrays[field] = value
  return arrays, nested


def _static_json(value):
  if isinstance(value, np.dtype):
    return {"dtype": value.name}
  return value


def _static_value(value):
  if isinstance(value, dict) and set(value) == {"dtype"}:
    return np.dtype(jnp.dtype(value["dtype"]))
  return value


def _digest(header_without_checksum: dict, blobs: dict) -> str:
  h = hashlib.sha256(json.dumps(header_without_checksum, sort_keys=True).encode())
  for name in sorted(blobs):
    h.update(name.encode())
    h.update(blobs[name].tobytes())
  return h.hexdigest()


def save(path, cache) -> None:
  """Writes ``cache`` (a jkv cache pytree) to ``path`` (a ``.npz`` file; written whole to a
  temporary file first, then renamed, so a crash never leaves half a file)."""
  classes = _classes()
  name = type(cache).__name__
  if classes.get(name) is not type(cache):
    raise TypeError(f"save expects one of {sorted(classes)}, got {type(cache).__name__}")
  static_names = pytree.fields(cache)[1]
  flat, nested = _flat_arrays(cache)
  specs, blobs = {}, {}
  for field, value in flat.items():
    if value is None:
      specs[field] = None
      continue
    host = np.asarray(jax.device_get(value))
    specs[field] = {"dtype": host.dtype.name, "shape": list(host.shape)}
    blobs[field] = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
  header = {"format": FORMAT, "version": VERSION, "class": name,
            "static": {f: _static_json(getattr(cache, f)) for f in static_names},
            "arrays": specs, "nested": nested}
  header["sha256"] = _digest(header, blobs)
  payload = {_HEADER: np.frombuffer(json.dumps(header).encode(), np.uint8)}
  payload.update(blobs)
  path = os.fspath(path)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    np.savez(f, **payload)
  os.replace(tmp, path)


def _header(archive, path):
  if _HEADER not in archive.files:
    raise ValueError(f"{path} is not a jkv cache file (no header)")
  try:
    header = json.loads(archive[_HEADER].tobytes().decode())
  except (UnicodeDecodeError, json.JSONDecodeError) as err:
    raise ValueError(f"{path}: unreadable jkv header ({err})") from None
  if header.get("format") != FORMAT:
    raise ValueError(f"{path} is not a jkv cache file (format {header.get('format')!r})")
  if header.get("version") != VERSION:
    raise ValueError(f"{path} has jkv cache format version {header.get('version')}; this jkv "
                     f"reads version {VERSION}")
  return header


def load(path, *, like=None):
  """Reads a cache written by :func:`save`; arrays land on JAX's default device.

  like: optional template cache; the file must match its class, static fields, array
    shapes and dtypes (ValueError otherwise).
  """
  path = os.fspath(path)
  try:
    archive = np.load(path, allow_pickle=False)
    if not isinstance(archive, np.lib.npyio.NpzFile):
      raise ValueError("a single .npy array, not an archive")
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
    raise ValueError(f"{path}: not a readable .npz file ({err})") from None
  try:
    with archive:
      return _load(archive, path, like)
  except (OSError, EOFError, zipfile.BadZipFile) as err:   # a damaged archive member
    raise ValueError(f"{path}: not a readable .npz file ({err})") from None
  except (KeyError, TypeError) as err:                      # a header missing entries
    raise ValueError(f"{path}: malformed jkv header ({err!r})") from None


def _load(archive, path, like):
  """The body of :func:`load` on an open archive."""
  header = _header(archive, path)
  if not isinstance(header.get("arrays"), dict) or not isinstance(header.get("static"), dict):
    raise ValueError(f"{path}: malformed jkv header")
  classes = _classes()
  cls = classes.get(header.get("class"))
  if cls is None:
    raise ValueError(f"{path}: unknown cache class {header.get('class')!r} "
                     f"(known: {sorted(classes)})")
  specs = header["arrays"]
  blobs, arrays = {}, {}
  for field, spec in specs.items():
    if spec is None:
      arrays[field] = None
      continue
    if field not in archive.files:
      raise ValueError(f"{path}: array {field!r} is missing")
    blob = archive[field]
    try:
      dtype = np.dtype(jnp.dtype(spec["dtype"]))
    except (TypeError, KeyError) as err:
      raise ValueError(f"{path}: array {field!r} has an unknown dtype ({err})") from None
    expected = int(np.prod(spec["shape"], dtype=np.int64)) * dtype.itemsize
    if blob.dtype != np.uint8 or blob.ndim != 1 or blob.size != expected:
      raise ValueError(f"{path}: array {field!r} holds {blob.size} bytes, its header says "
                       f"{spec['shape']} {spec['dtype']} ({expected} bytes)")
    blobs[field] = blob
    arrays[field] = blob.view(dtype).reshape(spec["shape"])
  claimed = header.pop("sha256", None)
  if claimed != _digest(header, blobs):
    raise ValueError(f"{path}: checksum mismatch (the file is corrupted or was modified)")
  array_names, static_names = pytree.fields(cls)
  nested = header.get("nested", {})
  nested_classes = _nested_classes()
  if not isinstance(nested, dict) or any(n not in nested_classes for n in nested.values()):
    raise ValueError(f"{path}: malformed nested fields {nested!r}")
  expected = [f for f in array_names if f not in nested] + [
      f"{f}.{sub}" for f, n in nested.items() for sub in pytree.fields(nested_classes[n])[0]]
  if sorted(specs) != sorted(expected) or sorted(header["static"]) != sorted(static_names):
    raise ValueError(f"{path}: fields {sorted(specs) + sorted(header['static'])} do not match "
                     f"{cls.__name__}'s {sorted(expected + static_names)}")
  static = {f: _static_value(v) for f, v in header["static"].items()}
  if like is not None:
    _check_like(path, like, cls, static, arrays)
  values = {f: None if a is None else jnp.asarray(a) for f, a in arrays.items()}
  for field, name in nested.items():
    parts = {sub: values.pop(f"{field}.{sub}")
             for sub in pytree.fields(nested_classes[name])[0]}
    values[field] = nested_classes[name](**parts)
  return cls(**values, **static)


def _check_like(path, like, cls, static, arrays):
  if type(like) is not cls:
    raise ValueError(f"{path} holds a {cls.__name__}, expected a {type(like).__name__}")
  static_names = pytree.fields(like)[1]
  for field in static_names:
    if static[field] != getattr(like, field):
      raise ValueError(f"{path}: {field} is {static[field]!r}, expected "
                       f"{getattr(like, field)!r}")
  flat, _ = _flat_arrays(like)
  if sorted(flat) != sorted(arrays):
    raise ValueError(f"{path}: fields {sorted(arrays)}, expected {sorted(flat)}")
  for field, want in flat.items():
    got = arrays[field]
    if (want is None) != (got is None):
      raise ValueError(f"{path}: {field} is {'absent' if got is None else 'present'}, expected "
                       f"{'absent' if want is None else 'present'}")
    if want is not None and (tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype):
      raise ValueError(f"{path}: {field} is {tuple(got.shape)} {got.dtype}, expected "
                       f"{tuple(want.shape)} {want.dtype}")
