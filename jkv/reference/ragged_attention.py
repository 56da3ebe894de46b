"""Reference ragged paged attention: chunked prefill and decode of many sequences at once.

Semantics follow vLLM's ``unified_attention`` (``vllm/attention/ops/triton_unified_attention.py``)
over jkv's paged layouts and formats (:mod:`jkv.reference.attention` reads the cache):

* ``query`` [T, Hq, D] holds the new tokens of all sequences, sequence after sequence;
  sequence s owns rows ``cu_q_lens[s]:cu_q_lens[s + 1]`` (``q_len_s`` rows, 0 allowed) for
  ``s < num_seqs``; rows at or past ``cu_q_lens[num_seqs]`` are padding and read 0.
* ``kv_lens[s]`` is the sequence's length after this step (cached + new): row j of sequence
  s sits at position ``p = kv_lens[s] - q_len_s + j`` and sees keys ``0..p`` (causal),
  ``p - W + 1..p`` with ``sliding_window`` W.
* logits ``scale * <q, k>`` in float32, then ``cap * tanh(logit / cap)`` (soft cap), then
  ``+ slope_h * (k - p)`` (ALiBi); query head h reads KV head ``h // (Hq / Hkv)``.
* ``out = sum_k e_k v_k / (sum_k e_k + exp(sink_h - m) + 1e-6)`` with ``e_k = exp(logit_k -
  m)``, ``m`` the row's largest logit (and ``sink_h`` with ``sinks``, gpt-oss attention
  sinks); without sinks that term is 0. The ``1e-6`` is vLLM ``paged_attention_v1``'s (and
  jkv's decode attention's), so one query row per sequence gives
  :func:`jkv.reference.attention.paged_attention_decode`'s result.

Cache entries at or past ``kv_lens`` and blocks outside the cache never reach the output,
even when they hold NaN. This twin gathers every row's sequence, K/V of
``[T, W * block_size, Hkv, D]``: the executable spec and the CPU fallback, not a fast path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv.formats import CacheFormat
from jkv.reference.attention import read_tokens


def row_sequences(cu_q_lens, num_seqs, num_rows: int):
  """(seq int32 [T], valid bool [T]): the sequence that owns each query row (0 for padding
  rows, which ``valid`` marks False). Sequences at or past ``num_seqs`` own no rows."""
  num_slots = cu_q_lens.shape[0] - 1
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  active = jnp.arange(num_slots, dtype=jnp.int32) < num_seqs
  ended = (cu_q_lens[1:][None, :] <= rows[:, None]) & active[None, :]
  seq = jnp.sum(ended, axis=1, dtype=jnp.int32)
  end = cu_q_lens[jnp.clip(num_seqs, 0, num_slots)]
  valid = (rows >= cu_q_lens[0]) & (rows < end) & (seq < num_seqs)
  return jnp.where(valid, seq, 0), valid


def row_positions(cu_q_lens, kv_lens, seq, valid):
  """int32 [T]: each query row's position in its sequence (``kv_len - q_len + j``)."""
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  rows = jnp.arange(seq.shape[0], dtype=jnp.int32)
  pos = kv_lens[seq] - q_lens[seq] + rows - cu_q_lens[seq]
  return jnp.where(valid, pos, -1)


def ragged_paged_attention(fmt: CacheFormat, query, key_cache, value_cache, k_scale, v_scale,
                           layer, block_tables, kv_lens, cu_q_lens, num_seqs, *,
                           num_blocks: int, block_size: int, num_heads: int, head_size: int,
                           scale: float, alibi_slopes=None, logits_soft_cap=None,
                           sliding_window=None, sinks=None, k_global_scale=None,
                           v_global_scale=None):
  """Ragged attention straight from the cache (module docstring).

  query [T, Hq, D]; caches and token / block scales with a leading num_layers dim (as
  :func:`jkv.reference.attention.read_tokens`), k/v_scale [H] for ``tensor``; layer int32
  scalar; block_tables int32 [S, W]; kv_lens int32 [S]; cu_q_lens int32 [S + 1]; num_seqs
  int32 scalar; alibi_slopes / sinks float32 [Hq] or None; k/v_global_scale: NVFP4's
  float32 global scales (None otherwise). Returns [T, Hq, D] in the
  query's dtype.
  """
  num_rows, num_q_heads, _ = query.shape
  group = num_q_heads // num_heads
  keys, values = read_tokens(fmt, key_cache, value_cache, k_scale, v_scale, k_global_scale,
                             v_global_scale, layer,
                             block_tables, num_blocks, block_size, num_heads, head_size)
  seq, valid = row_sequences(cu_q_lens, num_seqs, num_rows)
  pos = row_positions(cu_q_lens, kv_lens, seq, valid)
  width = block_tables.shape[1]
  key_pos = jnp.arange(width * block_size, dtype=jnp.int32)
  blocks = block_tables[seq][:, key_pos // block_size]               # [T, N]
  seen = ((key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] < kv_lens[seq][:, None])
          & (blocks >= 0) & (blocks < num_blocks) & valid[:, None])
  if sliding_window is not None:
    seen &= key_pos[None, :] > pos[:, None] - sliding_window
  q = query.astype(jnp.float32).reshape(num_rows, num_heads, group, -1)
  logits = jnp.einsum("thgd,tnhd->thgn", q, keys[seq],
                      precision=jax.lax.Precision.HIGHEST) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  if alibi_slopes is not None:
    distance = (key_pos[None, :] - pos[:, None]).astype(jnp.float32)
    slopes = alibi_slopes.astype(jnp.float32).reshape(num_heads, group)
    logits = logits + slopes[None, :, :, None] * distance[:, None, None, :]
  mask = seen[:, None, None, :]
  logits = jnp.where(mask, logits, -jnp.inf)
  peak = jnp.max(logits, axis=-1)                                     # [T, Hkv, G]
  if sinks is not None:
    sink = sinks.astype(jnp.float32).reshape(num_heads, group)[None]
    peak = jnp.maximum(peak, sink)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  p = jnp.where(mask, jnp.exp(logits - peak[..., None]), 0.0)
  denominator = jnp.sum(p, axis=-1) + 1e-6
  if sinks is not None:
    denominator = denominator + jnp.exp(sink - peak)
  vals = jnp.where(seen[:, :, None, None], values[seq], 0.0)
  out = jnp.einsum("thgn,tnhd->thgd", p, vals, precision=jax.lax.Precision.HIGHEST)
  out = out / denominator[..., None]
  out = jnp.where(valid[:, None, None, None], out, 0.0)
  return out.reshape(num_rows, num_q_heads, -1).astype(query.dtype)
