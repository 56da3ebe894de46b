"""The Mosaic GPU MLA decode over ``fp8_split`` caches (``lowering="mosaic"``; ``auto``'s
choice on Hopper) and ``fp8_ds_mla`` ones (also ``auto``'s choice on Hopper) against
the reference: Pallas' GPU interpreter on CPU, compiled with ``JKV_BACKEND=pallas`` on a
GPU (jax >= 0.11.2). The entries the sequences do not own hold NaN content, RoPE parts and
scales (``build_mla``), which must not leak."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from conftest import KERNEL
from test_attention import build_mla, query_of   # (imports jkv before the kernels)
from pallas_kernels import lowering, mosaic_mla

pytestmark = pytest.mark.skipif(not lowering.mosaic_available(),
                                reason="the Mosaic GPU kernels need jax >= 0.11.2")


def ds_mla_scaled(kv_cache, rank, factor):
  """An fp8_ds_mla cache uint8 [..., E] with each entry's tile scales times ``factor``
  [..., rank / 128]."""
  blocks = rank // 128
  scale_bytes = kv_cache[..., rank:rank + 4 * blocks]
  scales = jax.lax.bitcast_convert_type(scale_bytes.reshape(*scale_bytes.shape[:-1], blocks, 4),
                                        jnp.float32) * jnp.asarray(factor, jnp.float32)
  return kv_cache.at[..., rank:rank + 4 * blocks].set(
      jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(scale_bytes.shape))


def check(rng, *, rank=128, pe=64, block_size=16, q_heads=4, dtype=jnp.bfloat16,
          lens=(0, 33, 80), width=5, num_blocks=20, magnitude=1.0, scale=0.1,
          bad_blocks=False, num_splits=None, num_heads=None, wide_scales=False,
          per_row=False, stages=2, kv_cache_dtype="fp8_split", scale_exponents=30,
          rope_only=True, per_block=False, stale_scale=None):
  cache, table, lens, _ = build_mla(rng, rank=rank, pe=pe, kv_cache_dtype=kv_cache_dtype,
                                    dtype=dtype, block_size=block_size, num_blocks=num_blocks,
                                    batch=len(lens), width=width, lens=lens,
                                    magnitude=magnitude, num_heads=num_heads)
  ds_mla = kv_cache_dtype == "fp8_ds_mla"
  if stale_scale is not None:   # the unwritten entries' (all 0xFF) tile scales set to it
    entries = np.asarray(cache.kv_cache).copy()
    unwritten = (entries == 0xFF).all(axis=-1)
    entries[..., rank:rank + rank // 32][unwritten] = np.frombuffer(
        np.full(rank // 128, stale_scale, np.float32).tobytes(), np.uint8)
    cache = cache.replace(kv_cache=jnp.asarray(entries))
  if bad_blocks:   # blocks outside the cache are masked, as in the reference
    table = table.at[1, 1].set(-1).at[2, 0].set(num_blocks + 3)
  query = query_of(rng, len(lens), q_heads, rank + pe, dtype)
  if wide_scales:   # scales times +-2^-e .. 2^e, a tenth 0 (NaN stays NaN); with rope_only,
                    # the logits from the RoPE parts alone
    shape = (cache.kv_cache.shape[:-1] + (rank // 128,) if ds_mla
             else cache.entry_scale.shape)
    factor = np.where(rng.random(shape) < 0.1, 0.0, rng.choice([-1.0, 1.0], shape)
                      * np.exp2(rng.integers(-scale_exponents, scale_exponents + 1, shape)))
    if ds_mla:
      cache = cache.replace(kv_cache=ds_mla_scaled(cache.kv_cache, rank, factor))
    else:
      cache = cache.replace(entry_scale=cache.entry_scale * jnp.asarray(factor, jnp.float32))
    if rope_only:
      query = query.at[..., :rank].set(0)
  # Under jit: the eager checks reject blocks outside the cache.
  expected = jax.jit(lambda c, q, t, s: c.attend(0, q, t, s, scale=scale,
                                                 backend="reference"))(cache, query, table, lens)
  if num_splits is None:
    got = jax.jit(lambda c, q, t, s: c.attend(0, q, t, s, scale=scale, backend=KERNEL,
                                              lowering="mosaic"))(cache, query, table, lens)
  elif ds_mla:
    got = jax.jit(lambda c, q, t, s: mosaic_mla.ds_mla_decode(
        q, c.kv_cache, jnp.int32(0), t, s, kv_lora_rank=rank, num_blocks=num_blocks,
        scale=scale, interpret=KERNEL == "interpret", num_splits=num_splits,
        stages=stages))(cache, query, table, lens)
  else:
    got = jax.jit(lambda c, q, t, s: mosaic_mla.mla_decode(
        q, c.kv_cache, c.rope_cache, c.entry_scale, jnp.int32(0), t, s,
        num_blocks=num_blocks, scale=scale, interpret=KERNEL == "interpret",
        num_splits=num_splits, stages=stages))(cache, query, table, lens)
  got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
  assert got.shape == expected.shape and np.isfinite(got).all()
  # Each query row (or each 128 columns of one) against its own largest element where
  # asked, else the whole output's.
  if per_block:
    blocks = np.abs(expected).reshape(*expected.shape[:-1], -1, 128).max(axis=-1)
    size = np.repeat(np.maximum(blocks, 1e-30), 128, axis=-1)
  elif per_row:
    size = np.maximum(np.abs(expected).max(axis=-1, keepdims=True), 1e-30)
  else:
    size = max(1.0, float(np.abs(expected).max()))
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
  assert mosaic_mla.supported(1, 512, 64, 16, jnp.bfloat16, 16)
  assert mosaic_mla.supported(1, 512, 64, 64, jnp.float16, 8)
  assert mosaic_mla.supported(2, 512, 64, 16, jnp.bfloat16, 32)       # 16 a latent head
  assert not mosaic_mla.supported(2, 512, 64, 16, jnp.bfloat16, 34)   # 17 a latent head
  assert not mosaic_mla.supported(1, 64, 64, 16, jnp.bfloat16, 16)    # rank 64
  assert not mosaic_mla.supported(1, 512, 16, 16, jnp.bfloat16, 16)   # pe 16
  assert not mosaic_mla.supported(1, 512, 64, 16, jnp.float32, 16)    # f32 query
  assert not mosaic_mla.supported(1, 512, 64, 16, jnp.bfloat16, 17)   # 17 heads
  assert not mosaic_mla.supported(1, 512, 64, 4, jnp.bfloat16, 16)    # 4-token pages


class Picked(Exception):
  """Raised by a stubbed kernel: the op picked it."""


def stub_kernel(monkeypatch, name, hopper):
  """``mosaic_mla.<name>`` raises :class:`Picked`; ``auto`` as on a Hopper GPU or not."""
  def picked(*args, **kwargs):
    raise Picked

  monkeypatch.delenv("JKV_LOWERING", raising=False)
  monkeypatch.setattr(jkv.backend, "hopper", lambda: hopper)
  monkeypatch.setattr(mosaic_mla, name, picked)


@pytest.mark.parametrize("hopper", [True, False])
def test_auto_picks_mosaic_on_hopper(hopper, rng, monkeypatch):
  """``lowering="auto"`` runs this kernel over an ``fp8_split`` cache on a Hopper GPU
  (faked; measured faster there than Triton at 64 x 8K, 8 x 32K and 128 x 1K), Triton
  elsewhere."""
  stub_kernel(monkeypatch, "mla_decode", hopper)
  cache, table, lens, _ = build_mla(rng, rank=128, pe=64, kv_cache_dtype="fp8_split",
                                    dtype=jnp.bfloat16)
  query = query_of(rng, 3, 4, 192, jnp.bfloat16)
  call = lambda: cache.attend(0, query, table, lens, scale=0.1, backend=KERNEL)
  if hopper:
    with pytest.raises(Picked):
      call()
  else:
    assert call().shape == (3, 4, 128)


# fp8_ds_mla: vLLM's 656-byte entries (rank 512, RoPE part 64), four tile scales a key.
DS_MLA = dict(kv_cache_dtype="fp8_ds_mla", rank=512, pe=64)


@pytest.mark.parametrize("block_size,q_heads,dtype", [
    (16, 16, jnp.bfloat16), (8, 3, jnp.float16), (32, 8, jnp.bfloat16),
    (64, 4, jnp.float16), (128, 1, jnp.bfloat16)])
def test_ds_mla_matches_reference(block_size, q_heads, dtype, rng):
  """Pages of 8 to 128 tokens: 8 / 4 / 2 / 1 copies a tile, or a 64-token part of a page."""
  width = max(2, 5 * 16 // block_size)
  check(rng, **DS_MLA, block_size=block_size, q_heads=q_heads, dtype=dtype, width=width,
        num_blocks=max(20, 3 * width))


def test_ds_mla_splits_and_blocks_outside_the_cache(rng):
  check(rng, **DS_MLA, lens=(150, 17, 64), width=10, num_blocks=40, num_splits=3,
        bad_blocks=True)


@pytest.mark.parametrize("stages", [1, 2])
def test_ds_mla_many_tiles_a_split(stages, rng):
  check(rng, **DS_MLA, lens=(450, 300, 0), width=30, num_blocks=90, num_splits=1,
        stages=stages)


def test_ds_mla_tile_scales_across_a_wide_range(rng):
  """Each key's four tile scales spread by +-2^-30 .. 2^30 apart, and zeros, the logits from
  the RoPE parts alone: each block's weights are the key's largest |scale| times its own
  scale's ratio to it (within +-1); each query row against its own largest element."""
  got = check(rng, **DS_MLA, lens=(150, 17, 64), width=10, num_blocks=40, scale=0.5,
              wide_scales=True, num_splits=2, per_row=True)
  assert np.abs(got).max() > 1e3


