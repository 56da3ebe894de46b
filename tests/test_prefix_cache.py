"""Prefix caching in PagePool (jkv.prefix_index): sharing, partial matches, the last-token
rule, reuse after free, LRU eviction, forced hash collisions, idempotent caching, use under
jit, bad input. A test-side "KV store" records which tokens were really written into each
page: every hit must point at pages holding exactly the prompt's tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jkv import HostPrefixCache, PagePool, PagedKVCache, host_prefix, prefix_index
from tests.test_page_pool import check_invariants

PAGE = 4


class Store:
  """The pool plus what each page really holds (the K/V a real cache would have)."""

  def __init__(self, num_pages=32, max_seqs=4, max_pages_per_seq=8):
    self.pool = PagePool.create(num_pages, PAGE, max_seqs, max_pages_per_seq,
                                prefix_caching=True)
    self.written = np.full((num_pages, PAGE), -1, np.int64)
    self.tokens = {}

  def admit(self, seq, prompt):
    """match_prefix, append the rest, "compute" it (write its tokens), cache_pages."""
    prompt = np.asarray(prompt, np.int32)
    self.pool, num_cached = self.pool.match_prefix([seq], prompt[None], [prompt.size])
    num_cached = int(num_cached[0])
    pages = np.asarray(self.pool.block_table[seq])
    for j in range(num_cached // PAGE):    # a hit holds exactly the prompt's tokens
      np.testing.assert_array_equal(self.written[pages[j]], prompt[j * PAGE:(j + 1) * PAGE])
    self.pool, _ = self.pool.append([seq], [prompt.size - num_cached])
    positions = np.arange(num_cached, prompt.size)
    slots = np.asarray(self.pool.slot_mapping(np.full_like(positions, seq), positions))
    self.written.reshape(-1)[slots] = prompt[num_cached:]
    self.pool = self.pool.cache_pages([seq], prompt[None])
    self.tokens[seq] = prompt
    check_invariants(self.pool)
    return num_cached

  def free(self, seq):
    self.pool = self.pool.free([seq])
    check_invariants(self.pool)


def prompt_of(*parts):
  return np.concatenate([np.asarray(p, np.int32) for p in parts])


SYSTEM = np.arange(100, 110)        # 10 tokens: 2 full pages and 2 tokens of a third


def test_a_shared_system_prompt_is_shared_not_copied():
  store = Store()
  assert store.admit(0, prompt_of(SYSTEM, [1, 2, 3, 4, 5])) == 0
  assert store.admit(1, prompt_of(SYSTEM, [7, 8, 9])) == 8       # 2 full pages
  table = np.asarray(store.pool.block_table)
  np.testing.assert_array_equal(table[1, :2], table[0, :2])        # the same pages
  assert (np.asarray(store.pool.ref_count)[table[0, :2]] == 2).all()
  assert table[1, 2] != table[0, 2]                                # the rest is its own


def test_partial_match_and_other_prefix():
  store = Store()
  store.admit(0, np.arange(16))
  assert store.admit(1, prompt_of(np.arange(9), [50] * 7)) == 8    # pages 0, 1 equal
  # Page 1's tokens at page 1's position, after another page 0: the prefix differs.
  assert store.admit(2, prompt_of([60] * 4, np.arange(4, 16))) == 0


@pytest.mark.parametrize("length, expected", [(8, 4), (9, 8), (12, 8), (13, 12), (16, 12),
                                              (17, 16), (1, 0), (4, 0), (5, 4)])
def test_the_last_prompt_token_is_always_computed(length, expected):
  store = Store()
  store.admit(0, np.arange(20))
  assert store.admit(1, np.arange(length)) == expected


def test_reuse_after_free_and_idempotent_caching():
  store = Store()
  store.admit(0, np.arange(13))
  cached = int(store.pool.num_cached_pages)
  assert cached == 3
  store.pool = store.pool.cache_pages([0], np.arange(13)[None])     # again: no change
  assert int(store.pool.num_cached_pages) == cached
  store.free(0)
  assert int(store.pool.num_cached_pages) == cached                # kept after free
  assert int(store.pool.num_free_pages) == 31
  assert store.admit(1, np.arange(13)) == 12
  # Two sequences with one prompt, both computed (no hit between them): one cached copy.
  store = Store()
  store.pool, _ = store.pool.append([0, 1], [12, 12])
  store.pool = store.pool.cache_pages([0, 1], np.stack([np.arange(12)] * 2))
  assert int(store.pool.num_cached_pages) == 3


def test_free_pages_holding_nothing_go_first_then_least_recently_used():
  store = Store(num_pages=13, max_pages_per_seq=12)      # 12 usable pages
  store.admit(0, prompt_of([1] * 8, [0]))                # caches 2 pages each
  store.admit(1, prompt_of([2] * 8, [0]))
  store.admit(2, prompt_of([3] * 8, [0]))
  for seq in range(3):
    store.free(seq)
  assert int(store.pool.num_cached_pages) == 6
  # A hit makes prompt 1 the most recently used.
  assert store.admit(0, prompt_of([1] * 8, [5])) == 8
  store.free(0)
  # 6 empty pages go first; the next 2 evict the least recently used: prompt 2's.
  store.pool, _ = store.pool.append([3], [6 * PAGE])
  assert int(store.pool.num_cached_pages) == 6
  store.pool, _ = store.pool.append([3], [2 * PAGE])
  assert int(store.pool.num_cached_pages) == 4
  store.free(3)                                           # its 8 pages hold nothing cached
  assert store.admit(0, prompt_of([2] * 8, [0])) == 0     # evicted: no longer matches
  store.free(0)
  assert store.admit(1, prompt_of([1] * 8, [0])) == 8
  assert store.admit(2, prompt_of([3] * 8, [0])) == 8


def test_an_evicted_page_reused_for_other_tokens_never_matches_its_old_prefix():
  store = Store(num_pages=5, max_seqs=2, max_pages_per_seq=4)    # 4 usable pages
  store.admit(0, np.arange(9))          # pages: [0..3] [4..7] cached, one partial
  store.free(0)
  # Take every page, writing other tokens, then cache those as other content.
  store.admit(1, prompt_of([9] * 4, [8] * 4, [7] * 4, [6]))
  store.free(1)
  assert store.admit(0, np.arange(9)) == 0


@pytest.mark.parametrize("collide", ["constant", "two_bits"])
def test_forced_hash_collisions_cost_hits_never_correctness(monkeypatch, rng, collide):
  real = prefix_index.prefix_keys

  def weak_keys(token_ids, page_size):
    hi, lo = real(token_ids, page_size)
    if collide == "constant":
      return jnp.zeros_like(hi), jnp.zeros_like(lo)
    return hi & 3, lo & 0

  monkeypatch.setattr(prefix_index, "prefix_keys", weak_keys)
  store = Store(num_pages=40, max_seqs=6, max_pages_per_seq=8)
  bases = rng.integers(0, 3, (3, 20))     # prompts share prefixes of a few bases
  for _ in range(30):       # each admit asserts a hit holds the prompt's tokens
    seq = int(rng.integers(0, 6))
    if seq in store.tokens:
      store.free(seq)
      del store.tokens[seq]
    prompt = bases[rng.integers(0, 3)][:int(rng.integers(1, 21))].copy()
    prompt[rng.integers(0, prompt.size):] = rng.integers(0, 3)    # and differ after a point
    store.admit(seq, prompt)


def test_with_one_key_for_every_page_only_confirmed_candidates_hit(monkeypatch):
  monkeypatch.setattr(prefix_index, "prefix_keys",
                      lambda token_ids, page_size: (jnp.zeros((token_ids.shape[0],
                                                               token_ids.shape[1] // page_size),
                                                              jnp.uint32),) * 2)
  store = Store()
  first = prompt_of([1] * 4, [2] * 4, [3])
  store.admit(0, first)
  assert int(store.pool.num_cached_pages) == 1          # one page per key: page 0 of first
  assert store.admit(1, prompt_of([2] * 4, [3])) == 0   # the candidate holds other tokens
  assert store.admit(2, prompt_of([1] * 4, [9] * 5)) == 4
  assert store.admit(3, first) == 4                      # page 1 of first was not cached


def _workload(seed):
  """Admits at random under page pressure, some prompts freed and admitted again at once
  (a full hit: their cache_pages proposes nothing, or a last full page whose key is cached
  already); the admits' hits and the pool."""
  store = Store(num_pages=12, max_seqs=4, max_pages_per_seq=6)
  rng = np.random.default_rng(seed)
  hits = []
  for _ in range(24):
    seq = int(rng.integers(0, 4))
    if seq in store.tokens:
      store.free(seq)
      del store.tokens[seq]
    prompt = prompt_of(SYSTEM[:int(rng.integers(0, 10))], rng.integers(0, 3, rng.integers(1, 12)))
    for _ in range(1 + int(rng.integers(0, 2))):
      if seq in store.tokens:
        store.free(seq)
      try:
        hits.append(store.admit(seq, prompt))
      except ValueError as err:     # out of pages: the slot stays as match left it
        assert "out of pages" in str(err)
        store.free(seq)
        store.tokens.pop(seq, None)
        hits.append(-1)
        break
  return hits, store.pool


