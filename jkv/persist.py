"""Saving and loading jkv pytrees (caches, PagePool): arrays, static fields, a checksum.

    jkv.save("cache.npz", cache)
    cache = jkv.load("cache.npz")                  # or load(path, like=template)
    jkv.save_sharded("ckpt", cache)                # sharded: orbax-checkpoint, every process
    cache = jkv.load_sharded("ckpt", like=target)  # onto target's shardings (any mesh)

The file holds each array field as raw bytes (so FP8, E8M0 and other ml_dtypes types
round-trip exactly, NaN payloads and -0 included) with its dtype and shape, and one JSON
header: format version, cache class, static fields, array specs and a SHA-256 over the
header and every array's bytes. ``load`` refuses, with a ``ValueError`` naming what is
wrong, files that are not jkv caches, of another format version or class, whose
checksum does not match (corrupted or edited), whose arrays disagree with the header,
or, given ``like=``, whose class, static fields, shapes or dtypes differ from the template.

``save_sharded`` / ``load_sharded`` are the path for arrays sharded over devices and
processes (``pip install "jkv[checkpoint]"``: orbax-checkpoint): every process writes and
reads only its shards, each array is stored as its raw bytes with a fingerprint (two
32-bit lanes over bytes and positions, checked on load), and ``load_sharded`` places the
arrays on the shardings of its ``like`` template, on the same mesh or another.
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


def _regroup(values: dict, nested: dict) -> dict:
  """The inverse of :func:`_flat_arrays`: ``field.subfield`` values back in their nested
  pytree (``nested``: {field: class name})."""
  values = dict(values)
  for field, name in nested.items():
    cls = _nested_classes()[name]
    values[field] = cls(**{sub: values.pop(f"{field}.{sub}") for sub in pytree.fields(cls)[0]})
  return values


def _saved_class_name(function: str, cache) -> str:
  """The class name of a cache ``function`` can save (TypeError otherwise)."""
  classes = _classes()
  name = type(cache).__name__
  if classes.get(name) is not type(cache):
    raise TypeError(f"{function} expects one of {sorted(classes)}, got {name}")
  return name


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
  name = _saved_class_name("save", cache)
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
  return cls(**_regroup(values, nested), **static)


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


# Sharded checkpoints (orbax-checkpoint): every process writes its shards.

SHARDED_FORMAT = "jkv-sharded"


def _as_bytes(array):
  """The array's raw bytes as uint8 (a trailing dim of the item size past one byte; bool as
  0 / 1), sharded like ``array``."""
  if array.dtype == jnp.bool_:
    return array.astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(array, jnp.uint8)


def _from_bytes(raw, dtype):
  dtype = jnp.dtype(dtype)
  if dtype == jnp.bool_:
    return raw.astype(jnp.bool_)
  return jax.lax.bitcast_convert_type(raw, dtype)


@jax.jit
def _fingerprint(raw):
  """Two uint32 lanes over every byte and its position (global: a reduction over the
  shards), replicated."""
  from jkv.prefix_index import fmix32
  flat = raw.reshape(-1).astype(jnp.uint32)
  position = jnp.arange(flat.shape[0], dtype=jnp.uint32)
  return jnp.stack([jnp.sum(fmix32(flat + fmix32(position)), dtype=jnp.uint32),
                    jnp.sum(fmix32(flat ^ fmix32(position + jnp.uint32(0x9E3779B9))),
                            dtype=jnp.uint32)])


def _nest(flat: dict) -> dict:
  """{"a": x, "b.c": y} -> {"a": x, "b": {"c": y}} (orbax stores nested dicts)."""
  tree = {}
  for name, value in flat.items():
    head, _, tail = name.partition(".")
    if tail:
      tree.setdefault(head, {})[tail] = value
    else:
      tree[head] = value
  return tree


def _byte_sharding(sharding, ndim):
  """The sharding of an array's uint8 view of rank ``ndim`` (a trailing, unsplit dim of
  bytes past one-byte items)."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  raise TypeError(f"load_sharded needs NamedSharding or SingleDeviceSharding arrays in like, "
                  f"got {type(sharding).__name__}")


