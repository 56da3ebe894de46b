"""The device-side prefix index of a :class:`~jkv.PagePool`: which pages hold which prompt
prefix, found by hash and confirmed token by token.

A cached page's identity is its tokens *and everything before them* (vLLM's rule): page j of a
sequence is keyed by a 64-bit hash of the sequence's tokens ``0 .. (j + 1) * page_size - 1``
(:func:`prefix_keys`: two 32-bit lanes, JAX runs without x64). A hash only finds a
candidate; a match is confirmed by

* the candidate page's stored tokens, equal to the prompt's tokens of that page, and
* its parent link ``(parent page, parent generation)``, equal to the page confirmed for the
  page before (the null page 0 for the first page). A page's ``generation`` grows each time
  it is cached again, so a link to a page evicted and reused for other content breaks.

By induction a confirmed run of pages holds exactly the prompt's tokens from position 0, so a
hash collision can only cost a hit, never return another prefix's K/V.

The index keeps every candidate key of the last :func:`cache` that proposed a new key,
sorted (``sorted_hi`` / ``sorted_page``, one entry per page: its key's hi lane if it was
cached before that call, its proposal's if it was proposed (never both), else empty, with
the lowest bit replaced by 0 for a cached page and 1 for a proposal, so one stable radix
sort of N 32-bit keys puts the cached page first among entries of equal ``hi & ~1``; not
compacted: an entry that was not cached keeps its key and points at the null page 0);
:func:`match` binary searches it (no sort). A page evicted (or unlinked) since the last
rebuild stays in the sorted arrays but fails the ``cached`` check. Both :func:`match` and
:func:`cache` (which keeps the arrays when every proposal has a holder) rely on one rule: a
page becomes cached only in a call that rebuilds them; a new path that marks pages cached
must rebuild too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jkv import pytree

_EMPTY = np.uint32(0xFFFFFFFF)   # key of an empty sorted entry (real keys: hi <= 0xFFFFFFFD)
_RUN = ~np.uint32(1)             # the bits of hi that group sorted entries into runs


@pytree.dataclass
class PrefixIndex:
  """Per-page prefix-cache state (N = num_pages, ps = page_size).

  Fields:
    cached: bool [N]; the page holds cached content (matchable; may have ref_count 0).
    key_hi, key_lo: uint32 [N]; the page's prefix key (meaningful where cached).
    tokens: int32 [N, ps]; the page's tokens (a copy: matches are confirmed against it).
    parent, parent_generation: int32 [N]; the page cached for the page before (0 for a
      first page) and that page's generation when the link was made.
    generation: int32 [N]; how many times the page was cached (wraps at 2**31).
    depth: int32 [N]; the page's index in its prefix (0: a first page).
    last_use: int32 [N]; clock of the last cache or hit (LRU eviction order).
    clock: int32 []; grows by one per match / cache call.
    sorted_hi: uint32 [N]; the last :func:`cache`'s candidate keys ascending, one per page:
      its hi lane with the lowest bit 0 for a page cached before that call and 1 for a
      proposal (ties in page order), empty entries (``0xFFFFFFFF``) last.
    sorted_page: int32 [N]; the page each sorted entry cached, 0 where it cached none (in an
      index built by this version only the first entry of a run of one ``hi & ~1`` holds a
      page; :func:`match` looks at that entry only).
  """
  cached: jax.Array
  key_hi: jax.Array
  key_lo: jax.Array
  tokens: jax.Array
  parent: jax.Array
  parent_generation: jax.Array
  generation: jax.Array
  depth: jax.Array
  last_use: jax.Array
  clock: jax.Array
  sorted_hi: jax.Array
  sorted_page: jax.Array

  @classmethod
  def create(cls, num_pages: int, page_size: int) -> "PrefixIndex":
    def zeros():   # a buffer per field: a donated pool must not hold one buffer twice
      return jnp.zeros((num_pages,), jnp.int32)

    def empty(size=num_pages):
      return jnp.full((size,), _EMPTY, jnp.uint32)

    return cls(cached=jnp.zeros((num_pages,), jnp.bool_), key_hi=empty(), key_lo=empty(),
               tokens=jnp.zeros((num_pages, page_size), jnp.int32), parent=zeros(),
               parent_generation=zeros(), generation=zeros(), depth=zeros(), last_use=zeros(),
               clock=jnp.zeros((), jnp.int32), sorted_hi=empty(),
               sorted_page=zeros())

  @property
  def page_size(self) -> int:
    return self.tokens.shape[1]


def fmix32(h):
  """MurmurHash3's 32-bit finalizer (uint32 -> uint32, a bijection that spreads bits)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def prefix_keys(token_ids, page_size: int):
  """64-bit keys of every full page of ``token_ids`` int [B, L]: (hi, lo) uint32 [B, L //
  page_size]; page j's key hashes tokens 0 .. (j + 1) * page_size - 1 (their values and
  positions). Each lane sums a per-(position, token) mix (prefix sums: no sequential
  chain), then mixes the sum; hi is clamped to ``0xFFFFFFFD``, so that with its lowest bit
  set (a proposal's sorted key) it stays below the empty entry ``0xFFFFFFFF``."""
  batch, length = token_ids.shape
  pages = length // page_size
  tokens = token_ids[:, :pages * page_size].astype(jnp.uint32)
  position = jnp.arange(pages * page_size, dtype=jnp.uint32)[None, :]
  lanes = []
  for seed in (0x9E3779B9, 0x7F4A7C15):
    term = fmix32(tokens * jnp.uint32(0x01000193) + fmix32(position + jnp.uint32(seed)))
    sums = jnp.cumsum(term.reshape(batch, pages, page_size).sum(axis=2, dtype=jnp.uint32),
                      axis=1, dtype=jnp.uint32)
    lanes.append(fmix32(sums ^ jnp.uint32(seed)))
  return jnp.minimum(lanes[0], _EMPTY - np.uint32(2)), lanes[1]


