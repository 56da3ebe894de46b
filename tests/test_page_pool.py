"""PagePool: allocation, free, fork with copy-on-write, out-of-pages, invariants under random
operation sequences (hypothesis), use inside a jitted while_loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import jkv
from jkv import PagePool


def check_invariants(pool):
  """No page held twice by one sequence, reference counts equal the table, null page pinned,
  unused table entries point at the null page."""
  ref = np.asarray(pool.ref_count)
  table = np.asarray(pool.block_table)
  lens = np.asarray(pool.seq_lens)
  assert ref[0] == 1
  held = np.zeros_like(ref)
  for seq in range(pool.max_seqs):
    pages = -(-lens[seq] // pool.page_size)
    row = table[seq, :pages]
    assert (row > 0).all() and np.unique(row).size == row.size
    assert (table[seq, pages:] == 0).all()
    np.add.at(held, row, 1)
  held[0] = 1
  np.testing.assert_array_equal(ref, held)
  assert int(pool.num_free_pages) == int((ref == 0).sum())


def test_append_free_and_slots():
  pool = PagePool.create(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=5)
  pool, copies = pool.append(jnp.array([0, 2]), jnp.array([5, 9]))
  assert (np.asarray(copies) == -1).all()
  np.testing.assert_array_equal(pool.seq_lens, [5, 0, 9, 0])
  np.testing.assert_array_equal(pool.block_table[0, :2], [1, 2])    # lowest free pages first
  np.testing.assert_array_equal(pool.block_table[2, :3], [3, 4, 5])
  check_invariants(pool)
  slots = pool.slot_mapping(jnp.array([0, 2, 2, 1, -1]), jnp.array([4, 0, 8, 0, 0]))
  np.testing.assert_array_equal(slots, [2 * 4 + 0, 3 * 4, 5 * 4, -1, -1])
  pool, _ = pool.append(jnp.array([0]), jnp.array([3]))             # fills page 2, adds none
  np.testing.assert_array_equal(pool.block_table[0, :3], [1, 2, 0])
  pool, _ = pool.append(jnp.array([0]), jnp.array([1]))             # 9 tokens: a third page
  np.testing.assert_array_equal(pool.block_table[0, :3], [1, 2, 6])
  check_invariants(pool)
  pool = pool.free(jnp.array([0, 2]))
  check_invariants(pool)
  assert int(pool.num_free_pages) == 15                               # no leaks


def test_out_of_pages_eager_and_under_jit():
  pool = PagePool.create(num_pages=5, page_size=4, max_seqs=3, max_pages_per_seq=8)
  pool, _ = pool.append(jnp.array([0]), jnp.array([8]))
  with pytest.raises(ValueError, match="out of pages: the append needs 3 pages, 2 are free"):
    pool.append(jnp.array([1, 2]), jnp.array([4, 5]))
  with pytest.raises(ValueError, match="block table has 8"):
    pool.append(jnp.array([1]), jnp.array([33]))
  step = jax.jit(lambda p, ids, n: p.append(ids, n))
  after, copies = step(pool, jnp.array([1, 2]), jnp.array([4, 5]))
  assert bool(after.out_of_pages)
  for a, b in zip(jax.tree.leaves(after)[:3], jax.tree.leaves(pool)[:3]):   # all or nothing
    np.testing.assert_array_equal(a, b)
  assert (np.asarray(copies) == -1).all()
  after, _ = step(after, jnp.array([1, 2]), jnp.array([4, 4]))             # fits: flag sticks
  assert bool(after.out_of_pages) and int(after.num_free_pages) == 0
  check_invariants(after)


def test_fork_and_copy_on_write():
  pool = PagePool.create(num_pages=12, page_size=4, max_seqs=4, max_pages_per_seq=4)
  pool, _ = pool.append(jnp.array([0]), jnp.array([6]))              # pages 1, 2 (2 half full)
  pool = pool.fork(jnp.array([0]), jnp.array([1]))
  pool = pool.fork(jnp.array([0]), jnp.array([2]))
  np.testing.assert_array_equal(pool.ref_count[1:3], [3, 3])
  check_invariants(pool)
  # The parent appends into its shared half-full page: it gets its own copy of it.
  pool, copies = pool.append(jnp.array([0, 1]), jnp.array([1, 3]))
  np.testing.assert_array_equal(copies, [[2, 3], [2, 4]])
  np.testing.assert_array_equal(pool.block_table[0, :2], [1, 3])
  np.testing.assert_array_equal(pool.block_table[1, :3], [1, 4, 5])
  np.testing.assert_array_equal(pool.block_table[2, :2], [1, 2])
  np.testing.assert_array_equal(pool.ref_count[1:6], [3, 1, 1, 1, 1])
  check_invariants(pool)
  # A full shared page is not copied: appending starts a new page.
  pool, copies = pool.append(jnp.array([0]), jnp.array([1]))        # 8 tokens: pages full
  assert (np.asarray(copies) == -1).all()
  pool = pool.fork(jnp.array([0]), jnp.array([3]))
  pool, copies = pool.append(jnp.array([3]), jnp.array([1]))
  assert (np.asarray(copies) == -1).all()
  np.testing.assert_array_equal(pool.block_table[3, :3], [1, 3, 6])
  check_invariants(pool)
  with pytest.raises(ValueError, match="child_ids must be empty"):
    pool.fork(jnp.array([0]), jnp.array([1]))
  pool = pool.free(jnp.arange(4))
  assert int(pool.num_free_pages) == 11


def test_fork_one_parent_into_several_children():
  """Parallel sampling: one call forks a parent into three children, eagerly and under jit
  (each child holds the parent's pages; the pages gain a holder per child)."""
  pool = PagePool.create(num_pages=12, page_size=4, max_seqs=5, max_pages_per_seq=4)
  pool, _ = pool.append(jnp.array([0]), jnp.array([6]))              # pages 1, 2
  fork = lambda p: p.fork(jnp.array([0, 0, -1, 0]), jnp.array([1, 2, 4, 3]))
  for forked in (fork(pool), jax.jit(fork)(pool)):
    np.testing.assert_array_equal(forked.seq_lens, [6, 6, 6, 6, 0])
    np.testing.assert_array_equal(forked.block_table[:4, :2], [[1, 2]] * 4)
    np.testing.assert_array_equal(forked.ref_count[1:4], [4, 4, 0])
    check_invariants(forked)


def test_a_huge_append_does_not_wrap():
  """num_tokens near 2**31 would wrap the new length in int32 and pass the fit check:
  eagerly it raises, under jit it sets out_of_pages and changes nothing."""
  pool = PagePool.create(num_pages=8, page_size=4, max_seqs=2, max_pages_per_seq=4)
  pool, _ = pool.append(jnp.array([0]), jnp.array([6]))
  with pytest.raises(ValueError, match="block table has 4"):
    pool.append(jnp.array([0]), jnp.array([2**31 - 2]))
  with pytest.raises(ValueError, match=r"num_tokens\[0\] = 4294967296 does not fit in int32"):
    pool.append(np.array([1]), np.array([2**32], np.int64))
  after, _ = jax.jit(lambda p, n: p.append(jnp.array([0]), n))(pool, jnp.array([2**31 - 2]))
  assert bool(after.out_of_pages)
  for a, b in zip(jax.tree.leaves(after)[:3], jax.tree.leaves(pool)[:3]):
    np.testing.assert_array_equal(a, b)
  after = after.free(jnp.array([0]))
  assert int(after.num_free_pages) == 7                               # nothing leaked


def test_bad_arguments():
  pool = PagePool.create(num_pages=8, page_size=4, max_seqs=2, max_pages_per_seq=2)
  with pytest.raises(ValueError, match="max_new_pages must be positive, got 0"):
    pool.append(jnp.array([0]), jnp.array([1]), max_new_pages=0)
  with pytest.raises(ValueError, match=r"positions must have shape \(3,\), got \(4,\)"):
    pool.slot_mapping(jnp.array([0, 0, 0]), jnp.array([0, 1, 2, 3]))
  with pytest.raises(ValueError, match="duplicate sequence ids"):
    pool.append(jnp.array([1, 1]), jnp.array([1, 1]))
  with pytest.raises(ValueError, match=r"seq_ids\[0\] = 2 is out of range"):
    pool.append(jnp.array([2]), jnp.array([1]))
  with pytest.raises(ValueError, match="num_tokens must be >= 0"):
    pool.append(jnp.array([0]), jnp.array([-1]))
  with pytest.raises(ValueError, match="num_pages must be >= 2"):
    PagePool.create(1, 4, 2, 2)
  # Under jit a duplicate id is ignored (its first occurrence wins).
  pool, _ = jax.jit(lambda p: p.append(jnp.array([1, 1]), jnp.array([3, 7])))(pool)
  np.testing.assert_array_equal(pool.seq_lens, [0, 3])
  check_invariants(pool)


@pytest.mark.slow   # hypothesis: -m slow runs it, not CI
@given(st.lists(st.tuples(st.sampled_from(["append", "free", "fork"]),
                          st.lists(st.integers(-1, 5), min_size=1, max_size=4),
                          st.lists(st.integers(0, 9), min_size=4, max_size=4)),
                min_size=1, max_size=12))
def test_random_operation_sequences_keep_invariants(ops):
  """Random appends / frees / forks (eager): the invariants hold after every step, out of
  pages raises and changes nothing, and freeing everything leaks nothing."""
  pool = PagePool.create(num_pages=20, page_size=3, max_seqs=6, max_pages_per_seq=6)
  for op, ids, counts in ops:
    ids = list(dict.fromkeys(ids))                       # distinct, order kept
    arr = jnp.array(ids, jnp.int32)
    before = jax.tree.leaves(pool)
    try:
      if op == "append":
        pool, copies = pool.append(arr, jnp.array(counts[:len(ids)], jnp.int32))
        for src, dst in np.asarray(copies):
          assert (src, dst) == (-1, -1) or (src > 0 and dst > 0 and src != dst)
      elif op == "free":
        pool = pool.free(arr)
      else:
        lens = np.asarray(pool.seq_lens)
        parents = [i for i in ids if i >= 0 and lens[i] > 0][:1]
        children = [i for i in range(6) if lens[i] == 0 and i not in parents][:1]
        if parents and children:
          pool = pool.fork(jnp.array(parents), jnp.array(children))
    except ValueError as err:
      assert "out of pages" in str(err)
      for a, b in zip(jax.tree.leaves(pool), before):
        np.testing.assert_array_equal(a, b)
    check_invariants(pool)
  pool = pool.free(jnp.arange(6))
  assert int(pool.num_free_pages) == 19 and not np.asarray(pool.block_table).any()


def test_allocator_inside_a_jitted_while_loop():
  """256 sequences decode one token per step inside lax.while_loop: pages come from the pool,
  the loop stops when a step does not fit (the flag), and the table stays consistent."""
  pool = PagePool.create(num_pages=1 + 256 * 3, page_size=16, max_seqs=256, max_pages_per_seq=4)
  pool, _ = pool.append(jnp.arange(256), jnp.full((256,), 5))

  def cond(state):
    pool, step = state
    return (~pool.out_of_pages) & (step < 100)

  def body(state):
    pool, step = state
    pool, _ = pool.append(jnp.arange(256), jnp.ones((256,), jnp.int32), max_new_pages=256)
    return pool, step + 1

  pool, steps = jax.jit(lambda p: jax.lax.while_loop(cond, body, (p, 0)))(pool)
  # 5 + 43 tokens fill 3 pages per sequence; the 44th step would need a 4th page for all.
  assert int(steps) == 44 and bool(pool.out_of_pages)
  np.testing.assert_array_equal(pool.seq_lens, np.full(256, 48))
  assert int(pool.num_free_pages) == 0
  check_invariants(pool)


@pytest.mark.parametrize("mode", [dict(layout="vllm", dtype=jnp.float32),
                                  dict(layout="flash", quant="block", kv_cache_dtype="int8",
                                       dtype=jnp.float32)])
def test_free_with_zeroing(mode, rng):
  """free(return_freed=True) lists exactly the pages nobody holds any more; zero_blocks
  clears them (data and scales) and nothing else."""
  pool = jkv.PagePool.create(num_pages=10, page_size=4, max_seqs=3, max_pages_per_seq=3)
  cache = jkv.PagedKVCache.create(10, 4, 2, 32, num_layers=2, **mode)
  pool, _ = pool.append(jnp.array([0, 1]), jnp.array([9, 5]))
  pool = pool.fork(jnp.array([0]), jnp.array([2]))          # seq 2 shares seq 0's 3 pages
  for seq, n in ((0, 9), (1, 5)):
    slots = pool.slot_mapping(jnp.full((n,), seq, jnp.int32), jnp.arange(n, dtype=jnp.int32))
    for layer in range(2):
      k = jnp.asarray(rng.standard_normal((n, 2, 32)) + 1.0, jnp.float32)
      cache = cache.write(layer, k, k, slots)
  table = np.asarray(pool.block_table)
  pool, freed = pool.free(jnp.array([0, 1]), return_freed=True)
  freed = np.asarray(freed)
  np.testing.assert_array_equal(freed[0], -1)                # still held by seq 2
  np.testing.assert_array_equal(freed[1], [table[1, 0], table[1, 1], -1])
  before = {n: np.asarray(getattr(cache, n)) for n in cache.block_array_names()}
  cache = cache.zero_blocks(freed)
  for name, old in before.items():
    new = np.asarray(getattr(cache, name))
    gone = freed[freed >= 0]
    assert not new[:, gone].any()
    keep = np.setdiff1d(np.arange(10), gone)
    np.testing.assert_array_equal(new[:, keep], old[:, keep])
    assert old[:, gone].any()                                 # there was data to clear
  with pytest.raises(TypeError, match="block_ids must be an integer array"):
    cache.zero_blocks(jnp.array([1.0]))
