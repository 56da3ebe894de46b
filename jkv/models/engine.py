"""A continuous-batching engine loop: chunked prefill and decode in one ragged step.

Requests (:class:`Request`: a prompt and a number of tokens to generate) arrive in a queue.
Every step, the host scheduler (:class:`Engine`) frees the sequence slots of finished
requests (their pages go back to the :class:`PagePool`), admits waiting requests into free
slots while the pages they will need are free, and packs one ragged batch under a token
budget: one row for every decoding request, then chunks of the prompts still being
prefilled. :func:`ragged_step`, one ``jax.jit`` with static shapes (``token_budget`` rows,
``max_seqs`` slots) for every batch mix, appends the step's pages from the pool, runs the
model (:mod:`jkv.models.llama`) with every layer's K/V written and attended in one
``PagedKVCache.write_and_attend_ragged`` (ragged paged attention over the paged cache), and
returns the logits of each sequence's last row; the cache and the pool are donated. A
request whose prompt is complete samples greedily from its last row.

:meth:`Engine.check` recomputes every finished request's logits without a cache
(:func:`jkv.models.llama.forward_full`) and compares them with the logits the engine
sampled from.

With ``prefix_caching=True`` the pool keeps a prefix cache (:mod:`jkv.prefix_index`): each
admitted request first takes the longest run of cached full pages equal to its prompt
(``PagePool.match_prefix``, shared pages, no K/V copied) and prefills only the rest; every
step caches the full pages it wrote (``PagePool.cache_pages``), prompt and generated tokens
alike. ``Engine.cached_tokens`` counts the prompt tokens the cache saved. With
``host_prefix_blocks > 0`` too, a :class:`~jkv.HostPrefixCache` copies the cached pages each
step's append would evict to ``pinned_host`` memory first, and admissions continue their
device hits with pages copied back from there.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jkv.cache import PagedKVCache
from jkv.host_prefix import HostPrefixCache
from jkv.models import llama
from jkv.page_pool import PagePool


@dataclasses.dataclass
class Request:
  """A prompt (int [P], P >= 1) and how many tokens to generate (>= 1)."""
  prompt: np.ndarray
  max_new_tokens: int
  generated: list = dataclasses.field(default_factory=list)
  logits: list = dataclasses.field(default_factory=list)   # float32 [V] per generated token
  computed: int = 0          # tokens whose K/V the cache holds

  @property
  def tokens(self) -> np.ndarray:
    return np.concatenate([np.asarray(self.prompt, np.int32),
                           np.asarray(self.generated, np.int32)])

  @property
  def done(self) -> bool:
    return len(self.generated) >= self.max_new_tokens


@functools.partial(jax.jit, static_argnames=("config", "backend"),
                   donate_argnames=("cache", "pool"))
def ragged_step(params, config: llama.LlamaConfig, cache: PagedKVCache, pool: PagePool,
                free_ids, tokens, positions, row_seq, q_lens, last_rows, known_tokens=None, *,
                backend: str = "auto"):
  """One engine step over a ragged batch (all int32; shapes static).

  free_ids [S]: slots to release first (-1: none); tokens / positions / row_seq [T]: each
  row's token, position and slot (row_seq -1 for padding rows), rows grouped by slot in
  slot order; q_lens [S]: rows per slot; last_rows [S]: each slot's last row (any row when
  it has none); known_tokens [S, W] (a prefix-caching pool): each slot's tokens from
  position 0, whose full written pages the step caches. Returns ``(logits float32 [S, V]
  of each slot's last row, cache, pool)``.
  """
  pool = pool.free(free_ids)
  slots = jnp.arange(q_lens.shape[0], dtype=jnp.int32)
  pool, _ = pool.append(jnp.where(q_lens > 0, slots, -1), q_lens)
  slot_mapping = pool.slot_mapping(row_seq, positions)
  cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens)])
  kv_lens = pool.seq_lens
  scale = config.head_dim ** -0.5

  def layer_body(carry, inputs):
    x, cache = carry
    layer, index = inputs
    q, k, v = llama.qkv(layer, config, x, positions)
    attn, cache = cache.write_and_attend_ragged(index, q, k, v, slot_mapping, pool.block_table,
                                                kv_lens, cu_q_lens, scale=scale,
                                                backend=backend)
    return (llama.finish_layer(layer, config, x, attn), cache), None

  (x, cache), _ = jax.lax.scan(layer_body, (params["embed"][tokens], cache),
                               llama.layers_with_index(params, config))
  if pool.prefix is not None:
    pool = pool.cache_pages(jnp.where(q_lens > 0, slots, -1), known_tokens)
  return llama.lm_logits(params, config, x[last_rows]), cache, pool


@functools.partial(jax.jit, donate_argnames=("pool",))
def _free(pool: PagePool, free_ids):
  return pool.free(free_ids)


@functools.partial(jax.jit, donate_argnames=("pool",))
def _free_and_match(pool: PagePool, free_ids, seq_ids, prompts, lengths):
  """Frees ``free_ids`` [S], then matches the admitted slots ``seq_ids`` [S] (-1: none)
  against the prefix cache. Returns (pool, tokens cached per slot int32 [S])."""
  return pool.free(free_ids).match_prefix(seq_ids, prompts, lengths)


class Engine:
  """The host side: a request queue, sequence slots, and the step loop.

  max_seqs: sequence slots (S); token_budget: query rows per step (T, >= max_seqs so every
  decoding request gets its row); the cache's pages back a :class:`PagePool` of
  ``max_pages_per_seq`` pages per slot.
  """

  def __init__(self, params, config: llama.LlamaConfig, cache: PagedKVCache, *,
               max_seqs: int, token_budget: int, max_pages_per_seq: int,
               prefix_caching: bool = False, host_prefix_blocks: int = 0,
               backend: str = "auto"):
    if token_budget < max_seqs:
      raise ValueError(f"token_budget ({token_budget}) must be >= max_seqs ({max_seqs}): "
                       f"every decoding sequence takes a row each step")
    self.params, self.config, self.cache, self.backend = params, config, cache, backend
    self.max_seqs, self.token_budget = max_seqs, token_budget
    self.page_size = cache.block_size
    self.max_pages_per_seq = max_pages_per_seq
    self.pool = PagePool.create(cache.num_blocks, cache.block_size, max_seqs,
                                max_pages_per_seq, prefix_caching=prefix_caching)
    if host_prefix_blocks and not prefix_caching:
      raise ValueError("host_prefix_blocks needs prefix_caching=True")
    self.host_prefix = (HostPrefixCache.create(cache, host_prefix_blocks)
                        if host_prefix_blocks else None)
    self.free_pages = cache.num_blocks - 1          # page 0 is the pool's null page
    self.slots: list[Request | None] = [None] * max_seqs
    self.reserved = [0] * max_seqs                  # pages promised to each slot's request
    self.waiting: list[Request] = []
    self.finished: list[Request] = []
    self.steps = 0
    self.decode_rows = 0
    self.prefill_rows = 0
    self.mixed_steps = 0
    self.prompt_tokens = 0                          # of admitted requests
    self.cached_tokens = 0                          # of those, found in the prefix cache

  def add(self, request: Request) -> None:
    prompt = np.asarray(request.prompt)
    if prompt.ndim != 1 or prompt.size < 1 or request.max_new_tokens < 1:
      raise ValueError("a request needs a 1-D prompt of >= 1 token and max_new_tokens >= 1")
    if not np.issubdtype(prompt.dtype, np.integer):
      raise TypeError(f"a request's prompt must hold integer token ids, got dtype {prompt.dtype}")
    vocab = self.config.vocab_size
    bad = np.nonzero((prompt < 0) | (prompt >= vocab))[0]
    if bad.size:   # (the jitted embedding lookup would clamp it: another prompt)
      raise ValueError(f"prompt[{bad[0]}] = {prompt[bad[0]]} is not a token id of the "
                       f"model's vocabulary (0..{vocab - 1})")
    total = prompt.size + request.max_new_tokens
    if total > self.config.max_position:
      raise ValueError(f"a request of {total} tokens exceeds the model's max_position "
                       f"({self.config.max_position})")
    pages = -(-total // self.page_size)
    if pages > self.max_pages_per_seq or pages > self.cache.num_blocks - 1:
      raise ValueError(f"a request of {total} tokens needs {pages} pages; a sequence may hold "
                       f"{min(self.max_pages_per_seq, self.cache.num_blocks - 1)}")
    self.waiting.append(request)

  def _pages(self, request: Request) -> int:
    return -(-(len(request.prompt) + request.max_new_tokens) // self.page_size)

  def _schedule(self):
    """Frees finished slots, admits waiting requests, packs the batch (numpy arrays)."""
    free_ids = np.full(self.max_seqs, -1, np.int32)
    for s, request in enumerate(self.slots):
      if request is not None and request.done:
        self.finished.append(request)
        self.slots[s] = None
        self.free_pages += self.reserved[s]
        self.reserved[s] = 0
        free_ids[s] = s
    admitted = np.full(self.max_seqs, -1, np.int32)
    for s in range(self.max_seqs):
      if self.slots[s] is None and self.waiting and self._pages(self.waiting[0]) <= self.free_pages:
        request = self.waiting.pop(0)
        self.slots[s] = request
        # Pages of the whole request stay reserved even when a prefix hit shares some:
        # shared pages are held already, so the pool's free pages only grow.
        self.reserved[s] = self._pages(request)
        self.free_pages -= self.reserved[s]
        self.prompt_tokens += len(request.prompt)
        admitted[s] = s
    if self.pool.prefix is not None:
      free_ids = self._match(free_ids, admitted)
    budget = self.token_budget
    q_lens = np.zeros(self.max_seqs, np.int32)
    for s, request in enumerate(self.slots):   # decodes first: one row each
      if request is not None and request.computed >= len(request.prompt):
        q_lens[s] = 1
        budget -= 1
    for s, request in enumerate(self.slots):   # then prompt chunks, in slot order
      if request is not None and request.computed < len(request.prompt) and budget > 0:
        q_lens[s] = min(len(request.prompt) - request.computed, budget)
        budget -= q_lens[s]
    rows = self.token_budget
    tokens = np.zeros(rows, np.int32)
    positions = np.zeros(rows, np.int32)
    row_seq = np.full(rows, -1, np.int32)
    last_rows = np.zeros(self.max_seqs, np.int32)
    row = 0
    for s, request in enumerate(self.slots):
      if q_lens[s] == 0:
        continue
      all_tokens = request.tokens
      span = slice(row, row + q_lens[s])
      tokens[span] = all_tokens[request.computed:request.computed + q_lens[s]]
      positions[span] = np.arange(request.computed, request.computed + q_lens[s])
      row_seq[span] = s
      row += q_lens[s]
      last_rows[s] = row - 1
    return free_ids, tokens, positions, row_seq, q_lens, last_rows

  def _match(self, free_ids, admitted):
    """Frees ``free_ids`` and matches the ``admitted`` slots' prompts against the prefix
    cache (one jitted call); a hit starts the request past its cached tokens. Returns the
    free ids left for the step (none)."""
    width = self.max_pages_per_seq * self.page_size
    prompts = np.zeros((self.max_seqs, width), np.int32)
    lengths = np.ones(self.max_seqs, np.int32)
    for s in np.nonzero(admitted >= 0)[0]:
      prompt = self.slots[s].prompt
      prompts[s, :len(prompt)] = prompt
      lengths[s] = len(prompt)
    if self.host_prefix is None:
      self.pool, num_cached = _free_and_match(self.pool, jnp.asarray(free_ids),
                                              jnp.asarray(admitted), jnp.asarray(prompts),
                                              jnp.asarray(lengths))
    else:
      self.pool, self.cache, num_cached = self.host_prefix.match_prefix(
          _free(self.pool, jnp.asarray(free_ids)), self.cache, admitted, prompts, lengths,
          backend=self.backend)
    for s, cached in enumerate(np.asarray(num_cached)):
      if admitted[s] >= 0:
        self.slots[s].computed = int(cached)
        self.cached_tokens += int(cached)
    return np.full(self.max_seqs, -1, np.int32)

  def _known_tokens(self):
    """int32 [S, W]: each slot's tokens from position 0 (for ``cache_pages``)."""
    known = np.zeros((self.max_seqs, self.max_pages_per_seq * self.page_size), np.int32)
    for s, request in enumerate(self.slots):
      if request is not None:
        tokens = request.tokens
        known[s, :len(tokens)] = tokens
    return known

  def step(self) -> bool:
    """Runs one step; False when there was nothing to do."""
    free_ids, tokens, positions, row_seq, q_lens, last_rows = self._schedule()
    if not q_lens.any():
      if (free_ids >= 0).any():   # the last finished requests: their pages go back too
        self.pool = _free(self.pool, jnp.asarray(free_ids))
      return False
    known = None if self.pool.prefix is None else jnp.asarray(self._known_tokens())
    if self.host_prefix is not None:     # copy what this step's append would evict
      computed = np.array([0 if r is None else r.computed for r in self.slots])
      need = int(np.sum(-(-(computed + q_lens) // self.page_size)
                        - -(-computed // self.page_size)))
      self.host_prefix.spill(self.pool, self.cache, need, backend=self.backend)
    logits, self.cache, self.pool = ragged_step(
        self.params, self.config, self.cache, self.pool, jnp.asarray(free_ids),
        jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(row_seq),
        jnp.asarray(q_lens), jnp.asarray(last_rows), known, backend=self.backend)
    logits = np.asarray(logits)
    decodes = prefills = 0
    for s, request in enumerate(self.slots):
      if q_lens[s] == 0:
        continue
      if request.computed >= len(request.prompt):
        decodes += 1
      else:
        prefills += int(q_lens[s])
      request.computed += int(q_lens[s])
      if request.computed >= len(request.prompt) and len(request.tokens) == request.computed:
        request.logits.append(logits[s])
        request.generated.append(int(np.argmax(logits[s])))
    self.steps += 1
    self.decode_rows += decodes
    self.prefill_rows += prefills
    self.mixed_steps += int(decodes > 0 and prefills > 0)
    return True

  def run(self, progress: bool = False) -> float:
    """Steps until every request is finished (their pages back in the pool); returns the
    seconds it took (the first step compiles: for timings, run a warm-up request first,
    on this engine or another of the same sizes)."""
    total = len(self.waiting) + sum(r is not None for r in self.slots) + len(self.finished)
    start = time.perf_counter()
    while self.step():
      if progress:
        done = len(self.finished)
        bar = "#" * (30 * done // max(total, 1))
        print(f"\r  [{bar:30s}] step {self.steps}, {done}/{total} requests done",
              end="", file=sys.stderr, flush=True)
    if progress:
      print(file=sys.stderr)
    jax.block_until_ready(self.cache)
    return time.perf_counter() - start

  def check(self, requests) -> float:
    """max |engine logit - full recompute logit| over every generated token of
    ``requests`` (finished), one padded batch through the cache-free model."""
    length = max(len(r.prompt) + r.max_new_tokens for r in requests)
    batch = np.zeros((len(requests), length), np.int32)
    for i, r in enumerate(requests):
      batch[i, :len(r.tokens)] = r.tokens
    full = np.asarray(jax.jit(llama.forward_full, static_argnums=1)(self.params, self.config,
                                                                    jnp.asarray(batch)))
    error = 0.0
    for i, r in enumerate(requests):
      first = len(r.prompt) - 1
      expected = full[i, first:first + len(r.generated)]
      error = max(error, float(np.max(np.abs(np.stack(r.logits) - expected))))
    return error