def _sort_by(key, values):
  """(key, values) in ascending ``key`` uint32 [N] order, ties in their given order (values
  int32 [N]): one stable sort of (key, value) pairs (a radix sort on the GPU; a 64-bit key
  would take two, more operands XLA's slower comparator sort)."""
  return jax.lax.sort((key, values), num_keys=1, is_stable=True)


def _lower_bound(sorted_key, key):
  """First index of ``sorted_key`` [n] not below ``key`` [...] (int32): a branchless binary
  search that sets the answer's bits from the highest down. Each step carries one value, so
  XLA fuses the whole search into one kernel (a search carrying a (start, stop) pair split
  into a kernel per step or two)."""
  size = sorted_key.shape[0]
  count = jnp.zeros(key.shape, jnp.uint32)    # entries known to be below key (unsigned:
  step = 1 << (size.bit_length() - 1)         # no negative-index wrap in the gathers)
  while step:
    probe = jnp.minimum(count + np.uint32(step), np.uint32(size))
    count = jnp.where(sorted_key[probe - np.uint32(1)] < key, probe, count)
    step >>= 1
  return count.astype(jnp.int32)


def linked(index: PrefixIndex):
  """bool [N]: cached pages whose parent link still holds (a first page, or a parent cached
  under the generation the link names). A cached page whose parent was evicted can never
  match again: :func:`cache` drops it and eviction takes it first."""
  parent = index.parent
  return index.cached & ((parent == 0) | (index.cached[parent]
                                          & (index.parent_generation == index.generation[parent])))


def _run_page(index: PrefixIndex, hi):
  """int32 [...]: the page the sorted index holds for the run of each key's ``hi & ~1``
  (one page per run, :func:`cache` keeps the first entry; 0 where no run has it). The page
  may have been evicted since the index was sorted: callers check ``cached``."""
  at = jnp.minimum(_lower_bound(index.sorted_hi, hi & _RUN), index.sorted_hi.shape[0] - 1)
  return jnp.where((index.sorted_hi[at] & _RUN) == (hi & _RUN), index.sorted_page[at], 0)


def _leading(confirmed):
  """bool [B, P]: the leading run of True of each row of ``confirmed`` bool [B, P]."""
  return jnp.cumsum(~confirmed, axis=1) == 0


def _previous(pages):
  """int32 [B, P]: the page before each page of a row (the null page 0 before the first)."""
  return jnp.concatenate([jnp.zeros_like(pages[:, :1]), pages[:, :-1]], axis=1)