def test_caching_no_new_key_keeps_the_sorted_index():
  """A prompt served again: its last full page (not matched: the last-token rule) is
  proposed under a key cached already, loses to that page, and the sorted index stays;
  the row's whole run, the holder included, is used now."""
  store = Store()
  prompt = np.arange(12)
  store.admit(0, prompt)
  store.free(0)
  before = store.pool.prefix
  assert store.admit(1, prompt) == 8
  after = store.pool.prefix
  assert int(store.pool.num_cached_pages) == 3
  for name in ("sorted_hi", "sorted_page", "cached", "key_hi", "tokens"):
    np.testing.assert_array_equal(getattr(after, name), getattr(before, name), err_msg=name)
  held = np.asarray(before.cached).nonzero()[0]
  np.testing.assert_array_equal(np.asarray(after.last_use)[held], int(after.clock) - 1)


# 35-50 s a seed (two workloads) on 2 CPU cores: the default run (CI) takes seed 0.
@pytest.mark.parametrize("seed", [0] + [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2)])
def test_caching_no_new_key_equals_a_rebuild(monkeypatch, seed):
  """cache_pages whose proposals all lose to cached keys skips the sorted index's rebuild:
  every hit, and every field but the sorted arrays, equal those of a run that always
  rebuilds."""
  hits, pool = _workload(seed)
  with monkeypatch.context() as patch:
    patch.setattr(prefix_index, "_confirm_cached", prefix_index._cache_proposals)
    rebuilt_hits, rebuilt = _workload(seed)
  assert hits == rebuilt_hits
  assert sum(h > 0 for h in hits) >= 5       # the re-admits hit (the skip was taken)
  for name in ("cached", "key_hi", "key_lo", "tokens", "parent", "parent_generation",
               "generation", "depth", "last_use", "clock"):
    np.testing.assert_array_equal(getattr(pool.prefix, name), getattr(rebuilt.prefix, name),
                                  err_msg=name)
  for a, b in zip(jax.tree.leaves(dataclasses.replace(pool, prefix=None)),
                  jax.tree.leaves(dataclasses.replace(rebuilt, prefix=None))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow   # hypothesis: -m slow runs it, not CI
@settings(deadline=None, max_examples=40)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 2), min_size=1,
                                                       max_size=18)), min_size=1, max_size=14))
