"""The Mosaic GPU MLA decode over ``fp8_split`` caches (``lowering="mosaic"``; ``auto``'s
choice on Hopper) against the reference: Pallas' GPU interpreter on CPU, compiled with
``JKV_BACKEND=pallas`` on a GPU (jax >= 0.11.2). The entries the sequences do not own hold
NaN content, RoPE parts and scales (``build_mla``), which must not leak."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from conftest import KERNEL
from test_attention import build_mla, query_of   # (imports jkv before the kernels)
from pallas_kernels import lowering, mosaic_mla_split

pytestmark = pytest.mark.skipif(not lowering.mosaic_available(),
                                reason="the Mosaic GPU kernels need jax >= 0.11.2")


def check(rng, *, rank=128, pe=64, block_size=16, q_heads=4, dtype=jnp.bfloat16,
          lens=(0, 33, 80), width=5, num_blocks=20, magnitude=1.0, scale=0.1,
          bad_blocks=False, num_splits=None, num_heads=None, wide_scales=False,
          per_row=False, stages=2):
  cache, table, lens, _ = build_mla(rng, rank=rank, pe=pe, kv_cache_dtype="fp8_split",
                                    dtype=dtype, block_size=block_size, num_blocks=num_blocks,
                                    batch=len(lens), width=width, lens=lens,
                                    magnitude=magnitude, num_heads=num_heads)
  if bad_blocks:   # blocks outside the cache are masked, as in the reference
    table = table.at[1, 1].set(-1).at[2, 0].set(num_blocks + 3)
  query = query_of(rng, len(lens), q_heads, rank + pe, dtype)
  if wide_scales:   # scales times +-2^-30 .. 2^30, a tenth 0 (NaN stays NaN); RoPE logits only
    shape = cache.entry_scale.shape
    factor = np.where(rng.random(shape) < 0.1, 0.0, rng.choice([-1.0, 1.0], shape)
                      * np.exp2(rng.integers(-30, 31, shape)))
    cache = cache.replace(entry_scale=cache.entry_scale * jnp.asarray(factor, jnp.float32))
    query = query.at[..., :rank].set(0)
  # Under jit: the eager checks reject blocks outside the cache.
  expected = jax.jit(lambda c, q, t, s: c.attend(0, q, t, s, scale=scale,
                                                 backend="reference"))(cache, query, table, lens)
  if num_splits is None:
    got = jax.jit(lambda c, q, t, s: c.attend(0, q, t, s, scale=scale, backend=KERNEL,
                                              lowering="mosaic"))(cache, query, table, lens)
  else:
    got = jax.jit(lambda c, q, t, s: mosaic_mla_split.mla_decode(
        q, c.kv_cache, c.rope_cache, c.entry_scale, jnp.int32(0), t, s,
        num_blocks=num_blocks, scale=scale, interpret=KERNEL == "interpret",
        num_splits=num_splits, stages=stages))(cache, query, table, lens)
  got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
  assert got.shape == expected.shape and np.isfinite(got).all()
  # Each query row against its own largest element where asked, else the whole output's.
  size = (np.maximum(np.abs(expected).max(axis=-1, keepdims=True), 1e-30) if per_row
          else max(1.0, float(np.abs(expected).max())))
  np.testing.assert_allclose(got / size, expected / size, atol=3e-2, rtol=3e-2)
  return got


@pytest.mark.parametrize("rank,block_size,q_heads,dtype", [
    (128, 16, 4, jnp.bfloat16), (256, 8, 8, jnp.float16), (128, 128, 1, jnp.bfloat16),
    (512, 16, 16, jnp.bfloat16)])
def test_matches_reference(rank, block_size, q_heads, dtype, rng):
  width = 2 if block_size == 128 else 5 * 16 // block_size
  check(rng, rank=rank, block_size=block_size, q_heads=q_heads, dtype=dtype, width=width,
        num_blocks=max(20, 3 * width))


@pytest.mark.parametrize("num_heads,q_heads", [(2, 6), (3, 3)])
def test_latent_heads(num_heads, q_heads, rng):
  """A cache of several latent heads, each read by a group of query heads (3: N = 8;
  1: each query head its own latent head)."""
  check(rng, num_heads=num_heads, q_heads=q_heads)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_splits_and_blocks_outside_the_cache(num_splits, rng):
  check(rng, lens=(150, 17, 64), width=10, num_blocks=40, num_splits=num_splits,
        bad_blocks=True)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_many_tiles_a_split(stages, rng):
  """Eight tiles in a split (lengths 450 / 300 / 0, one split): each stage's barriers pass
  several phases, and with 2 or 3 stages the refills run ahead of the tiles in use."""
  check(rng, lens=(450, 300, 0), width=30, num_blocks=90, num_splits=1, stages=stages)


def test_large_scales(rng):
  """Entry scales past f16's range (kv_c ~ 1e8): the weights P s stay within f16's."""
  got = check(rng, magnitude=1e8, scale=1e-9)
  assert np.abs(got).max() > 1e6


def test_entry_scales_across_a_wide_range(rng):
  """Entry scales spread by +-2^-30 .. 2^30, and zeros, the logits from the RoPE parts alone:
  the weights P s span far past f16's range (weights P s in f16 as they come overflow here
  and fail this test; the kernel keeps them at most 1). Each query row is checked against
  its own largest element."""
  got = check(rng, lens=(150, 17, 64), width=10, num_blocks=40, scale=0.5, wide_scales=True,
              num_splits=2, per_row=True)
  assert np.abs(got).max() > 1e3


def test_supported():
  assert mosaic_mla_split.supported(1, 512, 64, 16, jnp.bfloat16, 16)
  assert mosaic_mla_split.supported(1, 512, 64, 64, jnp.float16, 8)
  assert mosaic_mla_split.supported(2, 512, 64, 16, jnp.bfloat16, 32)       # 16 a latent head
  assert not mosaic_mla_split.supported(2, 512, 64, 16, jnp.bfloat16, 34)   # 17 a latent head
  assert not mosaic_mla_split.supported(1, 64, 64, 16, jnp.bfloat16, 16)    # rank 64
  assert not mosaic_mla_split.supported(1, 512, 16, 16, jnp.bfloat16, 16)   # pe 16
  assert not mosaic_mla_split.supported(1, 512, 64, 16, jnp.float32, 16)    # f32 query
  assert not mosaic_mla_split.supported(1, 512, 64, 16, jnp.bfloat16, 17)   # 17 heads
  assert not mosaic_mla_split.supported(1, 512, 64, 4, jnp.bfloat16, 16)    # 4-token pages


@pytest.mark.parametrize("hopper", [True, False])
def test_auto_picks_mosaic_on_hopper(hopper, rng, monkeypatch):
  """``lowering="auto"`` runs this kernel over an ``fp8_split`` cache on a Hopper GPU
  (faked; measured faster there than Triton at 64 x 8K, 8 x 32K and 128 x 1K), Triton
  elsewhere."""
  class Picked(Exception):
    pass

  def picked(*args, **kwargs):
    raise Picked

  monkeypatch.delenv("JKV_LOWERING", raising=False)
  monkeypatch.setattr(jkv.backend, "hopper", lambda: hopper)
  monkeypatch.setattr(mosaic_mla_split, "mla_decode", picked)
  cache, table, lens, _ = build_mla(rng, rank=128, pe=64, kv_cache_dtype="fp8_split",
                                    dtype=jnp.bfloat16)
  query = query_of(rng, 3, 4, 192, jnp.bfloat16)
  call = lambda: cache.attend(0, query, table, lens, scale=0.1, backend=KERNEL)
  if hopper:
    with pytest.raises(Picked):
      call()
  else:
    assert call().shape == (3, 4, 128)
