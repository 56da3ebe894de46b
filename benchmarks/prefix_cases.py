"""Prefix caching benchmark cases (section "prefix" of RESULTS.md): admitting 256 requests
of 2K tokens into a PagePool with a prefix cache, device time inside one jit.

DESCRIPTION (below) goes into RESULTS.md with the table.
"""

from __future__ import annotations

DESCRIPTION = """A PagePool of 65,536 pages of 16 tokens, 512 sequence slots of up to 128
pages. 256 earlier requests of 2,048 tokens (a shared 1,024-token system prompt + 1,024
tokens of their own) were computed, cached with `cache_pages` and freed (their pages stay
cached). 256 new requests of 2,048 tokens enter empty slots, then leave (`free`, so the
chain repeats). 'warm': the new prompts are the earlier ones: `match_prefix` (hash, binary
search in the sorted index, token-by-token confirmation) finds 127 of 128 pages each, and
`cache_pages` confirms them (it proposes no new page, so the sorted index is kept: no
sort); no `append` is needed (the last page is never matched). 'warm, last page computed':
as an engine serves them again: `append` takes a page for the last 16 tokens and
`cache_pages` proposes it, under a key an earlier page holds (it loses: the index is kept,
no sort). 'warm, match only': the same as 'warm' without `cache_pages`. 'cold': each
call's prompts share only the system prompt: 64 pages hit, `append` takes 65 pages per
request and `cache_pages` caches 64 of them (16K new pages a call: its one stable radix
sort of the candidates rebuilds the index), so the pool fills and `append` evicts cached
pages least recently used first (its sorted path). Baselines: `append` of 2,048 tokens +
`free` without prefix caching, and `free` alone. Device time per chain step from unrolled
chains (the timing method is stamped above). A hit copies no K/V: the matched pages are
shared by reference count (checked below the table's run, and in
tests/test_prefix_cache.py). Engine rows: the continuous-batching engine
(jkv.models.engine, a 4-layer Llama-style model, hidden 512, bf16 cache, 4 slots, 256 rows
a step) serves 16 prompts of 1,024 tokens, each asked twice (all 16, then all 16 again),
with pages for 4 requests at a time in the device pool (80 pages of 16 tokens past the 4
slots' needs): without prefix caching, with it (the device pool evicts most prompts before
they come again), and with a 1,024-block host tier (evicted pages copied to pinned_host
memory and back). Time: wall-clock seconds of the whole run (host scheduling included),
after a warm-up run of the same workload; the hit rate (prompt tokens found cached) is in
the implementation column."""

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from benchmarks.timing import per_call_seconds
from jkv.models import engine as engine_lib, llama

NUM_PAGES, PAGE, SLOTS, PAGES_PER_SEQ = 65536, 16, 512, 128
REQUESTS, LENGTH, SYSTEM = 256, 2048, 1024
VOCAB = 32000
N_SMALL, N_LARGE = 8, 24


def _prompts(rng, count):
  system = rng.integers(0, VOCAB, SYSTEM)
  own = rng.integers(0, VOCAB, (count, REQUESTS, LENGTH - SYSTEM))
  return np.concatenate([np.broadcast_to(system, (count, REQUESTS, SYSTEM)), own],
                        axis=2).astype(np.int32)


def _cached_pool(earlier, prefix_caching=True):
  pool = jkv.PagePool.create(NUM_PAGES, PAGE, SLOTS, PAGES_PER_SEQ,
                             prefix_caching=prefix_caching)
  if not prefix_caching:
    return pool
  slots = jnp.arange(REQUESTS, dtype=jnp.int32)

  @jax.jit
  def fill(pool, earlier):
    pool, _ = pool.append(slots, jnp.full((REQUESTS,), LENGTH, jnp.int32))
    return pool.cache_pages(slots, earlier).free(slots)

  return fill(pool, jnp.asarray(earlier))