def test_random_workloads_hit_only_equal_prefixes(ops):
  """Admit / free at random under page pressure: every hit holds the prompt's tokens
  (asserted in admit), and a prompt admitted again right after it was cached hits fully."""
  store = Store(num_pages=12, max_seqs=4, max_pages_per_seq=6)
  for seq, prompt in ops:
    if seq in store.tokens:
      store.free(seq)
      del store.tokens[seq]
    try:
      store.admit(seq, prompt)
    except ValueError as err:          # out of pages: the slot stays as match left it
      assert "out of pages" in str(err)
      store.free(seq)
      continue
    store.free(seq)
    del store.tokens[seq]
    assert store.admit(seq, prompt) == (len(prompt) - 1) // PAGE * PAGE


def test_match_and_cache_under_jit_equal_eager(rng):
  prompts = np.stack([prompt_of(SYSTEM, rng.integers(0, 50, 10)) for _ in range(3)])
  lengths = np.array([20, 14, 11], np.int32)

  def step(pool):
    pool, num_cached = pool.match_prefix(jnp.array([0, 1, -1]), prompts, lengths)
    pool, _ = pool.append(jnp.array([0, 1, 2]), jnp.asarray(lengths) - jnp.concatenate(
        [num_cached[:2], jnp.zeros((1,), jnp.int32)]))
    return pool.cache_pages(jnp.array([0, 1, 2]), prompts), num_cached

  store = Store()
  store.admit(3, prompt_of(SYSTEM, [1, 2]))
  eager_pool, eager_cached = step(store.pool)
  jit_pool, jit_cached = jax.jit(step)(store.pool)
  np.testing.assert_array_equal(eager_cached, [8, 8, 0])
  np.testing.assert_array_equal(jit_cached, eager_cached)
  for a, b in zip(jax.tree.leaves(jit_pool), jax.tree.leaves(eager_pool)):
    np.testing.assert_array_equal(a, b)
  check_invariants(jit_pool)


