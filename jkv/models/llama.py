"""A small Llama-style decoder with random weights, run end to end on a :class:`PagedKVCache`.

GQA attention with NeoX RoPE, RMSNorm, a SwiGLU MLP and a tied or separate LM head;
float32 by default. The layers' weights are stacked on a leading axis and every path runs
the layers in a ``lax.scan`` (the layer index traced). The full recompute and the cached
path (a prefill, then decode steps) compute the same logits:

* :func:`forward_full`: no cache, causal attention recomputed from scratch (ground truth);
* :func:`prefill_step`: the whole prompt at once, its K/V of all tokens written with one
  ``cache.write`` per layer and read back (dequantized) with ``cache.gather`` for causal
  attention;
* :func:`decode_step`: one token per sequence, its K/V written with ``cache.write``, then
  ``cache.attend`` over the sequence so far; :func:`generate` prefills the prompt and then
  greedily decodes, the whole loop in one ``jax.jit`` (``lax.scan`` over steps, pages
  from a :class:`PagePool` appended inside the loop, the cache donated).

:func:`greedy_decode`, :func:`greedy_full` and :func:`teacher_forced_logits` take the
model as functions; :mod:`jkv.models.deepseek` reuses them and the layer helpers here.

Matmuls use ``Precision.HIGHEST`` so float32 stays float32 on GPUs (no TF32).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jkv import pages, rope
from jkv.cache import PagedKVCache
from jkv.page_pool import PagePool

HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Model sizes (static: hashable, passed to jit as a static argument)."""
  vocab_size: int = 128
  num_layers: int = 2
  hidden_size: int = 64
  num_q_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  intermediate_size: int = 128
  tie_embeddings: bool = True
  rope_base: float = 10000.0
  max_position: int = 4096
  norm_eps: float = 1e-5
  dtype: str = "float32"


def init_params(config: LlamaConfig, key):
  """Random weights (normal, std 1 / sqrt(fan_in); norm weights near 1) in config.dtype.

  Returns a dict: embed [V, hidden]; layers (each stacked [num_layers, ...]): attn_norm
  [hidden], wq [hidden, Hq * D], wk / wv [hidden, Hkv * D], wo [Hq * D, hidden], mlp_norm
  [hidden], w_gate / w_up [hidden, I], w_down [I, hidden]; final_norm [hidden]; lm_head
  [hidden, V] unless tie_embeddings.
  """
  c = config
  keys = iter(jax.random.split(key, 12))
  layers, hidden = c.num_layers, c.hidden_size
  q_size, kv_size = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim

  def dense(shape):
    return (jax.random.normal(next(keys), shape, jnp.float32) * shape[-2] ** -0.5).astype(c.dtype)

  def norm(shape):
    return (1 + 0.1 * jax.random.normal(next(keys), shape, jnp.float32)).astype(c.dtype)

  params = {
      "embed": dense((c.vocab_size, hidden)),
      "layers": {
          "attn_norm": norm((layers, hidden)),
          "wq": dense((layers, hidden, q_size)),
          "wk": dense((layers, hidden, kv_size)),
          "wv": dense((layers, hidden, kv_size)),
          "wo": dense((layers, q_size, hidden)),
          "mlp_norm": norm((layers, hidden)),
          "w_gate": dense((layers, hidden, c.intermediate_size)),
          "w_up": dense((layers, hidden, c.intermediate_size)),
          "w_down": dense((layers, c.intermediate_size, hidden)),
      },
      "final_norm": norm((hidden,)),
  }
  if not c.tie_embeddings:
    params["lm_head"] = dense((hidden, c.vocab_size))
  return params


