"""A small DeepSeek-style MLA decoder with random weights, run end to end on an
:class:`MLACache`.

Multi-head latent attention (DeepSeek-V2): per token, ``W_DKV`` makes a latent
``kv_c [R]`` (RMS-normed) and one shared RoPE key ``k_pe [P]``; per head,
``k_nope = kv_c . W_UK [R, H, Dn]``, ``v = kv_c . W_UV [R, H, Dv]`` and the query is
``[q_nope (Dn) | q_pe (P)]``, the logit scale ``(Dn + P) ** -0.5``. NeoX RoPE, RMSNorm,
SwiGLU MLP and the LM head are :mod:`jkv.models.llama`'s. Two paths:

* :func:`forward_full`: no cache, the standard (non-absorbed) attention over per-head
  keys ``[k_nope | k_pe]`` and values, recomputed from scratch (the ground truth);
* :func:`decode_step` (absorbed: query latent ``q_nope . W_UK``, ``MLACache.write_rope``
  rotates q_pe and k_pe and writes the entry ``[kv_c | rope(k_pe)]``, ``MLACache.attend``
  reads, the latent output times ``W_UV``); :func:`prefill_step` is the same for the whole
  prompt (one ``write_rope`` per layer, causal attention over the entries read back with
  ``MLACache.gather``); :func:`generate` prefills the prompt and decodes greedily, the
  whole loop in one jit (:func:`jkv.models.llama.greedy_decode`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jkv import pages, rope
from jkv.mla_cache import MLACache
from jkv.models import llama
from jkv.models.llama import HIGHEST, matmul, rms_norm


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig:
  """Model sizes (static: hashable)."""
  vocab_size: int = 128
  num_layers: int = 2
  hidden_size: int = 64
  num_heads: int = 4
  kv_lora_rank: int = 32
  qk_nope_dim: int = 16
  qk_rope_dim: int = 8
  v_head_dim: int = 16
  intermediate_size: int = 128
  tie_embeddings: bool = True
  rope_base: float = 10000.0
  max_position: int = 4096
  norm_eps: float = 1e-5
  dtype: str = "float32"

  @property
  def scale(self) -> float:
    """The logit scale, (qk_nope_dim + qk_rope_dim) ** -0.5 (absorbed form too)."""
    return (self.qk_nope_dim + self.qk_rope_dim) ** -0.5


def init_params(config: DeepSeekConfig, key):
  """Random weights (normal, std 1 / sqrt(fan_in); norm weights near 1) in config.dtype.

  Returns a dict: embed [V, hidden]; layers (each stacked [num_layers, ...]): attn_norm
  [hidden], wq [hidden, H * (Dn + P)], w_dkv [hidden, R + P], kv_norm [R], w_uk [R, H, Dn],
  w_uv [R, H, Dv], wo [H * Dv, hidden], mlp_norm, w_gate, w_up, w_down as Llama's;
  final_norm [hidden]; lm_head [hidden, V] unless tie_embeddings.
  """
  c = config
  keys = iter(jax.random.split(key, 14))
  layers, hidden, heads, rank = c.num_layers, c.hidden_size, c.num_heads, c.kv_lora_rank

  def dense(shape, fan_in):
    return (jax.random.normal(next(keys), shape, jnp.float32) * fan_in ** -0.5).astype(c.dtype)

  def norm(shape):
    return (1 + 0.1 * jax.random.normal(next(keys), shape, jnp.float32)).astype(c.dtype)

  params = {
      "embed": dense((c.vocab_size, hidden), hidden),
      "layers": {
          "attn_norm": norm((layers, hidden)),
          "wq": dense((layers, hidden, heads * (c.qk_nope_dim + c.qk_rope_dim)), hidden),
          "w_dkv": dense((layers, hidden, rank + c.qk_rope_dim), hidden),
          "kv_norm": norm((layers, rank)),
          "w_uk": dense((layers, rank, heads, c.qk_nope_dim), rank),
          "w_uv": dense((layers, rank, heads, c.v_head_dim), rank),
          "wo": dense((layers, heads * c.v_head_dim, hidden), heads * c.v_head_dim),
          "mlp_norm": norm((layers, hidden)),
          "w_gate": dense((layers, hidden, c.intermediate_size), hidden),
          "w_up": dense((layers, hidden, c.intermediate_size), hidden),
          "w_down": dense((layers, c.intermediate_size, hidden), c.intermediate_size),
      },
      "final_norm": norm((hidden,)),
  }
  if not c.tie_embeddings:
    params["lm_head"] = dense((hidden, c.vocab_size), hidden)
  return params


def _project(layer, config: DeepSeekConfig, x):
  """x [..., hidden] -> (q_nope [..., H, Dn], q_pe [..., H, P], kv_c [..., R], k_pe [..., P]),
  RoPE not applied yet."""
  c = config
  h = rms_norm(x, layer["attn_norm"], c.norm_eps)
  q = matmul(h, layer["wq"]).reshape(x.shape[:-1] + (c.num_heads, -1))
  latent = matmul(h, layer["w_dkv"])
  kv_c = rms_norm(latent[..., :c.kv_lora_rank], layer["kv_norm"], c.norm_eps)
  return q[..., :c.qk_nope_dim], q[..., c.qk_nope_dim:], kv_c, latent[..., c.kv_lora_rank:]


def _rotate(config: DeepSeekConfig, x, positions):
  """NeoX RoPE of x [..., heads, P] at positions [...]."""
  return llama.apply_rope_at(x, positions, config.qk_rope_dim, config.rope_base,
                             config.max_position)


def _full_attention(layer, config: DeepSeekConfig, x, positions):
  """Standard (non-absorbed) causal MLA attention of x [B, T, hidden] at positions [B, T]
  -> [B, T, H, Dv]."""
  q_nope, q_pe, kv_c, k_pe = _project(layer, config, x)
  q_pe = _rotate(config, q_pe, positions)
  k_pe = _rotate(config, k_pe[..., None, :], positions)[..., 0, :]
  k_nope = jnp.einsum("btr,rhd->bthd", kv_c, layer["w_uk"], precision=HIGHEST)
  values = jnp.einsum("btr,rhd->bthd", kv_c, layer["w_uv"], precision=HIGHEST)
  keys = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[..., None, :], q_pe.shape)], axis=-1)
  queries = jnp.concatenate([q_nope, q_pe], axis=-1)
  return llama.causal_attention(queries, keys, values, config.scale)


def forward_full(params, config: DeepSeekConfig, tokens):
  """Logits float32 [B, T, V] of tokens int [B, T] at positions 0..T-1, no cache."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

  def layer_body(x, layer):
    attn = _full_attention(layer, config, x, positions)
    return llama.finish_layer(layer, config, x, attn), None

  x, _ = jax.lax.scan(layer_body, params["embed"][tokens], params["layers"])
  return llama.lm_logits(params, config, x)