def test_under_jit_bad_rows_match_nothing():
  store = Store()
  store.admit(0, np.arange(16))
  pool, num_cached = jax.jit(lambda p: p.match_prefix(jnp.array([0, 1, 2]),
                                                      jnp.stack([jnp.arange(16)] * 3),
                                                      jnp.array([16, 0, 16])))(store.pool)
  np.testing.assert_array_equal(num_cached, [0, 0, 12])   # slot 0 is taken; length 0
  check_invariants(pool)


def test_bad_arguments():
  plain = PagePool.create(16, PAGE, 4, 4)
  with pytest.raises(ValueError, match="prefix_caching=True"):
    plain.match_prefix([0], np.zeros((1, 8), np.int32), [8])
  with pytest.raises(ValueError, match="prefix_caching=True"):
    plain.cache_pages([0], np.zeros((1, 8), np.int32))
  with pytest.raises(TypeError, match="prefix_caching"):
    PagePool.create(16, PAGE, 4, 4, prefix_caching=1)
  store = Store()
  store.admit(0, np.arange(8))
  pool = store.pool
  with pytest.raises(ValueError, match="not an empty sequence slot"):
    pool.match_prefix([0], np.zeros((1, 8), np.int32), [8])
  with pytest.raises(ValueError, match="out of range 1 .. 8"):
    pool.match_prefix([1], np.zeros((1, 8), np.int32), [9])
  with pytest.raises(ValueError, match="token_ids must be"):
    pool.match_prefix([1, 2], np.zeros((1, 8), np.int32), [8, 8])
  with pytest.raises(TypeError):
    pool.cache_pages([0], np.zeros((1, 8), np.float32))


def test_freed_cached_pages_are_not_listed_for_zeroing():
  store = Store()
  store.admit(0, np.arange(10))             # 2 cached pages and a partial one
  _, freed = store.pool.free([0], return_freed=True)
  table = np.asarray(store.pool.block_table[0, :3])
  np.testing.assert_array_equal(np.asarray(freed[0, :3]), [-1, -1, table[2]])


def _written_cache(num_blocks):
  return PagedKVCache.create(num_blocks, PAGE, 2, 8, layout="flash", dtype=jnp.float32)


def _write(cache, pool, seq, start, values):
  """Writes values [n, 2, 8] as K and -V at positions start.. of seq."""
  positions = np.arange(start, start + values.shape[0])
  slots = pool.slot_mapping(jnp.full(positions.shape, seq, jnp.int32), jnp.asarray(positions))
  return cache.write(0, jnp.asarray(values), -jnp.asarray(values), slots)


def _read(cache, pool, seq, length):
  key, value = cache.gather(0, pool.block_table[seq][None], jnp.array([length], jnp.int32))
  return np.asarray(key)[0, :length], np.asarray(value)[0, :length]


