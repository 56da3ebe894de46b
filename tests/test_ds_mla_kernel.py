"""The fp8_ds_mla write kernel (:mod:`pallas_kernels.ds_mla`; interpret on CPU, compiled
with JKV_BACKEND=pallas) against the jnp reference bit for bit, on caches poisoned with
random non-zero bytes: DeepSeek's entry (R = 512, P = 64) and small / padded ones, bf16 /
f16 / f32 inputs, padding slots and slots past the cache (under jit), a stacked cache
with a traced layer, zero, tiny and saturating tiles, NaN / Inf in one token's tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from conftest import KERNEL, poisoned_bytes
from jkv import formats
from jkv.reference import mla as reference
from pallas_kernels import ds_mla

# (kv_lora_rank R, pe dim P): DeepSeek's, small ones, and 3 tiles / P = 24 (both padded).
CONFIGS = [(512, 64), (256, 32), (128, 16), (384, 24)]
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
FLT_MIN_BYTES = list(np.array([formats.FLT_MIN], "<f4").view(np.uint8))


def latent(rng, num_tokens, rank, dtype):
  """kv_c [T, R] of ``dtype``: normal values scaled per 128-value tile by 10^-3..10^3;
  token 1: tile 0 zeros (FLT_MIN scale), tile 1 near the dtype's max; token 2: tile 0 tiny
  (+-0.5e-37..1e-37: amax * (1 / 448) below FLT_MIN, the floor with non-zero values; no
  denormal inputs, which a flushing back end would zero; bf16 / f32 only)."""
  tiles = rank // formats.DS_MLA_TILE
  x = rng.standard_normal((num_tokens, tiles, formats.DS_MLA_TILE)) * 10.0 ** rng.uniform(
      -3, 3, (num_tokens, tiles, 1))
  x[1, 0] = 0.0
  if tiles > 1:
    x[1, 1] *= 0.9 * float(jnp.finfo(dtype).max) / np.abs(x[1, 1]).max()
  if float(jnp.finfo(dtype).tiny) < 1e-37:
    x[2, 0] = rng.choice([-1e-37, 1e-37], x.shape[2]) * rng.uniform(0.5, 1, x.shape[2])
  return jnp.asarray(x.reshape(num_tokens, rank), dtype)


def write(kv_c, k_pe, cache, slot_mapping, backend, layer=None):
  """concat_and_cache_mla(..., "fp8_ds_mla") under jit (slots past the cache allowed)."""
  fn = jax.jit(lambda c, p, kc, s, *layer: jkv.concat_and_cache_mla(
      c, p, kc, s, "fp8_ds_mla", layer=layer[0] if layer else None, backend=backend))
  return np.asarray(fn(kv_c, k_pe, cache, jnp.asarray(slot_mapping, jnp.int32),
                       *(() if layer is None else (layer,))))


def slots_of(rng, num_tokens, capacity):
  """Distinct random slots, two padding (-1) and two past the cache."""
  slots = rng.permutation(capacity)[:num_tokens].astype(np.int32)
  slots[[0, 5]] = -1
  slots[[3, num_tokens - 1]] = capacity, capacity + 7
  return slots


def assert_untouched(got, cache, slots):
  """Every row of ``got`` [..., E] but the written slots equals the poisoned cache."""
  capacity = np.prod(cache.shape[-3:-1])
  kept = np.ones(capacity, bool)
  kept[slots[(slots >= 0) & (slots < capacity)]] = False
  rows = np.asarray(cache).reshape(-1, capacity, cache.shape[-1])
  np.testing.assert_array_equal(got.reshape(rows.shape)[:, kept], rows[:, kept])


@pytest.mark.parametrize("rank,pe", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(rank, pe, dtype, rng):
  num_tokens, num_blocks, block_size = 13, 5, 4
  kv_c = latent(rng, num_tokens, rank, dtype)
  k_pe = jnp.asarray(rng.standard_normal((num_tokens, pe)) * 3, dtype)
  slots = slots_of(rng, num_tokens, num_blocks * block_size)
  cache = poisoned_bytes(rng, (num_blocks, block_size, formats.ds_mla_entry_bytes(rank, pe)))
  got = write(kv_c, k_pe, cache, slots, KERNEL)
  want = write(kv_c, k_pe, cache, slots, "reference")
  np.testing.assert_array_equal(got, want)
  assert_untouched(got, cache, slots)
  rows = got.reshape(-1, cache.shape[-1])
  if rank > 128:                       # token 1: the zero tile (FLT_MIN) and the big one
    zero_tile = rows[slots[1]]
    assert not zero_tile[:128].any()
    assert list(zero_tile[rank:rank + 4]) == FLT_MIN_BYTES
    big = zero_tile[128:256].view(jnp.float8_e4m3fn).astype(np.float32)
    assert np.abs(big).max() == 448.0 and not np.isnan(big).any()
  if float(jnp.finfo(dtype).tiny) < 1e-37:     # token 2: the floor, non-zero values
    tiny = rows[slots[2]]
    assert list(tiny[rank:rank + 4]) == FLT_MIN_BYTES and (tiny[:128] & 0x7F).all()


@pytest.mark.parametrize("tokens_per_program", [1, 4, 16])
@pytest.mark.parametrize("rank,pe", [(512, 64), (384, 24)])
def test_kernel_tiles(tokens_per_program, rank, pe, rng):
  """The kernel called directly with several token tiles (13 tokens: a ragged last tile;
  16: more than there are tokens)."""
  num_tokens, num_blocks, block_size = 13, 4, 8
  kv_c = latent(rng, num_tokens, rank, jnp.bfloat16)
  k_pe = jnp.asarray(rng.standard_normal((num_tokens, pe)), jnp.float32)
  slots = jnp.asarray(slots_of(rng, num_tokens, num_blocks * block_size))
  cache = poisoned_bytes(rng, (num_blocks, block_size, formats.ds_mla_entry_bytes(rank, pe)))
  got = ds_mla.write_entries(kv_c, k_pe, cache, slots, None, interpret=KERNEL == "interpret",
                             tokens_per_program=tokens_per_program)
  want = reference.concat_and_cache_ds_mla(kv_c[:, None], k_pe[:, None], cache, slots)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("rank,pe", [(512, 64), (128, 16)])
def test_kernel_traced_layer(rank, pe, rng):
  """A stacked cache, the layer traced under jit: only that layer's slots change; a traced
  layer past the stack writes nothing."""
  num_tokens, layers, num_blocks, block_size = 9, 3, 3, 4
  kv_c = latent(rng, num_tokens, rank, jnp.float32)
  k_pe = jnp.asarray(rng.standard_normal((num_tokens, pe)), jnp.bfloat16)
  slots = slots_of(rng, num_tokens, num_blocks * block_size)
  cache = poisoned_bytes(rng, (layers, num_blocks, block_size, formats.ds_mla_entry_bytes(rank, pe)))
  got = write(kv_c, k_pe, cache, slots, KERNEL, jnp.int32(1))
  want = write(kv_c, k_pe, cache, slots, "reference", jnp.int32(1))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got[[0, 2]], np.asarray(cache)[[0, 2]])
  assert_untouched(got[1], cache[1], slots)
  assert (got[1] != np.asarray(cache)[1]).any()
  nothing = write(kv_c, k_pe, cache, slots, KERNEL, jnp.int32(layers))
  np.testing.assert_array_equal(nothing, np.asarray(cache))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_nonfinite_tile(dtype, rng):
  """NaN / +-Inf in tile 2 of token 3: as the reference (amax over finite values, NaN ->
  0x7F, +-Inf -> +-448); its other tiles, its k_pe and every other token as without them."""
  num_tokens, rank, pe, num_blocks, block_size = 6, 512, 64, 2, 4
  kv_c = np.asarray(latent(rng, num_tokens, rank, dtype))
  k_pe = jnp.asarray(rng.standard_normal((num_tokens, pe)), dtype)
  slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
  cache = poisoned_bytes(rng, (num_blocks, block_size, formats.ds_mla_entry_bytes(rank, pe)))
  dirty = kv_c.copy()
  dirty[3, 256 + 5], dirty[3, 256 + 6], dirty[3, 256 + 7] = np.nan, np.inf, -np.inf
  got = write(jnp.asarray(dirty), k_pe, cache, slots, KERNEL)
  np.testing.assert_array_equal(got, write(jnp.asarray(dirty), k_pe, cache, slots, "reference"))
  entry = got.reshape(-1, cache.shape[-1])[slots[3]]
  assert list(entry[256 + 5:256 + 8]) == [0x7F, 0x7E, 0xFE]
  finite = np.abs(np.delete(dirty[3, 256:384], [5, 6, 7]).astype(np.float32)).max()
  scale = entry[rank + 8:rank + 12].view("<f4")[0]
  assert scale == max(finite * np.float32(1 / 448), formats.FLT_MIN)
  clean = write(jnp.asarray(kv_c), k_pe, cache, slots, KERNEL)
  keep = np.ones(got.shape[:2], bool)
  keep[divmod(int(slots[3]), block_size)] = False
  np.testing.assert_array_equal(got[keep], clean[keep])               # other tokens
  same = np.r_[0:256, 384:rank + 8, rank + 12:cache.shape[-1]]       # token 3 elsewhere
  np.testing.assert_array_equal(entry[same],
                                clean.reshape(-1, cache.shape[-1])[slots[3]][same])


def test_kernel_no_tokens(rng):
  cache = poisoned_bytes(rng, (2, 4, formats.ds_mla_entry_bytes(128, 16)))
  got = jkv.concat_and_cache_mla(jnp.zeros((0, 128)), jnp.zeros((0, 16)), cache,
                                 jnp.zeros((0,), jnp.int32), "fp8_ds_mla", backend=KERNEL)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(cache))
