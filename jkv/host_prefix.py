"""The host tier of the prefix cache: :class:`HostPrefixCache` keeps copies of cached pages
in ``pinned_host`` memory (the blocks of a :class:`~jkv.HostKVCache`), so a prefix the
device pool evicted can come back by one batched copy instead of being recomputed.

* ``spill(pool, cache, need)`` copies to the host the cached pages that an ``append`` of
  ``need`` pages would evict (the same order ``PagePool.append`` takes them in: pages
  holding nothing first, then cached pages least recently used first);
* ``match_prefix(pool, cache, seq_ids, token_ids, lengths)`` runs the device match, then
  continues each prompt's run with host pages: fresh device pages are appended, the blocks
  copied in (one :func:`jkv.swap_blocks` per block array) and cached again on the device.

Host entries are keyed by a SHA-256 chain over the prefix (page j's key hashes page j - 1's
key and page j's tokens), and each entry keeps its page's tokens, compared again on every
hit. When the host blocks run out, the least recently used entry is dropped. Managed
eagerly from Python (numpy bookkeeping, like :class:`~jkv.HostKVCache`); the object is
updated in place.
"""

from __future__ import annotations

import collections
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jkv import prefix_index
from jkv.cache import PagedKVCache
from jkv.host_cache import HostKVCache, copy_blocks_between, require_eager

_ROOT = b""


def _chain_keys(pages_tokens: np.ndarray, previous: bytes = _ROOT) -> list[bytes]:
  """SHA-256 chain keys of a prefix's pages, int [P, page_size] -> P digests (``previous``:
  the key of the page before the first)."""
  keys = []
  for tokens in pages_tokens:
    previous = hashlib.sha256(previous + np.asarray(tokens, np.int32).tobytes()).digest()
    keys.append(previous)
  return keys