def test_host_tier_brings_evicted_pages_back(rng):
  """A cached prompt's pages are spilled before an append evicts them; a later match
  reloads them from pinned_host memory into fresh pages: the K/V read back equals what
  was written, and a prompt differing in its second page reloads only the first."""
  cache = _written_cache(9)                                    # 8 usable pages
  pool = PagePool.create(9, PAGE, 4, 8, prefix_caching=True)
  tier = HostPrefixCache.create(cache, num_blocks=4)
  prompt = rng.integers(0, 50, 10).astype(np.int32)                  # 2 full pages
  values = rng.standard_normal((10, 2, 8)).astype(np.float32)
  pool, _ = pool.append([0], [10])
  cache = _write(cache, pool, 0, 0, values)
  pool = pool.cache_pages([0], prompt[None]).free([0])
  assert tier.spill(pool, cache, need=5) == 0       # 5 empty pages suffice: nothing to copy
  assert tier.spill(pool, cache, need=8) == 2       # the 2 cached pages would be evicted
  pool, _ = pool.append([1], [32])                  # takes every page, evicting them
  cache = _write(cache, pool, 1, 0, rng.standard_normal((32, 2, 8)).astype(np.float32))
  assert int(pool.num_cached_pages) == 0
  pool = pool.free([1])
  pool, cache, num_cached = tier.match_prefix(pool, cache, [2], prompt[None], [10])
  assert int(num_cached[0]) == 8 and tier.reloaded == 2
  key, value = _read(cache, pool, 2, 8)
  np.testing.assert_array_equal(key, values[:8])
  np.testing.assert_array_equal(value, -values[:8])
  assert int(pool.num_cached_pages) == 2            # cached on the device again
  check_invariants(pool)
  other = prompt.copy()
  other[5] += 1                                     # page 1 differs
  pool, cache, num_cached = tier.match_prefix(pool, cache, [3], other[None], [10])
  assert int(num_cached[0]) == 4                    # page 0 shared on the device, no reload
  assert tier.reloaded == 2


def _three_cached_prompts(rng, host_blocks):
  """A pool of 8 usable pages holding 3 cached one-page prompts (free, least recently used
  first), and a host tier of host_blocks blocks."""
  cache = _written_cache(9)
  pool = PagePool.create(9, PAGE, 4, 8, prefix_caching=True)
  prompts = [rng.integers(0, 50, 5).astype(np.int32) for _ in range(3)]
  for seq, prompt in enumerate(prompts):
    pool, _ = pool.append([seq], [5])
    pool = pool.cache_pages([seq], prompt[None]).free([seq])
  return cache, pool, prompts, HostPrefixCache.create(cache, num_blocks=host_blocks)


def _evict_all(pool):
  pool, _ = pool.append([3], [32])
  assert int(pool.num_cached_pages) == 0
  return pool.free([3])


def _hits(tier, pool, cache, prompts):
  """Tokens each prompt finds (device, then host tier), admitted one by one."""
  hits = []
  for seq, prompt in enumerate(prompts):
    pool, cache, num_cached = tier.match_prefix(pool, cache, [seq], prompt[None], [5])
    hits.append(int(num_cached[0]))
  return hits


def test_host_tier_drops_its_least_recently_used_entry_when_full(rng):
  cache, pool, prompts, tier = _three_cached_prompts(rng, host_blocks=2)
  assert tier.spill(pool, cache, need=8) == 3       # the third copy replaces the first
  assert len(tier.entries) == 2
  pool = _evict_all(pool)
  assert _hits(tier, pool, cache, prompts) == [0, 4, 4]


def test_host_tier_confirms_tokens(rng, monkeypatch):
  """With one key for every prefix, the host tier keeps one entry and still returns it only
  for its own tokens."""
  monkeypatch.setattr(host_prefix, "_chain_keys", lambda pages, previous=b"": [b"same"] * len(pages))
  cache, pool, prompts, tier = _three_cached_prompts(rng, host_blocks=4)
  assert tier.spill(pool, cache, need=8) == 1
  pool = _evict_all(pool)
  assert _hits(tier, pool, cache, prompts) == [4, 0, 0]