def save_sharded(directory, cache, *, overwrite: bool = False) -> None:
  """Writes ``cache`` (a jkv cache or PagePool, its arrays sharded over any devices and
  processes) to ``directory`` with orbax-checkpoint; every process calls it, each writes
  its own shards. Arrays are stored as raw bytes (FP8, FP4 and NaN payloads exact) with a
  fingerprint each; static fields and specs go in a JSON item. ``overwrite`` replaces an
  existing checkpoint (otherwise orbax refuses)."""
  name = _saved_class_name("save_sharded", cache)
  flat, nested = _flat_arrays(cache)
  specs, raw = {}, {}
  for field, value in flat.items():
    if value is None:
      specs[field] = None
      continue
    raw[field] = _as_bytes(value)
    specs[field] = {"dtype": jnp.dtype(value.dtype).name, "shape": list(value.shape),
                    "fingerprint": [int(v) for v in np.asarray(_fingerprint(raw[field]))]}
  meta = {"format": SHARDED_FORMAT, "version": VERSION, "class": name, "nested": nested,
          "static": {f: _static_json(getattr(cache, f)) for f in pytree.fields(cache)[1]},
          "arrays": specs}
  import orbax.checkpoint as ocp   # an optional dependency: jkv[checkpoint]
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    checkpointer.save(os.path.abspath(os.fspath(directory)), force=overwrite,
                      args=ocp.args.Composite(arrays=ocp.args.StandardSave(_nest(raw)),
                                              meta=ocp.args.JsonSave(meta)))


def load_sharded(directory, like):
  """Reads a checkpoint of :func:`save_sharded` onto ``like``'s shardings: ``like`` is a
  cache of the same class, static fields, shapes and dtypes (arrays or
  ``jax.ShapeDtypeStruct`` with a ``sharding``, NamedSharding or SingleDeviceSharding),
  on the same or another mesh. Every process calls it. Raises ValueError when the
  checkpoint is of another kind or disagrees with ``like``, or an array's bytes do not
  match their fingerprint."""
  directory = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(os.path.join(directory, "meta")):
    raise ValueError(f"{directory} is not a jkv sharded checkpoint (no meta item)")
  import orbax.checkpoint as ocp   # an optional dependency: jkv[checkpoint]
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    meta = checkpointer.restore(directory, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]
    if not isinstance(meta, dict) or meta.get("format") != SHARDED_FORMAT:
      raise ValueError(f"{directory} is not a jkv sharded checkpoint")
    if meta.get("version") != VERSION:
      raise ValueError(f"{directory} has format version {meta.get('version')}; this jkv "
                       f"reads version {VERSION}")
    cls = _classes().get(meta["class"])
    if cls is None or type(like) is not cls:
      raise ValueError(f"{directory} holds a {meta['class']}, like is a "
                       f"{type(like).__name__}")
    static = {f: _static_value(v) for f, v in meta["static"].items()}
    flat, nested = _flat_arrays(like)
    if nested != meta["nested"] or sorted(flat) != sorted(meta["arrays"]):
      raise ValueError(f"{directory}: fields {sorted(meta['arrays'])}, like has {sorted(flat)}")
    for field, want in flat.items():
      spec = meta["arrays"][field]
      if (spec is None) != (want is None):
        raise ValueError(f"{directory}: {field} is {'absent' if spec is None else 'present'}, "
                         f"like has it {'absent' if want is None else 'present'}")
      if want is not None and (tuple(spec["shape"]) != tuple(want.shape)
                               or jnp.dtype(spec["dtype"]) != jnp.dtype(want.dtype)):
        raise ValueError(f"{directory}: {field} is {tuple(spec['shape'])} {spec['dtype']}, "
                         f"like has {tuple(want.shape)} {jnp.dtype(want.dtype).name}")
    for field in pytree.fields(like)[1]:
      if static.get(field) != getattr(like, field):
        raise ValueError(f"{directory}: {field} is {static.get(field)!r}, like has "
                         f"{getattr(like, field)!r}")
    targets = {}
    for field, want in flat.items():
      if want is not None:
        item = jnp.dtype(want.dtype).itemsize
        shape = tuple(want.shape) + ((item,) if item > 1 and want.dtype != jnp.bool_ else ())
        targets[field] = jax.ShapeDtypeStruct(
            shape, jnp.uint8, sharding=_byte_sharding(want.sharding, len(shape)))
    raw = checkpointer.restore(directory, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore(_nest(targets))))["arrays"]
  values = {}
  for field, want in flat.items():
    if want is None:
      values[field] = None
      continue
    head, _, tail = field.partition(".")
    got = raw[head][tail] if tail else raw[head]
    if [int(v) for v in np.asarray(_fingerprint(got))] != meta["arrays"][field]["fingerprint"]:
      raise ValueError(f"{directory}: array {field!r} does not match its fingerprint (the "
                       f"checkpoint is corrupted or was modified)")
    values[field] = jax.device_put(_from_bytes(got, want.dtype), want.sharding)
  return cls(**_regroup(values, nested), **static)
