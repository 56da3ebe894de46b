import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import pages
from conftest import KERNEL, bits


def test_slot_mapping(rng):
  block_table = jnp.asarray(rng.permutation(40)[:12].reshape(3, 4), jnp.int32)
  seq_ids = jnp.asarray([0, 0, 1, 2, -1, 2], jnp.int32)
  positions = jnp.asarray([0, 17, 5, 31, 3, 32], jnp.int32)
  got = jax.jit(pages.slot_mapping, static_argnums=3)(block_table, seq_ids, positions, 8)
  bt = np.asarray(block_table)
  want = [bt[0, 0] * 8, bt[0, 2] * 8 + 1, bt[1, 0] * 8 + 5, bt[2, 3] * 8 + 7, -1, -1]
  assert got.tolist() == want
  dec = pages.decode_slot_mapping(block_table, jnp.asarray([3, 8, 0]), 8)
  assert dec.tolist() == [bt[0, 0] * 8 + 3, bt[1, 1] * 8, bt[2, 0] * 8]


def test_seq_lens_and_indptr_round_trip(rng):
  page = 16
  seq_lens = jnp.asarray([0, 1, 16, 17, 40], jnp.int32)
  block_table = jnp.asarray(rng.permutation(100)[:15].reshape(5, 3), jnp.int32)
  indptr, indices, last = jax.jit(pages.block_table_to_indptr, static_argnums=2)(
      block_table, seq_lens, page)
  assert indptr.tolist() == [0, 0, 1, 2, 4, 7]
  assert last.tolist() == [0, 1, 16, 1, 8]
  bt = np.asarray(block_table)
  assert indices[:7].tolist() == [bt[1, 0], bt[2, 0], bt[3, 0], bt[3, 1], *bt[4, :3]]
  assert pages.get_seq_lens(indptr, last, page).tolist() == seq_lens.tolist()
  table, lens = pages.indptr_to_block_table(indptr, indices, last, page, 3)
  assert lens.tolist() == seq_lens.tolist()
  used = np.arange(3)[None, :] < np.asarray((seq_lens + page - 1) // page)[:, None]
  np.testing.assert_array_equal(np.where(used, np.asarray(table), -1), np.where(used, bt, -1))
  with pytest.raises(ValueError, match="a request owns 3 pages but max_blocks_per_seq is 2"):
    pages.indptr_to_block_table(indptr, indices, last, page, 2)


def test_get_batch_indices_positions_matches_flashinfer_loop():
  append_indptr = np.array([0, 3, 3, 7], np.int32)
  seq_lens = np.array([10, 4, 7], np.int32)
  nnz = 9
  b, p = pages.get_batch_indices_positions(append_indptr, seq_lens, nnz)
  want_b, want_p = [-1] * nnz, [0] * nnz
  for r in range(3):
    for k in range(append_indptr[r], append_indptr[r + 1]):
      want_b[k] = r
      want_p[k] = seq_lens[r] - (append_indptr[r + 1] - append_indptr[r]) + k - append_indptr[r]
  assert b.tolist() == want_b and p.tolist() == want_p


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("single_tensor", [False, True])
def test_append_paged_kv_cache_matches_flashinfer_loop(kv_layout, single_tensor, rng):
  """FlashInfer test_page.py shape: nnz split [45, 8, 25, 22], 4 requests, page 16."""
  heads, dim, page, num_pages = 4, 64, 16, 40
  append_lens = [45, 8, 25, 22]
  pages_per_req = [4, 1, 2, 2]
  last_page_len = [13, 8, 9, 6]
  kv_indptr = np.concatenate([[0], np.cumsum(pages_per_req)]).astype(np.int32)
  kv_indices = rng.permutation(num_pages)[: kv_indptr[-1]].astype(np.int32)
  seq_lens = pages.get_seq_lens(kv_indptr, last_page_len, page)
  append_indptr = np.concatenate([[0], np.cumsum(append_lens)]).astype(np.int32)
  nnz = int(append_indptr[-1]) + 3  # 3 unused entries (batch index -1)
  batch_idx, positions = pages.get_batch_indices_positions(append_indptr, seq_lens, nnz)
  key = jnp.asarray(rng.standard_normal((nnz, heads, dim)), jnp.float16)
  value = jnp.asarray(rng.standard_normal((nnz, heads, dim)), jnp.float16)
  shape = (num_pages, page, heads, dim) if kv_layout == "NHD" else (num_pages, heads, page, dim)
  k_cache = jnp.asarray(rng.standard_normal(shape), jnp.float16)
  v_cache = jnp.asarray(rng.standard_normal(shape), jnp.float16)
  cache = jnp.stack([k_cache, v_cache], axis=1) if single_tensor else (k_cache, v_cache)
  outs = [jkv.append_paged_kv_cache(key, value, batch_idx, positions, cache, kv_indices,
                                    kv_indptr, last_page_len, kv_layout, backend=b)
          for b in ("reference", KERNEL)]
  want_k, want_v = np.array(k_cache), np.array(v_cache)
  for i in range(nnz):  # FlashInfer's reference loop (trace/templates/page.py)
    b, p = int(batch_idx[i]), int(positions[i])
    if b < 0:
      continue
    page_id = kv_indices[kv_indptr[b] + p // page]
    if kv_layout == "NHD":
      want_k[page_id, p % page], want_v[page_id, p % page] = key[i], value[i]
    else:
      want_k[page_id, :, p % page], want_v[page_id, :, p % page] = key[i], value[i]
  for out in outs:
    got_k, got_v = (out[:, 0], out[:, 1]) if single_tensor else out
    np.testing.assert_array_equal(bits(got_k), bits(want_k))
    np.testing.assert_array_equal(bits(got_v), bits(want_v))


def test_append_errors(rng):
  cache = (jnp.zeros((4, 8, 2, 16), jnp.float16), jnp.zeros((4, 8, 2, 16), jnp.float16))
  key = jnp.ones((2, 2, 16), jnp.float16)
  indptr, indices = np.array([0, 1], np.int32), np.array([3], np.int32)
  with pytest.raises(TypeError, match="does not convert"):
    jkv.append_paged_kv_cache(key.astype(jnp.float32), key, np.zeros(2, np.int32),
                              np.arange(2, dtype=np.int32), cache, indices, indptr, [2])
  with pytest.raises(ValueError, match=r"positions\[1\] = 8 lies past the pages"):
    jkv.append_paged_kv_cache(key, key, np.zeros(2, np.int32), np.array([0, 8], np.int32), cache,
                              indices, indptr, [2])
  with pytest.raises(ValueError, match="tuple of 4-D caches or one 5-D"):
    jkv.append_paged_kv_cache(key, key, np.zeros(2, np.int32), np.arange(2, dtype=np.int32),
                              cache[0], indices, indptr, [2])


def test_int64_values_are_checked_before_int32():
  """Values past int32 (which JAX without x64 would wrap into valid ones) raise."""
  table = np.array([[3, 4], [5, 6]], np.int32)
  with pytest.raises(ValueError, match=r"seq_ids\[0\] = 4294967297 does not fit in int32"):
    pages.slot_mapping(table, np.array([2**32 + 1]), np.array([0]), 16)
  with pytest.raises(ValueError, match=r"kv_last_page_len\[0\] = 4294967299 does not fit"):
    pages.get_seq_lens(np.array([0, 1]), np.array([2**32 + 3]), 16)
  with pytest.raises(ValueError, match=r"batch_indices\[0\] = 4294967296 does not fit"):
    pages.append_slot_mapping(np.array([2**32]), np.array([0]), np.array([1]),
                              np.array([0, 1]), 16)


@pytest.mark.parametrize("backend", ["reference", KERNEL])
def test_append_far_past_a_request_pages_never_wraps(backend):
  """Page size 1, a position near 2**31: kv_indptr[b] + position once wrapped negative and
  the token landed in another request's page. Eagerly it raises; under jit nothing is
  written."""
  cache = jnp.zeros((4, 1, 1, 8), jnp.float32)
  new = jnp.ones((1, 1, 8), jnp.float32)
  indices, indptr = jnp.array([2, 3], jnp.int32), jnp.array([0, 1, 2], jnp.int32)
  append = lambda pos: jkv.append_paged_kv_cache(new, new, jnp.array([1]), pos, (cache, cache),
                                                 indices, indptr, jnp.array([1, 1]),
                                                 backend=backend)
  with pytest.raises(ValueError, match="lies past the pages that kv_indptr gives request 1"):
    append(jnp.array([2**31 - 1]))
  keys, _ = jax.jit(append)(jnp.array([2**31 - 1]))
  assert not np.asarray(keys).any()


def test_empty_tables():
  """Tables without requests, pages or rows give empty or all-padding results."""
  table, lens = pages.indptr_to_block_table(np.array([0, 0]), np.zeros(0, np.int32),
                                            np.array([0]), 16, 3)
  np.testing.assert_array_equal(table, [[0, 0, 0]])
  np.testing.assert_array_equal(lens, [0])
  batch, positions = pages.get_batch_indices_positions(np.array([0]), np.zeros(0, np.int32), 3)
  np.testing.assert_array_equal(batch, [-1, -1, -1])
  slots, inside = pages.append_slot_mapping(np.array([0]), np.array([0]),
                                            np.zeros(0, np.int32), np.array([0, 0]), 16)
  np.testing.assert_array_equal(slots, [-1])
  assert not bool(inside[0])
  for empty in ((0, 2), (2, 0)):   # no rows, or rows without columns
    slots = jax.jit(lambda s: pages.slot_mapping(jnp.zeros(empty, jnp.int32), s,
                                                 jnp.array([0, 1]), 16))(jnp.array([0, -1]))
    np.testing.assert_array_equal(slots, [-1, -1])


@pytest.mark.parametrize("n", [1, 5, 1024, 1025, 2049, 64 * 1100 + 7])
def test_inclusive_sum_equals_cumsum(n, rng):
  values = rng.integers(-5, 9, n).astype(np.int32)
  np.testing.assert_array_equal(jax.jit(pages.inclusive_sum)(values), np.cumsum(values))
  flags = rng.random(n) < 0.3
  np.testing.assert_array_equal(pages.inclusive_sum(jnp.asarray(flags)), np.cumsum(flags))


def _helper_calls():
  """(name, call(backend)) of every public jnp-only helper, on small valid inputs."""
  table = jnp.asarray([[3, 1, -1], [0, 2, 4]], jnp.int32)
  lens = jnp.asarray([20, 33], jnp.int32)
  indptr = jnp.asarray([0, 2, 5], jnp.int32)
  indices = jnp.asarray([3, 1, 0, 2, 4], jnp.int32)
  last = jnp.asarray([4, 1], jnp.int32)
  key_cache = jnp.arange(5 * 16 * 2 * 8, dtype=jnp.float32).reshape(5, 16, 2, 8)
  cache = jkv.PagedKVCache.create(5, 16, 2, 8, dtype=jnp.float32)
  return [
      ("slot_mapping", lambda b: pages.slot_mapping(table, jnp.asarray([0, 1]),
                                                    jnp.asarray([5, 40]), 16, backend=b)),
      ("decode_slot_mapping", lambda b: pages.decode_slot_mapping(table, lens, 16, backend=b)),
      ("get_seq_lens", lambda b: jkv.get_seq_lens(indptr, last, 16, backend=b)),
      ("get_batch_indices_positions", lambda b: jkv.get_batch_indices_positions(
          jnp.asarray([0, 2, 3], jnp.int32), lens, 4, backend=b)),
      ("append_slot_mapping", lambda b: pages.append_slot_mapping(
          jnp.asarray([0, 1], jnp.int32), jnp.asarray([3, 20], jnp.int32), indices, indptr,
          16, backend=b)),
      ("block_table_to_indptr", lambda b: pages.block_table_to_indptr(
          jnp.asarray([[3, 1, 0], [0, 2, 4]], jnp.int32), lens, 16, backend=b)),
      ("indptr_to_block_table", lambda b: pages.indptr_to_block_table(indptr, indices, last, 16,
                                                                     3, backend=b)),
      ("to_canonical", lambda b: jkv.transcode.to_canonical(key_cache, -key_cache, "flash",
                                                            backend=b)),
      ("from_canonical", lambda b: jkv.transcode.from_canonical(key_cache, -key_cache, "hnd",
                                                                backend=b)),
      ("transcode", lambda b: jkv.transcode.transcode(key_cache, -key_cache, "flash", "hnd",
                                                      backend=b)),
      ("transcode_paged_kv_cache", lambda b: jkv.transcode_paged_kv_cache(cache, "vllm",
                                                                          backend=b)),
      ("repeat_kv_heads", lambda b: jkv.repeat_kv_heads(key_cache, 2, backend=b)),
  ]


@pytest.mark.parametrize("name,call", _helper_calls(), ids=lambda x: x if isinstance(x, str) else "")
def test_helpers_take_backend(name, call):
  """Every jnp-only helper takes ``backend`` like the ops: "auto" and "reference" run the
  same jnp code; the kernel back ends raise (there is no kernel)."""
  want = call("reference")
  for leaf_got, leaf_want in zip(jax.tree.leaves(call("auto")), jax.tree.leaves(want)):
    np.testing.assert_array_equal(bits(leaf_got), bits(leaf_want))
  for backend in ("pallas", "interpret"):
    with pytest.raises(NotImplementedError, match="no Pallas kernel"):
      call(backend)
  with pytest.raises(ValueError, match="backend must be one of"):
    call("cuda")