def run(record):
  """``record(case, impl, seconds, nbytes)``."""
  rng = np.random.default_rng(0)
  earlier = _prompts(rng, 1)[0]
  slots = jnp.arange(REQUESTS, 2 * REQUESTS, dtype=jnp.int32)
  lengths = jnp.full((REQUESTS,), LENGTH, jnp.int32)

  def warm(pool, prompts):
    pool, _ = pool.match_prefix(slots, prompts, lengths)
    return pool.cache_pages(slots, prompts).free(slots)

  def warm_last_page(pool, prompts):
    pool, num_cached = pool.match_prefix(slots, prompts, lengths)
    pool, _ = pool.append(slots, lengths - num_cached)
    return pool.cache_pages(slots, prompts).free(slots)

  def cold(pool, prompts):
    pool, num_cached = pool.match_prefix(slots, prompts, lengths)
    pool, _ = pool.append(slots, lengths - num_cached)
    return pool.cache_pages(slots, prompts).free(slots)

  base = _cached_pool(earlier)
  fresh = _prompts(np.random.default_rng(1), N_LARGE)
  fresh[:, :, :SYSTEM] = earlier[0, :SYSTEM]
  cases = {
      "warm": ("match_prefix + cache_pages + free",
               lambda: (jax.tree.map(jnp.copy, base), jnp.asarray(earlier)),
               lambda state, i: (warm(state[0], state[1]), state[1])),
      "warm, last page computed": ("match_prefix + append + cache_pages + free",
                                   lambda: (jax.tree.map(jnp.copy, base), jnp.asarray(earlier)),
                                   lambda state, i: (warm_last_page(*state), state[1])),
      "cold": ("match_prefix + append + cache_pages + free",
               lambda: (jax.tree.map(jnp.copy, base), jnp.asarray(fresh)),
               lambda state, i: (cold(state[0], state[1][i]), state[1])),
      "warm, match only": ("match_prefix + free",
                           lambda: (jax.tree.map(jnp.copy, base), jnp.asarray(earlier)),
                           lambda state, i: (state[0].match_prefix(slots, state[1], lengths)[0]
                                             .free(slots), state[1])),
      "free only": ("free (prefix caching pool)",
                    lambda: (jax.tree.map(jnp.copy, base), jnp.asarray(earlier)),
                    lambda state, i: (state[0].free(slots), state[1])),
  }
  for name, (impl, make_state, step) in cases.items():
    seconds = per_call_seconds(make_state, step, n_small=N_SMALL, n_large=N_LARGE)
    record(f"256 x 2K tokens, {name}", impl, seconds, 0)
  # Correctness on the device: the warm cycle's matches share the earlier pages.
  pool, num_cached = jax.jit(lambda p, q: p.match_prefix(slots, q, lengths))(
      base, jnp.asarray(earlier))
  assert (np.asarray(num_cached) == (LENGTH - 1) // PAGE * PAGE).all(), "warm prompts missed"
  hit_pages = (LENGTH - 1) // PAGE
  pages = pool.block_table[REQUESTS:2 * REQUESTS, :hit_pages]
  held = pool.prefix.tokens[pages].reshape(REQUESTS, -1)
  assert bool(jnp.all(held == jnp.asarray(earlier)[:, :hit_pages * PAGE])), \
      "a hit holds other tokens"
  holders = jnp.where(jnp.arange(hit_pages) < SYSTEM // PAGE, REQUESTS, 1)   # system: all
  assert bool(jnp.all(pool.ref_count[pages] == holders)), "hits are not shared pages"

  plain = jkv.PagePool.create(NUM_PAGES, PAGE, SLOTS, PAGES_PER_SEQ)

  def plain_step(pool, i):
    pool, _ = pool.append(slots, lengths)
    return pool.free(slots)

  seconds = per_call_seconds(lambda: jax.tree.map(jnp.copy, plain), plain_step,
                             n_small=N_SMALL, n_large=N_LARGE)
  record("256 x 2K tokens, no prefix cache", "append + free (baseline)", seconds, 0)
  engine_rows(record)


ENGINE_PROMPTS, ENGINE_PROMPT_LEN, ENGINE_SLOTS, ENGINE_BUDGET = 16, 1024, 4, 256
ENGINE_EXTRA_PAGES, ENGINE_HOST_BLOCKS = 80, 1024


def engine_rows(record):
  """The engine serving repeated prompts without / with prefix caching / with a host tier."""
  config = llama.LlamaConfig(vocab_size=VOCAB, num_layers=4, hidden_size=512, num_q_heads=8,
                             num_kv_heads=4, head_dim=64, intermediate_size=1024,
                             max_position=ENGINE_PROMPT_LEN + 8)
  params = llama.init_params(config, jax.random.key(0))
  pages_per_seq = -(-(ENGINE_PROMPT_LEN + 4) // PAGE)
  num_blocks = 1 + ENGINE_SLOTS * pages_per_seq + ENGINE_EXTRA_PAGES
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, VOCAB, ENGINE_PROMPT_LEN).astype(np.int32)
             for _ in range(ENGINE_PROMPTS)]

  def serve(prefix_caching, host_blocks, requests):
    cache = jkv.PagedKVCache.create(num_blocks, PAGE, config.num_kv_heads, config.head_dim,
                                    num_layers=config.num_layers, layout="flash",
                                    dtype=jnp.bfloat16)
    engine = engine_lib.Engine(params, config, cache, max_seqs=ENGINE_SLOTS,
                               token_budget=ENGINE_BUDGET, max_pages_per_seq=pages_per_seq,
                               prefix_caching=prefix_caching, host_prefix_blocks=host_blocks)
    for request in requests:
      engine.add(request)
    return engine, engine.run()

  for name, caching, host_blocks in (("no prefix cache", False, 0),
                                     ("device prefix cache", True, 0),
                                     ("device + host tier", True, ENGINE_HOST_BLOCKS)):
    for _ in range(2):            # the first run compiles (steps, swaps of each size)
      engine, seconds = serve(caching, host_blocks,
                              [engine_lib.Request(p, 2) for p in prompts + prompts])
    hit_rate = engine.cached_tokens / engine.prompt_tokens
    reloaded = 0 if engine.host_prefix is None else engine.host_prefix.reloaded
    record(f"engine: {ENGINE_PROMPTS} prompts x 1K tokens, each twice", f"{name}: hit rate "
           f"{hit_rate:.0%}" + (f", {reloaded} pages from host" if reloaded else ""),
           seconds, 0)