class HostPrefixCache:
  """Cached pages spilled to ``pinned_host`` memory, found again by their prefix.

  Attributes:
    storage: the :class:`~jkv.HostKVCache` whose blocks hold the pages (its per-sequence
      table is not used).
    entries: OrderedDict {prefix key: (host block, tokens int32 [page_size])}, least
      recently used first.
    spilled, reloaded: pages copied to / back from the host so far.
  """

  def __init__(self, storage: HostKVCache):
    self.storage = storage
    self.entries: collections.OrderedDict[bytes, tuple[int, np.ndarray]] = (
        collections.OrderedDict())
    # (device page, generation) -> prefix key of a copied page: a descendant spilled after
    # its ancestor's device page was reused still finds its prefix key.
    self.key_of_page: dict[tuple[int, int], bytes] = {}
    self.spilled = 0
    self.reloaded = 0

  @classmethod
  def create(cls, like: PagedKVCache, num_blocks: int) -> "HostPrefixCache":
    """An empty host tier of ``num_blocks`` blocks for caches shaped like ``like``."""
    return cls(HostKVCache.create(like, num_blocks, max_seqs=1, max_pages_per_seq=1))

  @property
  def num_blocks(self) -> int:
    return self.storage.free.shape[0]

  def _take_block(self, protected=frozenset()) -> int | None:
    """A free host block, else the block of the least recently used entry not in
    ``protected`` (that entry is dropped); None when every block is protected."""
    free = np.nonzero(self.storage.free)[0]
    if free.size:
      block = int(free[0])
    else:
      key = next((k for k, (b, _) in self.entries.items() if b not in protected), None)
      if key is None:
        return None
      block, _ = self.entries.pop(key)
      if len(self.key_of_page) > 4 * self.num_blocks:    # forget dropped keys (amortized)
        self.key_of_page = {k: v for k, v in self.key_of_page.items() if v in self.entries}
    self.storage.free[block] = False
    return block

  def spill(self, pool, cache: PagedKVCache, need: int, *, backend: str = "auto",
            protected=frozenset()) -> int:
    """Copies to the host the cached pages an append of ``need`` pages would evict (those
    whose prefix the host lacks; host blocks in ``protected`` are never reused). Returns
    the pages copied."""
    require_eager(pool, cache, "HostPrefixCache")
    index = pool.prefix
    if index is None:
      raise ValueError("spill needs a pool made with PagePool.create(..., prefix_caching=True)")
    keys = np.asarray(_eviction_keys(index, pool.ref_count))
    empty = int(np.sum(keys == 0))          # free pages holding nothing matchable
    if need <= empty:
      return 0
    victims = np.argsort(keys, kind="stable")[empty:need]   # append's order, ties by page
    victims = victims[keys[victims] != 0xFFFFFFFF]
    tokens = np.asarray(index.tokens)
    parent = np.asarray(index.parent)
    parent_generation = np.asarray(index.parent_generation)
    generation = np.asarray(index.generation)
    pairs = []
    for page in victims:
      # Walk up to the first page (or to an ancestor copied earlier), links checked.
      chain, key = [int(page)], _ROOT
      while parent[chain[-1]] != 0:
        up, up_generation = int(parent[chain[-1]]), int(parent_generation[chain[-1]])
        if self.key_of_page.get((up, up_generation)) in self.entries:
          key = self.key_of_page[(up, up_generation)]
          break
        if up_generation != generation[up]:
          chain = None                       # an ancestor was reused: unreachable content
          break
        chain.append(up)
      if chain is None:
        continue
      for link in chain[::-1]:
        key = _chain_keys(tokens[link][None], key)[0]
      self.key_of_page[(int(page), int(generation[page]))] = key
      if key in self.entries:
        self.entries.move_to_end(key)
        continue
      block = self._take_block(protected)
      if block is None:
        continue
      self.entries[key] = (block, tokens[page].copy())
      pairs.append((int(page), block))
    if pairs:
      host_cache = copy_blocks_between(cache, self.storage.cache,
                                       np.asarray(pairs, np.int32), backend)
      self.storage = HostKVCache(cache=host_cache, block_table=self.storage.block_table,
                                 seq_lens=self.storage.seq_lens, free=self.storage.free)
      self.spilled += len(pairs)
    return len(pairs)

  def match_prefix(self, pool, cache: PagedKVCache, seq_ids, token_ids, lengths, *,
                   backend: str = "auto"):
    """``PagePool.match_prefix``, each run continued with pages found on the host (copied
    into fresh device pages and cached there again). Returns ``(pool, cache, num_cached
    int32 [B])``; ``cache`` is donated when host pages come back."""
    require_eager(pool, cache, "HostPrefixCache")
    ids = np.asarray(seq_ids).reshape(-1)
    prompts = np.asarray(token_ids)
    lengths = np.asarray(lengths).reshape(-1)
    _check_rows(pool, ids, prompts, lengths)
    pool, num_cached = _match(pool, jnp.asarray(ids, jnp.int32), jnp.asarray(prompts),
                              jnp.asarray(lengths, jnp.int32))
    page_size = pool.page_size
    found = np.asarray(num_cached) // page_size
    extra = np.zeros_like(found)
    blocks = []
    for row, seq in enumerate(ids):
      usable = min((int(lengths[row]) - 1) // page_size, pool.max_pages_per_seq)
      if seq < 0 or usable <= found[row]:
        continue
      pages = prompts[row, :usable * page_size].reshape(usable, page_size)
      for j, key in enumerate(_chain_keys(pages)):
        if j < found[row]:
          continue
        entry = self.entries.get(key)
        if entry is None or not np.array_equal(entry[1], pages[j]):
          break
        self.entries.move_to_end(key)
        blocks.append(entry[0])
        extra[row] += 1
    if not blocks:
      return pool, cache, num_cached
    if len(blocks) > int(pool.num_free_pages):
      raise ValueError(f"out of pages: reloading {len(blocks)} pages from the host tier, "
                       f"{int(pool.num_free_pages)} are free")
    # Copy what the append below evicts; the blocks being reloaded stay.
    self.spill(pool, cache, len(blocks), backend=backend, protected=frozenset(blocks))
    reloading = jnp.asarray(np.where(extra > 0, ids, -1), jnp.int32)
    pool = _append(pool, reloading, jnp.asarray(extra * page_size, jnp.int32))
    table = np.asarray(pool.block_table)
    device_pages = np.concatenate([table[seq, found[row]:found[row] + extra[row]]
                                   for row, seq in enumerate(ids) if extra[row]])
    cache = copy_blocks_between(self.storage.cache, cache,
                                np.stack([np.asarray(blocks, np.int32), device_pages], 1),
                                backend)
    pool = _cache_pages(pool, reloading, jnp.asarray(prompts))
    self.reloaded += len(blocks)
    return pool, cache, num_cached + jnp.asarray(extra * page_size, jnp.int32)


# The pool's steps, jitted (eager, each would dispatch its dozens of ops one by one).
_match = jax.jit(lambda pool, ids, prompts, lengths: pool.match_prefix(ids, prompts, lengths))
_append = jax.jit(lambda pool, ids, counts: pool.append(ids, counts)[0])
_cache_pages = jax.jit(lambda pool, ids, prompts: pool.cache_pages(ids, prompts))
_eviction_keys = jax.jit(lambda index, ref_count: prefix_index.eviction_keys(index,
                                                                           ref_count == 0))


def _check_rows(pool, ids, prompts, lengths):
  """The eager checks of ``PagePool.match_prefix`` (the jitted match skips bad rows)."""
  if prompts.ndim != 2 or prompts.shape[0] != ids.size or lengths.shape != ids.shape:
    raise ValueError(f"token_ids must be [B, L] and lengths [B] with B = {ids.size}, got "
                     f"{prompts.shape} and {lengths.shape}")
  used = ids[ids >= 0]
  if (used >= pool.max_seqs).any() or np.unique(used).size != used.size:
    raise ValueError(f"seq_ids must be distinct slots below {pool.max_seqs} (or < 0)")
  if (np.asarray(pool.seq_lens)[used] > 0).any():
    raise ValueError("match_prefix fills empty sequence slots")
  if ((lengths[ids >= 0] < 1) | (lengths[ids >= 0] > prompts.shape[1])).any():
    raise ValueError(f"lengths must be in 1 .. {prompts.shape[1]}")
