"""End to end: the small models' cached decode (the prompt in one prefill through
``cache.write`` / ``cache.gather``, then one token per step through ``cache.write`` /
``cache.attend``, pages from a PagePool, the loop in one jit) against their full no-cache
recompute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import KERNEL
from jkv import MLACache, PagedKVCache
from jkv.models import deepseek, llama

LLAMA = llama.LlamaConfig()                           # 2 layers, 4 q / 2 kv heads x 16
DEEPSEEK = deepseek.DeepSeekConfig(tie_embeddings=False)
BATCH, PROMPT, STEPS = 2, 5, 6                        # 10 tokens cached: 2 pages
NUM_BLOCKS, BLOCK_SIZE = 8, 8                         # 2 pages per sequence + the null page
EXACT = 1e-4                                          # float32 caches: rounding only


def llama_cache(layout="flash", **kwargs):
  return PagedKVCache.create(NUM_BLOCKS, BLOCK_SIZE, LLAMA.num_kv_heads, LLAMA.head_dim,
                             num_layers=LLAMA.num_layers, layout=layout, dtype=jnp.float32,
                             **kwargs)


def mla_cache(**kwargs):
  return MLACache.create(NUM_BLOCKS, BLOCK_SIZE, DEEPSEEK.kv_lora_rank, DEEPSEEK.qk_rope_dim,
                         num_layers=DEEPSEEK.num_layers, dtype=jnp.float32, **kwargs)


@pytest.fixture(scope="module")
def prompt():
  return jax.random.randint(jax.random.key(1), (BATCH, PROMPT), 0, LLAMA.vocab_size)


@pytest.fixture(scope="module")
def llama_model(prompt):
  """(params, greedy tokens [B, STEPS] and their logits by full recompute)."""
  params = llama.init_params(LLAMA, jax.random.key(0))
  return (params,) + llama.generate_full(params, LLAMA, prompt, STEPS)


@pytest.fixture(scope="module")
def deepseek_model(prompt):
  params = deepseek.init_params(DEEPSEEK, jax.random.key(2))
  return (params,) + deepseek.generate_full(params, DEEPSEEK, prompt, STEPS)


def check_exact(generated, full_tokens, full_logits):
  """Cached greedy decode equals the full recompute: logits to float32 rounding, tokens."""
  tokens, logits, cache, pool = generated
  assert not bool(pool.out_of_pages)
  np.testing.assert_array_equal(np.asarray(pool.seq_lens), [PROMPT + STEPS - 1] * BATCH)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(full_logits), rtol=0, atol=EXACT)
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(full_tokens))


def logit_error(model, params, config, prompt, generated):
  """max |cached - full recompute logit| at the tokens the cached decode chose."""
  tokens, logits, _, pool = generated
  assert not bool(pool.out_of_pages)
  full = model.full_logits_of(params, config, prompt, tokens)
  return float(jnp.max(jnp.abs(logits - full)))


@pytest.mark.parametrize("layout", ["vllm", "asm", "flash", "hnd", "packed"])
def test_llama_cached_decode_equals_full_recompute(llama_model, prompt, layout):
  params, full_tokens, full_logits = llama_model
  generated = llama.generate(params, LLAMA, llama_cache(layout), prompt, STEPS,
                             backend="reference")
  check_exact(generated, full_tokens, full_logits)


def test_llama_kernel_backend_equals_full_recompute(llama_model, prompt):
  params, full_tokens, full_logits = llama_model
  generated = llama.generate(params, LLAMA, llama_cache("vllm"), prompt, STEPS, backend=KERNEL)
  check_exact(generated, full_tokens, full_logits)


# Bounds on max |cached - full logit| (largest |logit| here about 3). Measured over 8
# seeds: at most 0.17 for FP8 e4m3 per tensor (3 mantissa bits: each K/V value within
# 1/16 relative), 0.08 for INT8 per token (each value within amax / 127), 0.13 for INT8
# and 0.17 for FP8 per block (one scale per 8-token block and kv head: the prompt's 5
# tokens set it, decode tokens grow it and re-quantize the block); the bounds leave about
# 1.7x room. The lower bound shows the cache really is quantized.
@pytest.mark.parametrize("quant, kv_cache_dtype, layout, backend, bound", [
    ("tensor", "fp8", "flash", "reference", 0.3),
    ("token", "int8", "flash", "reference", 0.15),
    ("block", "int8", "vllm", "reference", 0.22),
    ("block", "fp8", "flash", "reference", 0.3),
    ("block", "int8", "vllm", KERNEL, 0.22),
])
def test_llama_quantized_cache_within_bound(llama_model, prompt, quant, kv_cache_dtype, layout,
                                            backend, bound):
  params = llama_model[0]
  cache = llama_cache(layout, quant=quant, kv_cache_dtype=kv_cache_dtype)
  generated = llama.generate(params, LLAMA, cache, prompt, STEPS, backend=backend)
  assert EXACT < logit_error(llama, params, LLAMA, prompt, generated) <= bound


@pytest.mark.parametrize("backend", ["reference", KERNEL])
def test_deepseek_absorbed_decode_equals_full_recompute(deepseek_model, prompt, backend):
  params, full_tokens, full_logits = deepseek_model
  generated = deepseek.generate(params, DEEPSEEK, mla_cache(), prompt, STEPS, backend=backend)
  check_exact(generated, full_tokens, full_logits)


def test_deepseek_fp8_cache_within_bound(deepseek_model, prompt):
  """FP8 latent entries: measured at most 0.32 over 8 seeds (largest |logit| about 3.5)."""
  params = deepseek_model[0]
  generated = deepseek.generate(params, DEEPSEEK, mla_cache(kv_cache_dtype="fp8"), prompt,
                                STEPS, backend="reference")
  assert EXACT < logit_error(deepseek, params, DEEPSEEK, prompt, generated) <= 0.5
