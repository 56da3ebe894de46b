"""A jit-able page allocator: :class:`PagePool`.

The pool hands out the pages (blocks) of a paged cache to sequences. It is a pytree of
small int32 arrays, updated functionally and vectorised over many sequences at once, so
it lives in the carry of a ``lax.while_loop`` decode loop next to the cache:

* ``append(seq_ids, num_tokens)`` grows sequences, taking free pages (lowest first);
* ``free(seq_ids)`` releases them (``return_freed=True`` also lists the pages that became
  free, for ``PagedKVCache.zero_blocks``); ``fork(parent_ids, child_ids)`` shares a parent's pages
  with an empty child (reference counts);
* copy-on-write: appending to a sequence whose last, partly filled page is shared gives
  the sequence a fresh page and returns the ``(src, dst)`` pair the caller copies in the
  cache (``copies`` of :meth:`PagePool.append`) before writing into it.

Page 0 is the null page: never handed out, every unused block-table entry points at it.
Appends are all or nothing: if the pages do not suffice, nothing changes and, eagerly, a
``ValueError`` says so; under jit the sticky ``out_of_pages`` flag is set instead.

Prefix caching (``create(..., prefix_caching=True)``, :mod:`jkv.prefix_index`):

* ``cache_pages(seq_ids, token_ids)`` makes a sequence's full, written pages cached content
  for their tokens;
* ``match_prefix(seq_ids, token_ids, lengths)`` gives empty slots the longest run of cached
  full pages equal to their prompts (shared, not copied), confirmed token by token;
* a cached page no sequence holds stays matchable until ``append`` needs it: ``append``
  takes pages holding nothing first, then cached free pages least recently used first.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jkv import errors, pages as pages_lib, prefix_index, pytree


@pytree.dataclass
class PagePool:
  """Pages of a paged cache and the sequences that hold them.

  Fields:
    ref_count: int32 [num_pages]; how many sequences hold each page (0: free). Page 0,
      the null page, is pinned at 1.
    block_table: int32 [max_seqs, max_pages_per_seq]; a sequence slot's pages in order,
      0 past its last page (vLLM's block table, ready for ``jkv.pages`` and attention).
    seq_lens: int32 [max_seqs]; tokens held per sequence slot (0: empty slot).
    out_of_pages: bool []; set (and kept) when an append under jit did not fit.
    prefix: the prefix cache's :class:`~jkv.prefix_index.PrefixIndex`, or None (off).
  Static: page_size (tokens per page).
  """
  ref_count: jax.Array
  block_table: jax.Array
  seq_lens: jax.Array
  out_of_pages: jax.Array
  page_size: int = pytree.static()
  prefix: prefix_index.PrefixIndex | None = None

  @classmethod
  def create(cls, num_pages: int, page_size: int, max_seqs: int, max_pages_per_seq: int, *,
             prefix_caching: bool = False):
    """An empty pool; ``prefix_caching=True`` adds the prefix index (``match_prefix``,
    ``cache_pages``; ``4 * page_size + 45`` bytes per page)."""
    errors.check_int_scalar("num_pages", num_pages)
    if num_pages < 2:
      raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
    for name, size in (("page_size", page_size), ("max_seqs", max_seqs),
                       ("max_pages_per_seq", max_pages_per_seq)):
      errors.check_size(name, size)
    if not isinstance(prefix_caching, bool):
      raise TypeError(f"prefix_caching must be a bool, got {prefix_caching!r}")
    return cls(ref_count=jnp.zeros((num_pages,), jnp.int32).at[0].set(1),
               block_table=jnp.zeros((max_seqs, max_pages_per_seq), jnp.int32),
               seq_lens=jnp.zeros((max_seqs,), jnp.int32),
               out_of_pages=jnp.zeros((), jnp.bool_), page_size=page_size,
               prefix=(prefix_index.PrefixIndex.create(num_pages, page_size)
                       if prefix_caching else None))

  @property
  def num_pages(self) -> int:
    return self.ref_count.shape[0]

  @property
  def max_seqs(self) -> int:
    return self.block_table.shape[0]

  def split_dims(self) -> dict[str, tuple[int | None, int | None]]:
    """{array field: (dim split over dp, dim split over tp)}: a pool is replicated (small;
    its free-page search is global); a pool per dp shard: :mod:`jkv.sharded_pools`."""
    return dict.fromkeys(pytree.fields(self)[0], (None, None))

  @property
  def max_pages_per_seq(self) -> int:
    return self.block_table.shape[1]

  @property
  def num_free_pages(self):
    """int32 []: pages no sequence holds (cached ones among them stay matchable until an
    append takes them)."""
    return jnp.sum(self.ref_count == 0, dtype=jnp.int32)

  @property
  def num_cached_pages(self):
    """int32 []: pages holding matchable prefix content (0 without prefix caching)."""
    if self.prefix is None:
      return jnp.zeros((), jnp.int32)
    return jnp.sum(self.prefix.cached, dtype=jnp.int32)

  def pages_of(self, seq_lens):
    """Pages needed for seq_lens tokens (int)."""
    seq_lens = jnp.asarray(seq_lens)
    errors.check_int("seq_lens", seq_lens)
    return (seq_lens + self.page_size - 1) // self.page_size

  def _clipped_ids(self, name, seq_ids, unique: bool = True):
    """int32 [B], entries < 0 ignored; eagerly range- and (``unique``) duplicate-checked.
    Returns (ids clipped for gathers, in-range mask)."""
    seq_ids = jnp.asarray(seq_ids)
    errors.check_int(name, seq_ids)
    seq_ids = seq_ids.astype(jnp.int32).reshape(-1)
    if errors.is_concrete(seq_ids):
      ids = np.asarray(seq_ids)
      bad = np.nonzero(ids >= self.max_seqs)[0]
      if bad.size:
        raise ValueError(f"{name}[{bad[0]}] = {ids[bad[0]]} is out of range: the pool has "
                         f"{self.max_seqs} sequence slots")
      used = ids[ids >= 0]
      if unique and np.unique(used).size != used.size:
        raise ValueError(f"{name} has duplicate sequence ids")
    in_range = (seq_ids >= 0) & (seq_ids < self.max_seqs)
    return jnp.clip(seq_ids, 0, self.max_seqs - 1), in_range

  def _seq_ids(self, name, seq_ids):
    """:meth:`_clipped_ids`, the mask also false for a later duplicate (ignored under jit)."""
    ids, in_range = self._clipped_ids(name, seq_ids)
    earlier = jnp.tril(ids[:, None] == ids[None, :], k=-1) & in_range[None, :]
    return ids, in_range & ~jnp.any(earlier, axis=1)

  def append(self, seq_ids, num_tokens, *, max_new_pages: int | None = None):
    """Grows sequences ``seq_ids`` [B] by ``num_tokens`` [B] tokens each (ids < 0 ignored).

    max_new_pages: static bound on the pages one call may take (default B x
      max_pages_per_seq, always enough).
    Returns ``(pool, copies)``: copies int32 [B, 2] (src, dst) pages to copy in the
    cache before writing (copy-on-write of a shared, partly filled last page), -1 if none.
    Eagerly raises ValueError when the pages (or a sequence's table) do not suffice.
    """
    ids, in_range = self._clipped_ids("seq_ids", seq_ids)
    batch = ids.shape[0]
    entry = jnp.arange(batch, dtype=jnp.int32)
    # entry_of_slot[s]: the first entry naming slot s (batch: none); later duplicates are
    # ignored under jit (eagerly they raised).
    entry_of_slot = jnp.full((self.max_seqs,), batch, jnp.int32).at[
        jnp.where(in_range, ids, self.max_seqs)].min(entry, mode="drop")
    valid = in_range & (entry_of_slot[ids] == entry)
    num_tokens = errors.int_array("num_tokens", num_tokens)
    errors.check_int("num_tokens", num_tokens)
    errors.check_shape("num_tokens", num_tokens.reshape(-1), ids.shape)
    count = jnp.where(valid, num_tokens.astype(jnp.int32).reshape(-1), 0)
    if errors.is_concrete(count) and (np.asarray(count) < 0).any():
      raise ValueError("num_tokens must be >= 0")
    if max_new_pages is not None:
      errors.check_size("max_new_pages", max_new_pages)
    bound = max_new_pages or batch * self.max_pages_per_seq
    lens = self.seq_lens[ids]
    # At most one token past the table (which does not fit): lens + count must not wrap in
    # int32 (a wrapped length passed the fit check and leaked pages).
    asked, count = count, jnp.clip(count, 0, self.max_pages_per_seq * self.page_size - lens + 1)
    old_pages = self.pages_of(lens)
    new_pages = self.pages_of(lens + count)
    last = self.block_table[ids, jnp.maximum(old_pages - 1, 0)]
    cow = (count > 0) & (lens % self.page_size != 0) & (self.ref_count[last] > 1)
    need = new_pages - old_pages + cow.astype(jnp.int32)
    is_free = self.ref_count == 0
    total = jnp.sum(need)
    fits = ((total <= jnp.sum(is_free, dtype=jnp.int32)) & (total <= bound)
            & jnp.all(new_pages <= self.max_pages_per_seq))
    if errors.is_concrete(fits) and not bool(fits):
      wanted = -(-(np.asarray(lens, np.int64) + np.asarray(asked)) // self.page_size)
      raise ValueError(_why_not(self, np.asarray(total), bound, wanted))
    need = jnp.where(fits, need, 0)
    total = jnp.where(fits, total, 0)
    free_rank, prefix = self._take_free(is_free, total)   # the order pages are taken in
    start = pages_lib.inclusive_sum(need) - need             # first new page's rank, per seq
    free = jnp.zeros((bound,), jnp.int32).at[jnp.where(is_free, free_rank, bound)].set(
        jnp.arange(self.num_pages, dtype=jnp.int32), mode="drop", unique_indices=True)
    # Each slot's new pages fill columns first_column .. new_pages - 1 with free pages of
    # ranks start .. start + need - 1 (a copy-on-write sequence replaces its last page).
    first_column = old_pages - cow.astype(jnp.int32)
    b = jnp.minimum(entry_of_slot, batch - 1)[:, None]                 # [max_seqs, 1]
    column = jnp.arange(self.max_pages_per_seq, dtype=jnp.int32)[None, :]
    taking = ((entry_of_slot[:, None] < batch) & (column >= first_column[b])
              & (column < first_column[b] + need[b]))
    table = jnp.where(taking, free[jnp.clip(start[b] + column - first_column[b], 0, bound - 1)],
                      self.block_table)
    copying = cow & fits
    taken = is_free & (free_rank < total)
    ref = jnp.where(taken, 1, self.ref_count)
    ref = ref.at[jnp.where(copying, last, self.num_pages)].add(-1, mode="drop")
    copies = jnp.stack([jnp.where(copying, last, -1),
                        jnp.where(copying, free[jnp.minimum(start, bound - 1)], -1)], axis=1)
    grown = fits & (entry_of_slot < batch)
    b = b[:, 0]
    lens_new = jnp.where(grown, lens[b] + count[b], self.seq_lens)
    pool = dataclasses.replace(
        self, ref_count=ref, block_table=table, seq_lens=lens_new,
        out_of_pages=self.out_of_pages | ~fits, prefix=prefix)
    return pool, copies

  def _take_free(self, is_free, total):
    """(int32 [num_pages]: the order free pages are taken in (>= the free count
    elsewhere), the prefix index once the first ``total`` are taken (None without prefix
    caching)). Lowest first; with prefix caching, pages holding nothing first, then cached
    pages least recently used first, deepest first among equals
    (:func:`jkv.prefix_index.eviction_keys`; sorted, and the pages below an evicted one
    unlinked, only when the first kind does not suffice: one branch)."""
    if self.prefix is None:
      return pages_lib.inclusive_sum(is_free) - 1, None
    index = self.prefix
    empty = is_free & ~prefix_index.linked(index)           # holding nothing matchable
    never = jnp.iinfo(jnp.int32).max       # past every rank (scattered out of bounds)

    def holding_nothing():
      rank = jnp.where(empty, pages_lib.inclusive_sum(empty) - 1, never)
      return rank, index.cached & ~(is_free & (rank < total))

    def evicting():
      rank = prefix_index.eviction_order(index, is_free)
      evicted = prefix_index.evict(index, is_free & (rank < total), self.max_pages_per_seq)
      return rank, evicted.cached

    rank, cached = jax.lax.cond(total <= jnp.sum(empty, dtype=jnp.int32), holding_nothing,
                                evicting)
    return rank, dataclasses.replace(index, cached=cached)

  def free(self, seq_ids, *, return_freed: bool = False):
    """Releases sequences ``seq_ids`` [B] (ids < 0 ignored): their pages lose a holder and
    their slots become empty.

    return_freed (static): also return the pages that became free, int32 [B,
      max_pages_per_seq] (-1 elsewhere; pages still shared are not freed), e.g. for
      ``PagedKVCache.zero_blocks`` when freed pages must not keep old data.
    Returns the pool, or ``(pool, freed)``.
    """
    ids, valid = self._seq_ids("seq_ids", seq_ids)
    pages = self.block_table[ids]                                   # [B, P]
    used = (jnp.arange(self.max_pages_per_seq)[None, :]
            < self.pages_of(self.seq_lens[ids])[:, None]) & valid[:, None]
    ref = self.ref_count.at[jnp.where(used, pages, self.num_pages)].add(-1, mode="drop")
    rows = jnp.where(valid, ids, self.max_seqs)
    pool = dataclasses.replace(
        self, ref_count=ref, block_table=self.block_table.at[rows].set(0, mode="drop"),
        seq_lens=self.seq_lens.at[rows].set(0, mode="drop"))
    if not return_freed:
      return pool
    freed = used & (ref[pages] == 0)
    if self.prefix is not None:
      freed = freed & ~self.prefix.cached[pages]
    return pool, jnp.where(freed, pages, -1)

  def fork(self, parent_ids, child_ids) -> "PagePool":
    """Children (empty slots) share their parents' pages and length (beam search,
    parallel sampling); a later append copies a shared, partly filled last page.
    parent_ids, child_ids int [B] (< 0 ignored); a parent may have several children in
    one call, a child one parent."""
    parents, parent_ok = self._clipped_ids("parent_ids", parent_ids, unique=False)
    children, child_ok = self._seq_ids("child_ids", child_ids)
    if parents.shape != children.shape:
      raise ValueError(f"parent_ids and child_ids must have one shape, got {parents.shape} "
                       f"and {children.shape}")
    ok = parent_ok & child_ok & (parents != children)
    if errors.is_concrete(ok) and errors.is_concrete(self.seq_lens):
      taken = np.asarray(self.seq_lens)[np.asarray(children)] > 0
      if (taken & np.asarray(ok)).any():
        raise ValueError("child_ids must be empty sequence slots")
      if np.isin(np.asarray(children)[np.asarray(ok)], np.asarray(parents)[np.asarray(ok)]).any():
        raise ValueError("a sequence cannot be both a parent and a child in one fork")
    ok = ok & (self.seq_lens[children] == 0)
    lens = self.seq_lens[parents]
    pages = self.block_table[parents]
    used = (jnp.arange(self.max_pages_per_seq)[None, :] < self.pages_of(lens)[:, None]) & ok[:, None]
    ref = self.ref_count.at[jnp.where(used, pages, self.num_pages)].add(1, mode="drop")
    rows = jnp.where(ok, children, self.max_seqs)
    return dataclasses.replace(
        self, ref_count=ref,
        block_table=self.block_table.at[rows].set(jnp.where(used, pages, 0), mode="drop"),
        seq_lens=self.seq_lens.at[rows].set(lens, mode="drop"))

  def _prefix_index(self, method):
    if self.prefix is None:
      raise ValueError(f"{method} needs a pool made with PagePool.create(..., "
                       f"prefix_caching=True)")
    return self.prefix

  def _token_rows(self, token_ids, batch):
    token_ids = jnp.asarray(token_ids)
    errors.check_int("token_ids", token_ids)
    if token_ids.ndim != 2 or token_ids.shape[0] != batch:
      raise ValueError(f"token_ids must be [B, L] with B = {batch} (one row per sequence id), "
                       f"got shape {tuple(token_ids.shape)}")
    return token_ids

  def match_prefix(self, seq_ids, token_ids, lengths):
    """Shares with each empty slot ``seq_ids`` [B] (ids < 0 ignored) the longest run of cached
    full pages equal to its prompt: ``token_ids`` int [B, L], ``lengths`` int [B] (1 .. L).

    The run stops before the page holding the prompt's last token (its logits must be
    computed) and at the block table's width. The slots' block tables and lengths are set
    (length = the tokens matched) and the pages gain a holder: a hit copies no K/V; the
    caller appends and computes the rest of each prompt from ``num_cached``.
    Returns ``(pool, num_cached int32 [B])`` (a multiple of page_size; 0 for ignored ids).
    Eagerly raises ValueError for a slot that is not empty or a length out of range; under
    jit such a row matches nothing.
    """
    index = self._prefix_index("match_prefix")
    ids, valid = self._seq_ids("seq_ids", seq_ids)
    token_ids = self._token_rows(token_ids, ids.shape[0])
    lengths = jnp.asarray(lengths)
    errors.check_int("lengths", lengths)
    errors.check_shape("lengths", lengths.reshape(-1), ids.shape)
    lengths = lengths.astype(jnp.int32).reshape(-1)
    length_ok = (lengths >= 1) & (lengths <= token_ids.shape[1])
    empty = self.seq_lens[ids] == 0
    if errors.is_concrete(valid) and errors.is_concrete(lengths) and errors.is_concrete(empty):
      bad = np.nonzero(np.asarray(valid) & ~np.asarray(length_ok))[0]
      if bad.size:
        raise ValueError(f"lengths[{bad[0]}] = {int(lengths[bad[0]])} is out of range 1 .. "
                         f"{token_ids.shape[1]} (the width of token_ids)")
      taken = np.nonzero(np.asarray(valid) & ~np.asarray(empty))[0]
      if taken.size:
        raise ValueError(f"seq_ids[{taken[0]}] = {int(ids[taken[0]])} is not an empty "
                         f"sequence slot: match_prefix fills empty slots")
    valid = valid & length_ok & empty
    usable = jnp.minimum((lengths - 1) // self.page_size, self.max_pages_per_seq)
    index, pages, run = prefix_index.match(index, token_ids, usable, valid)
    width = self.max_pages_per_seq
    pages = (pages[:, :width] if pages.shape[1] >= width
             else jnp.pad(pages, ((0, 0), (0, width - pages.shape[1]))))
    rows = jnp.where(valid, ids, self.max_seqs)
    num_cached = run * self.page_size
    pool = dataclasses.replace(
        self, prefix=index,
        ref_count=self.ref_count.at[jnp.where(pages > 0, pages, self.num_pages)].add(
            1, mode="drop"),
        block_table=self.block_table.at[rows].set(pages, mode="drop"),
        seq_lens=self.seq_lens.at[rows].set(num_cached, mode="drop"))
    return pool, num_cached

  def cache_pages(self, seq_ids, token_ids) -> "PagePool":
    """Makes the full pages of sequences ``seq_ids`` [B] (ids < 0 ignored) cached content
    for their tokens ``token_ids`` int [B, L] (each row from position 0; pages past the
    slot's length or past L are left out). Call it after their K/V is written. Idempotent;
    a page whose tokens (and everything before them) are cached already on another page is
    not cached twice (the sequence keeps its own page, uncached)."""
    index = self._prefix_index("cache_pages")
    ids, valid = self._seq_ids("seq_ids", seq_ids)
    token_ids = self._token_rows(token_ids, ids.shape[0])
    full_pages = jnp.where(valid, self.seq_lens[ids] // self.page_size, 0)
    return dataclasses.replace(
        self, prefix=prefix_index.cache(index, self.block_table[ids], token_ids, full_pages))

  def slot_mapping(self, seq_ids, positions):
    """Cache slots of tokens at ``positions`` [B] of sequences ``seq_ids`` [B] (-1 for an
    id < 0 or a position past the sequence's pages)."""
    seq_ids = errors.int_array("seq_ids", seq_ids)
    positions = errors.int_array("positions", positions)
    errors.check_int("seq_ids", seq_ids)
    errors.check_int("positions", positions)
    errors.check_shape("positions", positions, seq_ids.shape)
    if errors.is_concrete(seq_ids):
      ids = np.asarray(seq_ids).reshape(-1)
      bad = np.nonzero(ids >= self.max_seqs)[0]
      if bad.size:
        raise ValueError(f"seq_ids[{bad[0]}] = {ids[bad[0]]} is out of range: the pool has "
                         f"{self.max_seqs} sequence slots")
    seq_ids, positions = seq_ids.astype(jnp.int32), positions.astype(jnp.int32)
    held = (positions // self.page_size
            < self.pages_of(self.seq_lens[jnp.clip(seq_ids, 0, self.max_seqs - 1)]))
    return pages_lib.slot_mapping(self.block_table, jnp.where(held, seq_ids, -1), positions,
                                  self.page_size)


def _why_not(pool, total, bound, new_pages):
  over = np.nonzero(new_pages > pool.max_pages_per_seq)[0]
  if over.size:
    return (f"out of pages: a sequence would need {int(new_pages[over[0]])} pages, its block "
            f"table has {pool.max_pages_per_seq}")
  if total > bound:
    return f"the append needs {int(total)} pages, more than max_new_pages={bound}"
  return (f"out of pages: the append needs {int(total)} pages, "
          f"{int(pool.num_free_pages)} are free")