def _token_pages(token_ids, page_size):
  batch, length = token_ids.shape
  pages = length // page_size
  return token_ids[:, :pages * page_size].astype(jnp.int32).reshape(batch, pages, page_size)


def match(index: PrefixIndex, token_ids, usable_pages, valid):
  """The longest confirmed cached run of each prompt's full pages.

  token_ids int [B, L]; usable_pages int32 [B] (at most this many pages per row); valid
  bool [B]. Returns (index with the hits' last_use and the clock advanced, pages int32 [B,
  L // page_size] (0 past the run), run length int32 [B]).
  """
  page_size = index.page_size
  hi, lo = prefix_keys(token_ids, page_size)
  page = _run_page(index, hi)
  candidate = jnp.where((index.key_hi[page] == hi) & (index.key_lo[page] == lo), page, 0)
  column = jnp.arange(hi.shape[1], dtype=jnp.int32)[None, :]
  allowed = (column < usable_pages[:, None]) & valid[:, None]
  previous = _previous(candidate)
  run = _leading((candidate > 0) & allowed & index.cached[candidate]
                 & jnp.all(index.tokens[candidate] == _token_pages(token_ids, page_size), axis=2)
                 & (index.parent[candidate] == previous)
                 & (index.parent_generation[candidate] == index.generation[previous]))
  pages = jnp.where(run, candidate, 0)
  num_pages = index.cached.shape[0]
  last_use = index.last_use.at[jnp.where(run, pages, num_pages)].set(index.clock, mode="drop")
  index = dataclasses.replace(index, last_use=last_use, clock=index.clock + 1)
  return index, pages, jnp.sum(run, axis=1, dtype=jnp.int32)


def cache(index: PrefixIndex, block_table, token_ids, full_pages):
  """Makes the first ``full_pages`` [B] pages of each row cached content.

  block_table int32 [B, P'] the rows' pages; token_ids int [B, L] their tokens (page j of a
  row holds tokens j * ps .. (j + 1) * ps - 1); full_pages int32 [B] (0 for rows to skip).
  A page whose key is cached already (on another page, or proposed by a lower-numbered page
  of this call) is not cached twice, nor is a key whose ``hi & ~1`` equals such a key's (a
  31-bit collision: a lost hit, never a wrong one); a row's pages are cached only as far as
  its run is confirmed (its tokens equal those stored for each key). Returns the index,
  sorted arrays rebuilt where a new key was proposed (kept otherwise).
  """
  page_size = index.page_size
  # Pages whose parent was evicted stop holding their keys (one level of descendants a
  # call; deeper ones fail the parent check until their turn).
  index = dataclasses.replace(index, cached=linked(index))
  hi, lo = prefix_keys(token_ids, page_size)
  batch, pages = hi.shape
  if batch * pages == 0:                         # no full page to cache
    return dataclasses.replace(index, clock=index.clock + 1)
  table = block_table[:, :pages]
  if table.shape[1] < pages:
    table = jnp.pad(table, ((0, 0), (0, pages - table.shape[1])))
  column = jnp.arange(pages, dtype=jnp.int32)[None, :]
  wanted = column < jnp.minimum(full_pages, table.shape[1])[:, None]
  # A held page already cached keeps its key: a row whose key differs there stops.
  proposed = wanted & ~index.cached[table] & (table > 0)
  token_pages = _token_pages(token_ids, page_size)
  # holder: the page cached under each key's hi & ~1 (0: none). A proposal with a holder
  # loses to it and changes nothing; where every proposal does (a prompt served again), the
  # sorted arrays stay (the rebuild's N-key sort is most of a call's time) and the rows'
  # runs are only confirmed, for their last use.
  holder = _run_page(index, hi)
  holder = jnp.where(index.cached[holder], holder, 0)
  return jax.lax.cond(jnp.any(proposed & (holder == 0)), _cache_proposals, _confirm_cached,
                      index, table, hi, lo, token_pages, wanted, proposed, holder)