def test_ds_mla_tile_scales_in_the_logits(rng):
  """Tile scales +-2^-4 .. 2^4 apart with content logits: each block's product times its
  own scale (one scale for all blocks, or none, fails); each 128 output columns of a row
  against their own largest element."""
  check(rng, **DS_MLA, lens=(150, 17, 64), width=10, num_blocks=40, scale=0.05,
        wide_scales=True, scale_exponents=4, rope_only=False, per_block=True)


@pytest.mark.parametrize("stale_scale", [np.inf, -np.inf, 3e38])
def test_ds_mla_stale_tile_scales(stale_scale, rng):
  """Entries past the lengths with infinite or huge tile scales (NaN content and RoPE
  parts) do not leak into the output (0 * inf is NaN)."""
  check(rng, **DS_MLA, lens=(150, 17, 64), width=10, num_blocks=40, num_splits=2,
        stale_scale=stale_scale)


def test_supported_ds_mla():
  assert mosaic_mla.supported_ds_mla(512, 64, 16, jnp.bfloat16, 16)
  assert mosaic_mla.supported_ds_mla(512, 64, 64, jnp.float16, 16)
  assert not mosaic_mla.supported_ds_mla(1024, 64, 16, jnp.bfloat16, 1)  # shared memory
  assert not mosaic_mla.supported_ds_mla(256, 64, 16, jnp.bfloat16, 16)  # RoPE unaligned
  assert not mosaic_mla.supported_ds_mla(512, 32, 16, jnp.bfloat16, 16)  # 64-byte rows
  assert not mosaic_mla.supported_ds_mla(512, 64, 16, jnp.bfloat16, 17)  # 17 heads
  assert not mosaic_mla.supported_ds_mla(512, 64, 4, jnp.bfloat16, 16)   # 4-token pages
  assert not mosaic_mla.supported_ds_mla(512, 64, 16, jnp.float32, 16)   # f32 query