def rms_norm(x, weight, eps: float):
  """x [..., n] * rsqrt(mean(x^2) + eps) * weight [n], computed in float32."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def matmul(x, w):
  """x [..., n] @ w [n, m] at full precision."""
  return jnp.matmul(x, w, precision=HIGHEST)


def apply_rope_at(x, positions, rot_dim: int, base: float, max_position: int):
  """NeoX RoPE of x [..., heads, rot_dim] at positions (int, x's leading shape)."""
  cos, sin = rope.rope_cache(max_position, rot_dim, base=base)
  cos, sin = cos[positions][..., None, :], sin[positions][..., None, :]
  return rope.apply_rope(x, cos, sin, is_neox=True).astype(x.dtype)


def causal_attention(q, k, v, scale: float):
  """Attention of every position over positions <= it (float32 softmax).

  q [B, T, Hq, Dk], k [B, T, Hkv, Dk], v [B, T, Hkv, Dv] (Hq a multiple of Hkv; q head h
  reads kv head h // (Hq / Hkv)) -> [B, T, Hq, Dv] in q's dtype.
  """
  batch, length, num_q_heads, _ = q.shape
  num_kv_heads = k.shape[2]
  grouped = q.reshape(batch, length, num_kv_heads, num_q_heads // num_kv_heads, -1)
  logits = jnp.einsum("bqhgd,bkhd->bhgqk", grouped.astype(jnp.float32), k.astype(jnp.float32),
                      precision=HIGHEST) * scale
  causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
  probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v.astype(jnp.float32), precision=HIGHEST)
  return out.reshape(batch, length, num_q_heads, -1).astype(q.dtype)


def qkv(layer, config: LlamaConfig, x, positions):
  """x [..., hidden] at positions [...] -> q [..., Hq, D], k, v [..., Hkv, D] (RoPE on q, k)."""
  c = config
  h = rms_norm(x, layer["attn_norm"], c.norm_eps)
  lead = x.shape[:-1]
  q = matmul(h, layer["wq"]).reshape(lead + (c.num_q_heads, c.head_dim))
  k = matmul(h, layer["wk"]).reshape(lead + (c.num_kv_heads, c.head_dim))
  v = matmul(h, layer["wv"]).reshape(lead + (c.num_kv_heads, c.head_dim))
  rotate = functools.partial(apply_rope_at, positions=positions, rot_dim=c.head_dim,
                             base=c.rope_base, max_position=c.max_position)
  return rotate(q), rotate(k), v


def finish_layer(layer, config, x, attn):
  """Output projection (layer["wo"]) of attn [..., heads, Dv], residual, then the SwiGLU
  MLP block (mlp_norm, w_gate, w_up, w_down): x [..., hidden] -> x."""
  x = x + matmul(attn.reshape(x.shape[:-1] + (-1,)), layer["wo"])
  h = rms_norm(x, layer["mlp_norm"], config.norm_eps)
  return x + matmul(jax.nn.silu(matmul(h, layer["w_gate"])) * matmul(h, layer["w_up"]),
                    layer["w_down"])


def lm_logits(params, config, x):
  """Final norm and LM head (the embedding if config.tie_embeddings): x [..., hidden] ->
  float32 logits [..., V]."""
  h = rms_norm(x, params["final_norm"], config.norm_eps)
  head = params["embed"].T if config.tie_embeddings else params["lm_head"]
  return matmul(h, head).astype(jnp.float32)


def layers_with_index(params, config):
  """Scan inputs: the stacked layer weights and their int32 indices."""
  return params["layers"], jnp.arange(config.num_layers, dtype=jnp.int32)


def forward_full(params, config: LlamaConfig, tokens):
  """Logits float32 [B, T, V] of tokens int [B, T] at positions 0..T-1, no cache."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  scale = config.head_dim ** -0.5

  def layer_body(x, layer):
    q, k, v = qkv(layer, config, x, positions)
    return finish_layer(layer, config, x, causal_attention(q, k, v, scale)), None

  x, _ = jax.lax.scan(layer_body, params["embed"][tokens], params["layers"])
  return lm_logits(params, config, x)


def prefill_positions(block_table, batch: int, length: int, block_size: int):
  """Prompt tokens [B, P] at positions 0..P-1 of sequences 0..B-1 (rows of block_table
  int [B, W]): returns (positions int32 [B, P], slot_mapping int32 [B * P] (row-major),
  seq_lens int32 [B] (all P))."""
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  seq_ids = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, length))
  slots = pages.slot_mapping(block_table, seq_ids.reshape(-1), positions.reshape(-1),
                             block_size)
  return positions, slots, jnp.full((batch,), length, jnp.int32)


def prefill_step(params, config: LlamaConfig, cache: PagedKVCache, block_table, prompt, *,
                 backend: str = "auto"):
  """The whole prompt int [B, P] at positions 0..P-1, in sequences whose pages
  (block_table int [B, W], W * block_size >= P) hold nothing yet.

  Per layer: the K/V of all B * P tokens go into the cache with one ``cache.write``
  (quantized there, per block scales computed over the whole prompt), then ``cache.gather``
  reads them back dequantized and the prompt attends causally over them, so the prompt
  sees the cache's K/V as the decode steps will. Returns (logits float32 [B, V] of the
  last position, cache).
  """
  batch, length = prompt.shape
  positions, slots, seq_lens = prefill_positions(block_table, batch, length, cache.block_size)
  scale = config.head_dim ** -0.5

  def layer_body(carry, inputs):
    x, cache = carry
    layer, index = inputs
    q, k, v = qkv(layer, config, x, positions)
    tokens = (batch * length, config.num_kv_heads, config.head_dim)
    cache = cache.write(index, k.reshape(tokens), v.reshape(tokens), slots, backend=backend)
    keys, values = cache.gather(index, block_table, seq_lens)
    attn = causal_attention(q, keys[:, :length], values[:, :length], scale)
    return (finish_layer(layer, config, x, attn), cache), None

  (x, cache), _ = jax.lax.scan(layer_body, (params["embed"][prompt], cache),
                               layers_with_index(params, config))
  return lm_logits(params, config, x[:, -1]), cache


def decode_step(params, config: LlamaConfig, cache: PagedKVCache, block_table, tokens,
                positions, *, backend: str = "auto"):
  """One token per sequence: tokens int [B] at positions int [B] (the tokens before them
  are in the cache, pages of block_table int [B, W]).

  Writes this step's K/V of every layer at ``positions`` and attends over positions
  0..positions[b]. Returns (logits float32 [B, V], cache).
  """
  slots = pages.decode_slot_mapping(block_table, positions, cache.block_size)
  seq_lens = positions + 1

  def layer_body(carry, inputs):
    x, cache = carry
    layer, index = inputs
    q, k, v = qkv(layer, config, x, positions)
    cache = cache.write(index, k, v, slots, backend=backend)
    attn = cache.attend(index, q, block_table, seq_lens, backend=backend)
    return (finish_layer(layer, config, x, attn), cache), None

  (x, cache), _ = jax.lax.scan(layer_body, (params["embed"][tokens], cache),
                               layers_with_index(params, config))
  return lm_logits(params, config, x), cache


@functools.partial(jax.jit, static_argnames=("config", "steps", "backend"),
                   donate_argnames=("cache",))
def generate(params, config: LlamaConfig, cache: PagedKVCache, prompt, steps: int, *,
             backend: str = "auto"):
  """Greedy decoding of ``steps`` tokens after prompt int [B, P], all in one jit, the
  cache donated: :func:`greedy_decode` with this model's :func:`prefill_step` and
  :func:`decode_step`. Returns (tokens int32 [B, steps], logits float32 [B, steps, V],
  cache, pool)."""
  return greedy_decode(functools.partial(prefill_step, params, config, backend=backend),
                       functools.partial(decode_step, params, config, backend=backend),
                       cache, cache.num_blocks, cache.block_size, prompt, steps)


@functools.partial(jax.jit, static_argnames=("config", "steps"))
def generate_full(params, config: LlamaConfig, prompt, steps: int):
  """Greedy decoding by full recompute (:func:`greedy_full` of :func:`forward_full`)."""
  return greedy_full(functools.partial(forward_full, params, config), prompt, steps)


@functools.partial(jax.jit, static_argnames=("config",))
def full_logits_of(params, config: LlamaConfig, prompt, tokens):
  """:func:`teacher_forced_logits` of :func:`forward_full`."""
  return teacher_forced_logits(functools.partial(forward_full, params, config), prompt, tokens)


def greedy_decode(prefill_fn, decode_fn, cache, num_blocks: int, block_size: int, prompt,
                  steps: int):
  """Greedy decoding of ``steps`` (>= 1) tokens after prompt int [B, P] (call it inside a
  jit).

  A fresh :class:`PagePool` over the cache's ``num_blocks`` pages of ``block_size`` tokens
  gives sequence b (pool slot b) the pages of its prompt, ``prefill_fn(cache, block_table,
  prompt [B, P]) -> (logits [B, V], cache)`` writes the prompt and picks the first token
  (argmax), then one ``lax.scan`` of ``steps - 1`` steps appends a token per sequence (a
  page whenever it needs one) and runs ``decode_fn(cache, block_table, tokens [B],
  positions [B]) -> (logits [B, V], cache)`` on the last chosen token. Returns (tokens
  int32 [B, steps], logits float32 [B, steps, V] (logits[:, i] chose tokens[:, i]),
  cache, pool); the cache then holds the first P + steps - 1 tokens of every sequence,
  and ``pool.out_of_pages`` says whether it was too small.
  """
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  batch, length = prompt.shape
  prompt = prompt.astype(jnp.int32)
  pool = PagePool.create(num_blocks, block_size, max_seqs=batch,
                         max_pages_per_seq=-(-(length + steps - 1) // block_size))
  seq_ids = jnp.arange(batch, dtype=jnp.int32)
  pool, _ = pool.append(seq_ids, jnp.full((batch,), length, jnp.int32),
                        max_new_pages=batch * -(-length // block_size))
  first_logits, cache = prefill_fn(cache, pool.block_table, prompt)
  first = jnp.argmax(first_logits, axis=-1).astype(jnp.int32)

  def step(carry, position):
    cache, pool, token = carry
    pool, _ = pool.append(seq_ids, jnp.ones((batch,), jnp.int32), max_new_pages=batch)
    logits, cache = decode_fn(cache, pool.block_table, token,
                              jnp.full((batch,), position, jnp.int32))
    chosen = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return (cache, pool, chosen), (chosen, logits)

  (cache, pool, _), (tokens, logits) = jax.lax.scan(
      step, (cache, pool, first), jnp.arange(length, length + steps - 1, dtype=jnp.int32))
  tokens = jnp.concatenate([first[:, None], tokens.T], axis=1)
  logits = jnp.concatenate([first_logits[:, None], logits.swapaxes(0, 1)], axis=1)
  return tokens, logits, cache, pool


def greedy_full(forward_fn, prompt, steps: int):
  """Greedy decoding by full recompute: every step runs ``forward_fn(tokens [B, T]) ->
  logits [B, T, V]`` over the whole token buffer (no cache). Returns (tokens int32
  [B, steps], logits float32 [B, steps, V]) as :func:`greedy_decode`."""
  batch, length = prompt.shape
  buffer = jnp.concatenate([prompt.astype(jnp.int32),
                            jnp.zeros((batch, steps), jnp.int32)], axis=1)

  def step(buffer, i):
    logits = jax.lax.dynamic_index_in_dim(forward_fn(buffer), length - 1 + i, axis=1,
                                          keepdims=False)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return buffer.at[:, length + i].set(token, mode="drop"), (token, logits)

  _, (tokens, logits) = jax.lax.scan(step, buffer, jnp.arange(steps))
  return tokens.T, logits.swapaxes(0, 1)


def teacher_forced_logits(forward_fn, prompt, tokens):
  """The full recompute's logits float32 [B, steps, V] at the positions that chose
  tokens [B, steps] after prompt [B, P]: compare with the logits of a cached decode even
  where a quantized cache made it choose other tokens."""
  sequence = jnp.concatenate([prompt, tokens[:, :-1]], axis=1).astype(jnp.int32)
  return forward_fn(sequence)[:, prompt.shape[1] - 1:]
