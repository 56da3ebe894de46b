"""Every Pallas kernel once on adversarial inputs, for ``compute-sanitizer --tool memcheck``.

    bash benchmarks/sanitize.sh          # on the GPU (device tool); summary in $OUT

Inputs: slot mappings with padding (-1), the first slot past the cache, far out of range
(2^30), the int32 extremes and duplicates; a traced layer index past the stacked layers;
block pairs with the same. Calls are jitted with those inputs as arguments (under jit
out-of-range entries are dropped, eager calls would raise first). Each case also checks
the compiled kernel against the jnp reference on the same inputs (duplicate-free cases;
which duplicate wins is the reference's rule only for the ops that define it).
Prints one line per case and ``SANITIZE CASES: n passed, m failed``.
"""

from __future__ import annotations

import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from jkv import layout as layout_lib

KERNEL = os.environ.get("JKV_SANITIZE_BACKEND", "pallas")   # "interpret": a CPU dry run
NB, BS, H, D = 8, 16, 2, 64
CAPACITY = NB * BS
INT32 = np.iinfo(np.int32)
BAD_SLOTS = [-1, 0, CAPACITY - 1, CAPACITY, CAPACITY + 1, 2**30, int(INT32.max),
             int(INT32.min), 17, 40, 99]
DUP_SLOTS = BAD_SLOTS[:-3] + [17, 17, 40]


def _tokens(rng, n):
  key = jnp.asarray(rng.standard_normal((n, H, D)), jnp.float32)
  return key, -key


def _same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype.itemsize == 1:
      x, y = x.view(np.uint8), y.view(np.uint8)
    if not np.array_equal(x, y, equal_nan=x.dtype.kind == "f"):
      return False
  return True


def _check(name, op, args, compare=True):
  """Runs op(*args, backend) jitted on the kernel (and the reference); True when equal."""
  kernel = jax.jit(lambda *a: op(*a, KERNEL))(*args)
  jax.block_until_ready(kernel)
  if not compare:
    return True
  return _same(kernel, jax.jit(lambda *a: op(*a, "reference"))(*args))


def cases(rng):
  slots = jnp.asarray(BAD_SLOTS, jnp.int32)
  dups = jnp.asarray(DUP_SLOTS, jnp.int32)
  key, value = _tokens(rng, len(BAD_SLOTS))
  for layout in layout_lib.LAYOUTS:
    for dtype, kv_dtype in ((jnp.bfloat16, "auto"), (jnp.float8_e4m3fn, "fp8")):
      k_shape, v_shape = layout_lib.cache_shapes(layout, NB, BS, H, D, dtype)
      k_cache = jnp.full((2,) + k_shape, 3, dtype)
      v_cache = None if v_shape is None else jnp.full((2,) + v_shape, 3, dtype)
      for layer in (1, 2):     # 2: past the stacked layers (traced): nothing written
        def op(k, v, kc, vc, s, lay, backend, layout=layout, kv_dtype=kv_dtype):
          return jkv.write_kv(k, v, kc, vc, s, layout=layout, kv_cache_dtype=kv_dtype,
                              layer=lay, backend=backend)
        yield (f"write_kv {layout} {kv_dtype} layer {layer}", op,
               (key, value, k_cache, v_cache, slots, jnp.int32(layer)), True)
      yield (f"write_kv {layout} {kv_dtype} duplicates", op,
             (key, value, k_cache, v_cache, dups, jnp.int32(0)), False)
  for granularity in ("token", "block"):
    for layout in ("vllm", "asm", "flash"):
      for dtype in (jnp.int8, jnp.float8_e4m3fn):
        k_shape, v_shape = layout_lib.cache_shapes(layout, NB, BS, H, D, dtype)
        scales = (NB, H, BS) if granularity == "token" else (NB, H)
        arrays = (jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype),
                  jnp.ones(scales, jnp.float32), jnp.ones(scales, jnp.float32))
        def op(k, v, kc, vc, ks, vs, s, backend, granularity=granularity, layout=layout):
          return jkv.write_quant_kv(k, v, kc, vc, ks, vs, s, granularity=granularity,
                                    layout=layout, backend=backend)
        name = f"write_quant_kv {granularity} {layout} {np.dtype(dtype).name}"
        yield name, op, (key, value) + arrays + (slots,), True
        yield name + " duplicates", op, (key, value) + arrays + (dups,), granularity == "block"
  for fmt in ("mxfp4", "nvfp4"):
    data, scales = jkv.fp4_cache_shapes(NB, BS, H, D, fmt)
    scale_dtype = jkv.fp4.SCALE_DTYPE[fmt]
    arrays = (jnp.zeros(data, jnp.uint8), jnp.zeros(data, jnp.uint8),
              jnp.zeros(scales, scale_dtype), jnp.zeros(scales, scale_dtype))
    def op(k, v, kc, vc, ks, vs, s, backend, fmt=fmt):
      return jkv.reshape_and_cache_fp4(k, v, kc, vc, ks, vs, s, fmt, backend=backend)
    yield f"reshape_and_cache_fp4 {fmt}", op, (key, value) + arrays + (slots,), True
  pairs = jnp.asarray([[1, 2], [-1, 3], [NB, 0], [0, NB], [2**30, 1], [int(INT32.max), 2],
                       [3, int(INT32.min)], [2, 1], [4, 5], [4, 5], [5, 4]], jnp.int32)
  caches = [jnp.asarray(rng.standard_normal((2, NB, BS, H, D)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((2, NB, H, BS)), jnp.float32)]
  def op(caches, p, backend):
    return jkv.copy_blocks(caches, None, p, block_axis=1, backend=backend)
  yield "copy_blocks (chains, out of range pairs)", op, (caches, pairs), True
  for src_kind, dst_kind in (("device", "pinned_host"), ("pinned_host", "device")):
    shard = lambda kind: jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
    src = jax.device_put(jnp.asarray(rng.standard_normal((NB, BS, H, D)), jnp.bfloat16),
                         shard(src_kind))
    dst = jax.device_put(jnp.zeros((NB + 3, BS, H, D), jnp.bfloat16), shard(dst_kind))
    def op(s, d, p, backend):
      return jkv.swap_blocks(s, d, p, backend=backend)
    yield f"swap_blocks {src_kind} -> {dst_kind}", op, (src, dst, pairs), True


def main():
  rng = np.random.default_rng(0)
  passed = failed = 0
  only = os.environ.get("JKV_SANITIZE_ONLY", "")        # a substring: run those cases only
  for name, op, args, compare in cases(rng):
    if only not in name:
      continue
    try:
      ok = _check(name, op, args, compare)
    except Exception:                                  # reported, and counted as failed
      traceback.print_exc()
      ok = False
    passed += ok
    failed += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name}{'' if compare else ' (memory only)'}", flush=True)
  print(f"SANITIZE CASES: {passed} passed, {failed} failed")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
