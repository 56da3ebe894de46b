"""The continuous-batching engine loop (jkv.models.engine) and its demo (``python -m jkv
--engine``): requests of different lengths join and leave, prompts prefill in chunks under
a token budget beside decodes, and the logits equal a cache-free recompute."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv.__main__ as demo
from jkv.cache import PagedKVCache
from jkv.models import engine as engine_lib, llama
from tests.conftest import KERNEL

CONFIG = llama.LlamaConfig(vocab_size=64, num_layers=2, hidden_size=32, num_q_heads=4,
                           num_kv_heads=2, head_dim=16, intermediate_size=64, max_position=64)


def make_engine(backend, token_budget=12, max_seqs=4, layout="flash", prefix_caching=False,
                **quant):
  params = llama.init_params(CONFIG, jax.random.key(0))
  cache = PagedKVCache.create(1 + max_seqs * 6, 8, CONFIG.num_kv_heads, CONFIG.head_dim,
                              num_layers=CONFIG.num_layers, layout=layout, dtype=jnp.float32,
                              **quant)
  return engine_lib.Engine(params, CONFIG, cache, max_seqs=max_seqs, token_budget=token_budget,
                           max_pages_per_seq=6, prefix_caching=prefix_caching, backend=backend)


def requests_of(rng, count=7):
  return [engine_lib.Request(rng.integers(0, CONFIG.vocab_size, int(n)).astype(np.int32),
                             int(m))
          for n, m in zip(rng.integers(1, 25, count), rng.integers(1, 12, count))]


@pytest.mark.parametrize("backend", ["reference", KERNEL])
def test_engine_matches_full_recompute(rng, backend):
  engine = make_engine(backend)
  requests = requests_of(rng)
  for request in requests:
    engine.add(request)
  engine.run()
  assert all(r.done and len(r.generated) == r.max_new_tokens for r in requests)
  assert len(engine.finished) == len(requests)
  assert engine.mixed_steps > 0            # prefill chunks ran beside decodes
  assert engine.free_pages == engine.cache.num_blocks - 1   # every page came back, on the
  assert int(engine.pool.num_free_pages) == engine.cache.num_blocks - 1   # host and device
  assert not np.asarray(engine.pool.seq_lens).any()
  assert not bool(engine.pool.out_of_pages)
  assert engine.check(requests) < 1e-4
  more = requests_of(rng, 3)               # the same engine serves a second batch
  for request in more:
    engine.add(request)
  engine.run()
  assert engine.check(more) < 1e-4


def test_chunking_does_not_change_the_result(rng):
  """The same requests under another token budget and slot count (other chunks, other
  mixes, other pages) give the same tokens and logits."""
  requests = requests_of(rng)
  runs = []
  for budget, slots in ((12, 4), (5, 2), (40, 6)):
    engine = make_engine("reference", token_budget=budget, max_seqs=slots)
    copies = [engine_lib.Request(r.prompt, r.max_new_tokens) for r in requests]
    for request in copies:
      engine.add(request)
    engine.run()
    runs.append(copies)
  for other in runs[1:]:
    for a, b in zip(runs[0], other):
      assert a.generated == b.generated
      np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), atol=1e-4)


@pytest.mark.parametrize("backend", ["reference", KERNEL])
def test_prefix_caching_prefills_only_the_suffix(rng, backend):
  """Requests sharing a 20-token system prompt (2 full pages of 8): after the first, each
  prefills only its suffix; tokens and logits equal an engine without prefix caching (and
  the cache-free recompute). Small pools force evictions of cached pages too."""
  system = rng.integers(0, CONFIG.vocab_size, 20).astype(np.int32)
  prompts = [np.concatenate([system, rng.integers(0, CONFIG.vocab_size, int(n))]).astype(
      np.int32) for n in rng.integers(1, 12, 8)]
  new_tokens = rng.integers(1, 8, 8)
  runs = {}
  for caching in (False, True):
    engine = make_engine(backend, token_budget=12, max_seqs=3, prefix_caching=caching)
    requests = [engine_lib.Request(p, int(m)) for p, m in zip(prompts, new_tokens)]
    for request in requests:
      engine.add(request)
    engine.run()
    runs[caching] = (engine, requests)
    assert engine.check(requests) < 1e-4
    assert int(engine.pool.num_free_pages) == engine.cache.num_blocks - 1
    assert not bool(engine.pool.out_of_pages)
  plain, cached = runs[False][0], runs[True][0]
  assert cached.prompt_tokens == plain.prompt_tokens == sum(len(p) for p in prompts)
  # Requests admitted after the first caching step each find the 2 system pages.
  assert cached.cached_tokens >= 16 * 4
  assert cached.prefill_rows == plain.prefill_rows - cached.cached_tokens
  assert int(cached.pool.num_cached_pages) > 0
  for a, b in zip(runs[False][1], runs[True][1]):
    assert a.generated == b.generated
    np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), atol=1e-4)


def test_host_prefix_tier_keeps_hits_under_page_pressure(rng):
  """Six 20-token prompts, each asked twice, through 2 slots and 12 pages: the device pool
  evicts cached pages before their prompt comes again; the host tier brings them back.
  Same tokens and logits as without it."""
  prompts = [rng.integers(0, CONFIG.vocab_size, 20).astype(np.int32) for _ in range(6)]
  runs = {}
  for host_blocks in (0, 16):
    params = llama.init_params(CONFIG, jax.random.key(0))
    cache = PagedKVCache.create(13, 8, CONFIG.num_kv_heads, CONFIG.head_dim,
                                num_layers=CONFIG.num_layers, layout="flash", dtype=jnp.float32)
    engine = engine_lib.Engine(params, CONFIG, cache, max_seqs=2, token_budget=12,
                               max_pages_per_seq=6, prefix_caching=True,
                               host_prefix_blocks=host_blocks, backend="reference")
    requests = [engine_lib.Request(p, 4) for p in prompts + prompts]
    for request in requests:
      engine.add(request)
    engine.run()
    assert engine.check(requests) < 1e-4
    assert int(engine.pool.num_free_pages) == 12 and not bool(engine.pool.out_of_pages)
    runs[host_blocks] = (engine, requests)
  without, with_tier = runs[0][0], runs[16][0]
  assert with_tier.host_prefix.reloaded > 0
  assert with_tier.cached_tokens == 6 * 16              # every repeat finds its 2 full pages
  assert without.cached_tokens < with_tier.cached_tokens
  for a, b in zip(runs[0][1], runs[16][1]):
    assert a.generated == b.generated
    np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), atol=1e-4)
  with pytest.raises(ValueError, match="needs prefix_caching=True"):
    engine_lib.Engine(runs[0][0].params, CONFIG, runs[0][0].cache, max_seqs=2, token_budget=12,
                      max_pages_per_seq=6, host_prefix_blocks=4)


def test_engine_quantized_cache(rng):
  engine = make_engine(KERNEL, layout="hnd", quant="block", kv_cache_dtype="int8")
  requests = requests_of(rng, 4)
  for request in requests:
    engine.add(request)
  engine.run()
  full = max(float(np.max(np.abs(np.stack(r.logits)))) for r in requests)
  assert engine.check(requests) < demo.BOUNDS["8-bit"] * full


def test_engine_rejects_bad_requests():
  engine = make_engine("reference")
  with pytest.raises(ValueError, match="1-D prompt"):
    engine.add(engine_lib.Request(np.zeros((0,), np.int32), 3))
  with pytest.raises(ValueError, match="needs 7 pages"):
    engine.add(engine_lib.Request(np.zeros((50,), np.int32), 3))
  with pytest.raises(ValueError, match="exceeds the model's max_position"):
    engine.add(engine_lib.Request(np.zeros((40,), np.int32), 30))
  with pytest.raises(ValueError, match=r"prompt\[1\] = 1000 is not a token id"):
    engine.add(engine_lib.Request(np.array([2, 1000], np.int32), 3))
  with pytest.raises(ValueError, match=r"prompt\[0\] = -1 is not a token id"):
    engine.add(engine_lib.Request(np.array([-1, 2], np.int32), 3))
  with pytest.raises(TypeError, match="integer token ids"):
    engine.add(engine_lib.Request(np.array([2.0, 3.0]), 3))
  with pytest.raises(ValueError, match="token_budget"):
    make_engine("reference", token_budget=2, max_seqs=4)


SMALL = ["--engine", "--layers", "2", "--requests", "5", "--prompt", "6", "--steps", "5",
         "--heads", "2", "--head-size", "16", "--hidden", "32", "--vocab", "64",
         "--block-size", "8", "--max-seqs", "3", "--token-budget", "8", "--layout", "flash",
         "--backend", KERNEL]


def test_engine_demo_checks_itself(capsys, monkeypatch):
  assert demo.main(SMALL) == 0
  out = capsys.readouterr().out
  assert "check         OK" in out and "tokens/s" in out and "step mix" in out
  assert demo.main(SMALL + ["--shared-prefix", "16", "--prefix-caching"]) == 0
  out = capsys.readouterr().out
  assert "check         OK" in out and "prefix cache  " in out
  hits = int(out.split("prefix cache  ")[1].split(" of ")[0])
  assert hits >= 16 * 2       # the 5 requests run on 3 slots: at least 2 admitted later
  monkeypatch.setitem(demo.BOUNDS, "float", -1.0)     # no difference passes: a mismatch
  assert demo.main(SMALL) == 1
  assert "check         MISMATCH" in capsys.readouterr().out


def test_engine_demo_rejects_a_budget_below_the_slots(capsys):
  with pytest.raises(SystemExit) as exit_info:
    demo.main(SMALL + ["--token-budget", "2"])
  assert exit_info.value.code == 2
  assert "--token-budget (2) must be >= --max-seqs (3)" in capsys.readouterr().err