def prefill_step(params, config: DeepSeekConfig, cache: MLACache, block_table, prompt, *,
                 backend: str = "auto"):
  """The whole prompt int [B, P] at positions 0..P-1 (absorbed MLA), in sequences whose
  pages (block_table int [B, W], W * block_size >= P) hold nothing yet.

  Per layer: one ``write_rope`` of all B * P tokens (the query ``[q_nope . W_UK |
  rope(q_pe)]`` [B * P, H, R + P] and the entries), then ``MLACache.gather`` reads the
  entries back dequantized and the prompt attends causally over them (keys the entries,
  values their latent part), times ``W_UV``. Returns (logits float32 [B, V] of the last
  position, cache).
  """
  batch, length = prompt.shape
  positions, slots, seq_lens = llama.prefill_positions(block_table, batch, length,
                                                       cache.block_size)
  cos, sin = rope.rope_cache(config.max_position, config.qk_rope_dim, base=config.rope_base)

  def flat(x):
    return x.reshape((batch * length,) + x.shape[2:])

  def layer_body(carry, inputs):
    x, cache = carry
    layer, index = inputs
    q_nope, q_pe, kv_c, k_pe = _project(layer, config, x)
    q_latent = jnp.einsum("bthd,rhd->bthr", q_nope, layer["w_uk"], precision=HIGHEST)
    query, cache = cache.write_rope(index, flat(q_latent), flat(q_pe), flat(kv_c), flat(k_pe),
                                    slots, positions.reshape(-1), cos, sin, backend=backend)
    kv_c, k_pe = cache.gather(index, block_table, seq_lens)
    keys = jnp.concatenate([kv_c, k_pe], axis=-1)[:, :length, None]      # one kv head
    latent = llama.causal_attention(query.reshape(batch, length, config.num_heads, -1), keys,
                                    kv_c[:, :length, None], config.scale)
    attn = jnp.einsum("bthr,rhd->bthd", latent, layer["w_uv"], precision=HIGHEST)
    return (llama.finish_layer(layer, config, x, attn), cache), None

  (x, cache), _ = jax.lax.scan(layer_body, (params["embed"][prompt], cache),
                               llama.layers_with_index(params, config))
  return llama.lm_logits(params, config, x[:, -1]), cache