@pytest.mark.parametrize("hopper", [True, False])
def test_auto_picks_mosaic_for_ds_mla_on_hopper(hopper, rng, monkeypatch):
  """``lowering="auto"`` runs an ``fp8_ds_mla`` cache on this kernel on a Hopper GPU (faked;
  H200, 64 x 8K: 211 us against Triton's 330), on Triton elsewhere; ``lowering="mosaic"``
  or ``$JKV_LOWERING=mosaic`` runs it anywhere, ``lowering="triton"`` never."""
  stub_kernel(monkeypatch, "ds_mla_decode", hopper=hopper)
  cache, table, lens, _ = build_mla(rng, rank=512, pe=64, kv_cache_dtype="fp8_ds_mla",
                                    dtype=jnp.bfloat16)
  query = query_of(rng, 3, 4, 576, jnp.bfloat16)
  call = lambda **kw: cache.attend(0, query, table, lens, scale=0.1, backend=KERNEL, **kw)
  if hopper:
    with pytest.raises(Picked):
      call()
  else:
    assert call().shape == (3, 4, 512)
  assert call(lowering="triton").shape == (3, 4, 512)
  with pytest.raises(Picked):
    call(lowering="mosaic")
  monkeypatch.setenv("JKV_LOWERING", "mosaic")
  with pytest.raises(Picked):
    call()