def _confirm_cached(index, table, hi, lo, token_pages, wanted, proposed, holder):
  """:func:`cache` where every proposal loses to a holder (or none is made): each row's run
  of cached pages (its own, or the holders of its proposals) that hold its keys, tokens and
  parent links gets the clock as its last use."""
  num_pages = index.cached.shape[0]
  row_page = jnp.where(index.cached[table], table, jnp.where(proposed, holder, 0))
  previous = _previous(row_page)
  run = _leading(wanted & index.cached[row_page] & (index.key_hi[row_page] == hi)
                 & (index.key_lo[row_page] == lo)
                 & jnp.all(index.tokens[row_page] == token_pages, axis=2)
                 & (index.parent[row_page] == previous)
                 & (index.parent_generation[row_page] == index.generation[previous]))
  return dataclasses.replace(
      index, last_use=index.last_use.at[jnp.where(run, row_page, num_pages)].set(
          index.clock, mode="drop"),
      clock=index.clock + 1)


def _cache_proposals(index, table, hi, lo, token_pages, wanted, proposed, holder):
  """:func:`cache` with a proposal of a new key: proposals are confirmed and the sorted
  arrays rebuilt (holder: unused, see :func:`cache`)."""
  del holder
  page_size = index.page_size
  num_pages = index.cached.shape[0]
  batch, pages = hi.shape
  column = jnp.arange(pages, dtype=jnp.int32)[None, :]
  # proposer[p]: the (row, column), flattened, that proposes page p (one of them where rows
  # share a page), -1 for none. Proposals are read through it: nothing of the index is
  # rewritten before the runs are confirmed.
  flat = jnp.arange(batch * pages, dtype=jnp.int32)
  proposer = jnp.full((num_pages,), -1, jnp.int32).at[
      jnp.where(proposed, table, num_pages).reshape(-1)].set(flat, mode="drop")
  is_proposal = proposer >= 0
  proposal_hi = jnp.where(is_proposal, hi.reshape(-1)[jnp.maximum(proposer, 0)], _EMPTY)
  proposal_lo = jnp.where(is_proposal, lo.reshape(-1)[jnp.maximum(proposer, 0)], _EMPTY)
  # Candidates, one per page (a page is cached or proposed, never both): its hi lane with
  # the lowest bit 0 where cached and 1 where proposed, so one stable sort of N 32-bit keys
  # puts a cached page first among equal keys (then proposals in page order).
  page_ids = jnp.arange(num_pages, dtype=jnp.int32)
  sorted_hi, sorted_pages = _sort_by(
      jnp.where(index.cached, index.key_hi & _RUN,
                jnp.where(is_proposal, proposal_hi | np.uint32(1), _EMPTY)), page_ids)
  # Runs of one hi & ~1: the first entry of a run holds its key, so the index holds one page
  # per run (a run mixing two keys, a 31-bit collision, loses the later key's hits: its rows
  # fail the key check below). canonical[p]: the first page of proposal p's run (0 for a
  # page not proposed); p wins (tentatively: runs are confirmed below) where that is p.
  first_page = sorted_pages[_lower_bound(sorted_hi, sorted_hi & _RUN)]
  canonical = jnp.where(is_proposal,
                        jnp.zeros((num_pages,), jnp.int32).at[sorted_pages].set(first_page), 0)
  wins = is_proposal & (canonical == page_ids)
  row_page = jnp.where(index.cached[table], table, canonical[table])
  previous = _previous(row_page)
  generation = jnp.where(wins, index.generation + 1, index.generation)
  previous_generation = generation[previous]
  # The tentative state of each row's pages: a won proposal's from its proposer.
  won = wins[row_page]
  source = jnp.maximum(proposer[row_page], 0)     # the proposer where won
  flat_previous = previous.reshape(-1)
  agree = jnp.where(won, proposal_hi[row_page] == hi, index.key_hi[row_page] == hi) & jnp.where(
      won, proposal_lo[row_page] == lo, index.key_lo[row_page] == lo)
  held_tokens = jnp.where(won[..., None], token_pages.reshape(-1, page_size)[source],
                          index.tokens[row_page])
  parent = jnp.where(won, flat_previous[source], index.parent[row_page])
  parent_generation = jnp.where(won, generation[flat_previous[source]],
                                index.parent_generation[row_page])
  run = _leading(agree & wanted & (index.cached[row_page] | won)
                 & jnp.all(held_tokens == token_pages, axis=2) & (parent == previous)
                 & (parent_generation == previous_generation))
  # A won proposal is kept only where a row holding it confirms its run there: its K/V
  # was computed after that row's prefix (another row confirming through it would vouch
  # for a prefix the page was not computed with).
  kept = jnp.zeros((num_pages,), jnp.bool_).at[
      jnp.where(run & proposed, table, num_pages)].set(True, mode="drop")
  wins = wins & kept
  # Each kept page's proposer writes its tokens, parent link and depth (in place).
  writes = jnp.where(wins[table] & (proposer[table] == flat.reshape(batch, pages)), table,
                     num_pages)
  return dataclasses.replace(
      index, cached=index.cached | wins,
      key_hi=jnp.where(wins, proposal_hi, index.key_hi),
      key_lo=jnp.where(wins, proposal_lo, index.key_lo),
      tokens=index.tokens.at[writes].set(token_pages, mode="drop"),
      parent=index.parent.at[writes].set(previous, mode="drop"),
      parent_generation=index.parent_generation.at[writes].set(previous_generation,
                                                               mode="drop"),
      generation=jnp.where(wins, generation, index.generation),
      depth=index.depth.at[writes].set(jnp.broadcast_to(column, table.shape), mode="drop"),
      last_use=index.last_use.at[jnp.where(run, row_page, num_pages)].set(index.clock,
                                                                          mode="drop"),
      clock=index.clock + 1, sorted_hi=sorted_hi,
      sorted_page=jnp.where((index.cached | wins)[sorted_pages], sorted_pages, 0))