def decode_step(params, config: DeepSeekConfig, cache: MLACache, block_table, tokens,
                positions, *, backend: str = "auto"):
  """One token per sequence (absorbed MLA): tokens int [B] at positions int [B] (the
  tokens before them are in the cache, pages of block_table int [B, W]).

  Per layer: query latent ``q_nope . W_UK`` [B, H, R]; ``write_rope`` rotates q_pe and
  k_pe, writes the entry and returns the query ``[latent | rope(q_pe)]``; ``attend`` gives
  the latent output [B, H, R], times ``W_UV`` the heads' values. Returns (logits float32
  [B, V], cache).
  """
  slots = pages.decode_slot_mapping(block_table, positions, cache.block_size)
  seq_lens = positions + 1
  cos, sin = rope.rope_cache(config.max_position, config.qk_rope_dim, base=config.rope_base)

  def layer_body(carry, inputs):
    x, cache = carry
    layer, index = inputs
    q_nope, q_pe, kv_c, k_pe = _project(layer, config, x)
    q_latent = jnp.einsum("bhd,rhd->bhr", q_nope, layer["w_uk"], precision=HIGHEST)
    query, cache = cache.write_rope(index, q_latent, q_pe, kv_c, k_pe, slots, positions, cos,
                                    sin, backend=backend)
    latent = cache.attend(index, query, block_table, seq_lens, scale=config.scale,
                          backend=backend)
    attn = jnp.einsum("bhr,rhd->bhd", latent, layer["w_uv"], precision=HIGHEST)
    return (llama.finish_layer(layer, config, x, attn), cache), None

  (x, cache), _ = jax.lax.scan(layer_body, (params["embed"][tokens], cache),
                               llama.layers_with_index(params, config))
  return llama.lm_logits(params, config, x), cache


@functools.partial(jax.jit, static_argnames=("config", "steps", "backend"),
                   donate_argnames=("cache",))
def generate(params, config: DeepSeekConfig, cache: MLACache, prompt, steps: int, *,
             backend: str = "auto"):
  """Greedy decoding of ``steps`` tokens after prompt int [B, P], all in one jit, the
  cache donated (:func:`jkv.models.llama.greedy_decode`). Returns (tokens int32
  [B, steps], logits float32 [B, steps, V], cache, pool)."""
  return llama.greedy_decode(functools.partial(prefill_step, params, config, backend=backend),
                             functools.partial(decode_step, params, config, backend=backend),
                             cache, cache.num_blocks, cache.block_size, prompt, steps)


@functools.partial(jax.jit, static_argnames=("config", "steps"))
def generate_full(params, config: DeepSeekConfig, prompt, steps: int):
  """Greedy decoding by full recompute (:func:`jkv.models.llama.greedy_full`)."""
  return llama.greedy_full(functools.partial(forward_full, params, config), prompt, steps)


@functools.partial(jax.jit, static_argnames=("config",))
def full_logits_of(params, config: DeepSeekConfig, prompt, tokens):
  """:func:`jkv.models.llama.teacher_forced_logits` of :func:`forward_full`."""
  return llama.teacher_forced_logits(functools.partial(forward_full, params, config), prompt,
                                     tokens)