def test_host_tier_is_eager(rng):
  cache, pool, prompts, tier = _three_cached_prompts(rng, host_blocks=2)
  with pytest.raises(TypeError, match="eagerly"):
    jax.jit(lambda p: tier.spill(p, cache, 8))(pool)
  with pytest.raises(ValueError, match="prefix_caching=True"):
    tier.spill(PagePool.create(9, PAGE, 4, 8), cache, 8)


def test_host_tier_match_rejects_bad_rows(rng):
  cache, pool, prompts, tier = _three_cached_prompts(rng, host_blocks=2)
  pool, _ = pool.append([0], [3])
  rows = np.stack([prompts[0]] * 2)
  for ids, lengths, match in (([0, 1], [5, 5], "empty sequence slots"),
                              ([1, 1], [5, 5], "distinct slots"),
                              ([1, 9], [5, 5], "distinct slots"),
                              ([1, 2], [5, 6], "lengths must be"),
                              ([1], [5], "token_ids must be")):
    with pytest.raises(ValueError, match=match):
      tier.match_prefix(pool, cache, ids, rows, lengths)


def test_a_page_is_kept_only_under_the_prefix_it_was_computed_after(monkeypatch):
  """Keys that collide across prefixes (one key per page index): row B = [TB0, T1] holds
  lower pages than row A = [TA0, T1], and a cached page holds TA0. B's page 1 wins its
  key, but its K/V followed TB0: it must not be cached as the page after TA0."""
  def page_index_keys(token_ids, page_size):
    pages = token_ids.shape[1] // page_size
    hi = jnp.broadcast_to(jnp.arange(1, pages + 1, dtype=jnp.uint32),
                          (token_ids.shape[0], pages))
    return hi, jnp.zeros_like(hi)
  monkeypatch.setattr(prefix_index, "prefix_keys", page_index_keys)
  first_a, first_b, second = [1] * 4, [2] * 4, [3] * 4
  pool = PagePool.create(32, PAGE, 4, 8, prefix_caching=True)
  pool, _ = pool.append([0], [4])
  pool = pool.cache_pages([0], np.array([first_a], np.int32))
  pool, _ = pool.append([1], [8])
  pool, _ = pool.append([2], [8])
  pool = pool.cache_pages([1, 2], np.array([first_b + second, first_a + second], np.int32))
  pool, num_cached = pool.match_prefix([3], np.array([first_a + second + [0]], np.int32), [9])
  assert int(num_cached[0]) == 4          # the page after TA0 was computed after TB0
  check_invariants(pool)


def test_eviction_takes_a_prefix_tail_first_and_recaching_heals_it():
  pool = PagePool.create(6, PAGE, 3, 8, prefix_caching=True)     # 5 usable pages
  prompt = np.arange(13, dtype=np.int32)
  pool, _ = pool.append([0], [13])
  pool = pool.cache_pages([0], prompt[None]).free([0])           # 3 pages cached
  pool, _ = pool.append([1], [12])      # 2 empty pages + 1 eviction: the prompt's last page
  pool = pool.free([1])
  pool, num_cached = pool.match_prefix([2], prompt[None], [13])
  assert int(num_cached[0]) == 8
  pool = pool.free([2])
  pool, _ = pool.append([0], [13])      # computed again: every page cached again
  pool = pool.cache_pages([0], prompt[None]).free([0])
  pool, num_cached = pool.match_prefix([2], prompt[None], [13])
  assert int(num_cached[0]) == 12
  check_invariants(pool)


def test_pages_under_an_evicted_parent_are_dropped_and_evicted_first():
  """When a prefix's head is taken (its pages all in use elsewhere), the cached pages
  after it can never match: the eviction drops them from the index at once, and append
  takes them like pages holding nothing."""
  pool = PagePool.create(5, PAGE, 3, 8, prefix_caching=True)     # 4 usable pages
  prompt = np.arange(9, dtype=np.int32)
  pool, _ = pool.append([0], [9])
  pool = pool.cache_pages([0], prompt[None]).free([0])           # pages 1, 2 cached
  assert np.nonzero(np.asarray(pool.prefix.cached))[0].tolist() == [1, 2]   # head, tail
  pool = dataclasses.replace(pool, prefix=prefix_index.evict(pool.prefix, jnp.arange(5) == 1,
                                                             8))
  assert int(pool.num_cached_pages) == 0
  keys = np.asarray(prefix_index.eviction_keys(pool.prefix, pool.ref_count == 0))
  assert (keys[1:] == 0).all()                                    # all taken first
  _, num_cached = pool.match_prefix([1], prompt[None], [9])
  assert int(num_cached[0]) == 0