_AGE_LIMIT = (1 << 23) - 1     # clock ticks of age told apart by eviction (older: one age)
_DEPTH_LIMIT = (1 << 8) - 1


def eviction_keys(index: PrefixIndex, is_free):
  """uint32 [N]: the order :meth:`PagePool.append` takes free pages in, ascending, ties by
  page: 0 for pages holding nothing (or cached under a broken parent link), then cached
  pages least recently used first and, among pages of one use, the deepest first (a
  prefix loses its tail before its head); ``0xFFFFFFFF`` for pages not free."""
  age = jnp.minimum(index.clock - index.last_use, _AGE_LIMIT).astype(jnp.uint32)
  depth = jnp.minimum(index.depth, _DEPTH_LIMIT).astype(jnp.uint32)
  cached_key = 1 + (((_AGE_LIMIT - age) << 8) | (_DEPTH_LIMIT - depth))
  return jnp.where(~is_free, _EMPTY, jnp.where(linked(index), cached_key, 0))


def eviction_order(index: PrefixIndex, is_free):
  """Free pages' ranks in the order :meth:`PagePool.append` takes them
  (:func:`eviction_keys`): int32 [N], N for pages not free."""
  num_pages = is_free.shape[0]
  page = jnp.arange(num_pages, dtype=jnp.int32)
  order = _sort_by(eviction_keys(index, is_free), page)[1]
  rank = jnp.zeros((num_pages,), jnp.int32).at[order].set(page)
  return jnp.where(is_free, rank, num_pages)


def reachable(index: PrefixIndex, max_depth: int):
  """bool [N]: cached pages whose every parent link holds back to a first page, the pages
  a match can reach (:func:`linked` looks one link up). Pointer jumping over chains of at
  most ``max_depth`` pages (static): ceil(log2(max_depth)) rounds of gathers."""
  ok = linked(index).at[0].set(True)           # the null page 0 ends every chain
  up = jnp.where(index.cached, index.parent, 0)
  for _ in range(max(1, (max_depth - 1).bit_length())):
    ok = ok & ok[up]
    up = up[up]
  return index.cached & ok


def evict(index: PrefixIndex, taken, max_depth: int):
  """The index after pages ``taken`` (bool [N]) were handed out: they stop matching now,
  and so do the pages cached after them (children, grandchildren, ...: no match reaches
  them), which the next appends take first. ``max_depth``: the longest chain of pages
  (static; the pool's max_pages_per_seq)."""
  return dataclasses.replace(index, cached=reachable(
      dataclasses.replace(index, cached=index.cached & ~taken), max_depth))