def test_grandchildren_of_an_evicted_page_are_dropped_too():
  """A prefix cached after another one (sharing its first page, computed without a hit:
  its own pages) hangs under that prefix's head; when the head is evicted, every page
  below it (child, grandchild, ...) stops matching at once, so later appends take those
  before a reachable cached prefix."""
  store = Store(num_pages=12, max_seqs=4, max_pages_per_seq=8)
  store.admit(3, [7, 7, 7, 7, 8])                           # D: reachable, the oldest use
  head = list(range(100, 104))
  store.admit(0, head + [9])                                # A: its head page cached
  store.pool = store.pool.free([0])
  # B shares A's head by a hit, then caches three more pages under it.
  store.admit(1, head + list(range(200, 212)) + [5])
  b_pages = np.asarray(store.pool.block_table)[1, :4]
  store.pool = store.pool.free([1, 3])
  index = store.pool.prefix
  assert np.asarray(index.cached)[b_pages].all()
  evicted = dataclasses.replace(store.pool, prefix=prefix_index.evict(
      index, jnp.arange(12) == b_pages[0], 8))               # A / B's head taken
  cached = np.asarray(evicted.prefix.cached)
  assert not cached[b_pages].any()                          # child and grandchildren too
  assert int(evicted.num_cached_pages) == int(index.cached.sum()) - 4
  np.testing.assert_array_equal(evicted.prefix.cached, prefix_index.reachable(
      evicted.prefix, 8))
  check_invariants(evicted)


def test_host_tier_never_reuses_the_blocks_it_is_reloading(rng):
  """A full host tier reloading a prompt while the append it needs evicts other cached
  pages: those are not copied over the blocks being reloaded."""
  cache = _written_cache(9)
  pool = PagePool.create(9, PAGE, 4, 8, prefix_caching=True)
  tier = HostPrefixCache.create(cache, num_blocks=2)
  prompt = rng.integers(0, 50, 9).astype(np.int32)
  values = rng.standard_normal((9, 2, 8)).astype(np.float32)
  pool, _ = pool.append([0], [9])
  cache = _write(cache, pool, 0, 0, values)
  pool = pool.cache_pages([0], prompt[None]).free([0])
  assert tier.spill(pool, cache, need=8) == 2
  pool = _evict_all(pool)
  for seq in (1, 2):                     # two other cached pages, then no empty page
    pool, _ = pool.append([seq], [5])
    cache = _write(cache, pool, seq, 0, rng.standard_normal((5, 2, 8)).astype(np.float32))
    pool = pool.cache_pages([seq], rng.integers(50, 99, 5).astype(np.int32)[None]).free([seq])
  pool, _ = pool.append([3], [24])
  pool, cache, num_cached = tier.match_prefix(pool, cache, [1], prompt[None], [9])
  assert int(num_cached[0]) == 8
  key, _ = _read(cache, pool, 1, 8)
  np.testing.assert_array_equal(key, values[:8])


def test_host_tier_reload_out_of_pages_raises(rng):
  cache = _written_cache(9)
  pool = PagePool.create(9, PAGE, 4, 8, prefix_caching=True)
  tier = HostPrefixCache.create(cache, num_blocks=4)
  prompt = np.arange(9, dtype=np.int32)
  pool, _ = pool.append([0], [9])
  pool = pool.cache_pages([0], prompt[None]).free([0])
  tier.spill(pool, cache, need=8)
  pool = _evict_all(pool)
  pool, _ = pool.append([2], [28])                 # 1 free page; the hit needs 2
  with pytest.raises(ValueError, match="out of pages: reloading 2 pages"):
    tier.match_prefix(pool, cache, [1], prompt[None], [9])
