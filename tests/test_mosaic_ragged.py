"""The Mosaic GPU kernels of ragged attention (``lowering="mosaic"``: the prefill tiles of
:mod:`pallas_kernels.mosaic_ragged`, the short items on :mod:`pallas_kernels.mosaic_attention`)
against the reference: Pallas' GPU interpreter on CPU, compiled with ``JKV_BACKEND=pallas`` on
a GPU (jax >= 0.11.2: CI's newest-JAX pass). Every cache entry the sequences do not own holds NaN,
so a kernel that reads past a length, or multiplies a stale value row by a zero
probability, fails; query rows of other sequences and padding rows are random, so a tile
that leaks rows into its neighbours' fails too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from conftest import KERNEL
from pallas_kernels import lowering, mosaic_ragged
from tests.test_mosaic_attention import poisoned_cache

pytestmark = pytest.mark.skipif(not lowering.mosaic_available(),
                                reason="the Mosaic GPU kernels need jax >= 0.11.2")

# (kv_len, q_len): a decode, a chunk over cached context that crosses item tiles, an empty
# sequence, a pure prefill of one whole item, a short multi-token step, a long chunk whose
# last item owns one row.
MIX = ((37, 1), (100, 70), (5, 0), (64, 64), (130, 3), (200, 129))


def check(rng, layout="flash", kv_layout="NHD", dtype=jnp.bfloat16, block_size=16, mix=MIX,
          q_heads=8, heads=2, head_size=128, num_layers=1, layer=0, bad_blocks=False,
          num_seqs=None, padding=7, kv_cache_dtype="auto", zero_k_scale=False,
          outside_seqs=(), wide_query=None, **options):
  kv_lens = np.array([kv for kv, _ in mix])
  width = -(-int(kv_lens.max()) // block_size)
  num_blocks = len(mix) * width + 5
  table = rng.permutation(num_blocks)[:len(mix) * width].reshape(len(mix), width)
  fp8 = kv_cache_dtype != "auto"
  k_scale, v_scale = (jnp.asarray(rng.uniform(0.5, 2, heads) if fp8 else np.ones(heads),
                                  jnp.float32) for _ in range(2))
  if fp8:
    options.update(kv_cache_dtype=kv_cache_dtype, v_scale=v_scale,
                   k_scale=k_scale * 0 if zero_k_scale else k_scale)
  key_cache, value_cache = poisoned_cache(
      rng, layout, kv_layout, num_blocks, block_size, heads, head_size, dtype, kv_cache_dtype,
      table, kv_lens, k_scale, v_scale, num_layers, layer)
  if bad_blocks:   # blocks outside the cache are masked, as in the reference
    table = table.copy()
    table[1, 2], table[5, 0] = -1, num_blocks + 5
  if outside_seqs:   # sequences none of whose blocks lie in the cache
    table = table.copy()
    table[list(outside_seqs)] = -1
  cu = np.concatenate([[0], np.cumsum([q for _, q in mix])]).astype(np.int32)
  query = rng.standard_normal((int(cu[-1]) + padding, q_heads, head_size))
  if wide_query is not None:   # rows 2^wide_query .. 2^3, elements over 2^-8 .. 2^2 of theirs
    query *= (2.0 ** rng.integers(wide_query, 4, query.shape[:2]))[..., None]
    query *= 2.0 ** rng.uniform(-8, 2, query.shape)
  query = jnp.asarray(query, dtype)
  args = (query, key_cache, value_cache, jnp.asarray(table, jnp.int32),
          jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu), jnp.int32(len(mix) if num_seqs is None
                                                                      else num_seqs))

  def attend(query, key_cache, value_cache, table, lens, cu, num_seqs, **kw):
    return jkv.ragged_paged_attention(query, key_cache, value_cache, table, lens, cu,
                                      num_seqs=num_seqs, layout=layout, kv_layout=kv_layout,
                                      layer=None if num_layers == 1 else layer, **options,
                                      **kw)

  if num_layers == 1:
    args = (args[0], args[1][0], None if args[2] is None else args[2][0]) + args[3:]
  want = jax.jit(lambda *a: attend(*a, backend="reference"))(*args)
  got = jax.jit(lambda *a: attend(*a, backend=KERNEL, lowering="mosaic"))(*args)
  assert got.dtype == dtype and bool(jnp.isfinite(got).all())
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=2e-2, rtol=2e-2)
  end = int(cu[len(mix) if num_seqs is None else num_seqs])
  assert np.all(np.asarray(got[end:]) == 0)   # padding rows read exactly 0


@pytest.mark.parametrize("layout,kv_layout", [("flash", "NHD"), ("hnd", "NHD"),
                                              ("packed", "HND")])
def test_layouts(rng, layout, kv_layout):
  check(rng, layout, kv_layout)


@pytest.mark.parametrize("q_heads,heads,head_size,dtype,block_size", [
    (4, 4, 64, jnp.float16, 8),      # MHA: one compute warpgroup, 8 pages a tile
    (6, 2, 128, jnp.bfloat16, 128),  # group of 3 (one warpgroup), 64-token parts of a page
    (16, 4, 64, jnp.bfloat16, 64)])  # group of 4, a page a tile
def test_shapes(rng, q_heads, heads, head_size, dtype, block_size):
  check(rng, q_heads=q_heads, heads=heads, head_size=head_size, dtype=dtype,
        block_size=block_size)


def test_blocks_outside_the_cache_and_a_stacked_layer(rng):
  check(rng, bad_blocks=True, num_layers=3, layer=2)


def test_traced_num_seqs_drops_later_sequences(rng):
  check(rng, num_seqs=4)


# Short items of up to 4 tokens (G = 4): decodes, 2- and 4-token steps over a context split
# in several parts, an empty sequence, one past num_seqs' reach is tested above.
SHORT_MIX = ((300, 1), (5, 4), (129, 2), (64, 0), (250, 4), (1, 1))


@pytest.mark.parametrize("layout,kv_layout,block_size", [("flash", "NHD", 16),
                                                          ("hnd", "NHD", 128),
                                                          ("packed", "HND", 8)])
def test_short_items(rng, layout, kv_layout, block_size):
  check(rng, layout, kv_layout, block_size=block_size, mix=SHORT_MIX)


def test_short_items_in_context_splits(rng):
  """Many splits per item: the causal limit of each token is split-local."""
  check(rng, mix=SHORT_MIX + ((700, 3),), q_heads=4, heads=1)


def test_fp8_short_items_in_context_splits_with_a_negative_scale(rng):
  """Short items over an FP8 cache in many context splits: the causal limit of each token
  is split-local and the mask follows any scale (the prefill tiles of this mix then run on
  Triton)."""
  check(rng, mix=SHORT_MIX + ((700, 3),), q_heads=4, heads=1, kv_cache_dtype="fp8",
        scale=-0.05)


def test_short_items_with_sinks_and_a_negative_scale(rng):
  """The decode kernel takes both (sinks join in the combine; its mask follows the scale);
  the prefill tiles of this mix then run on Triton."""
  check(rng, sinks=jnp.asarray(rng.standard_normal(8), jnp.float32), scale=-0.05)


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("fp8", jnp.bfloat16),
                                                  ("fp8_e5m2", jnp.float16)])
def test_fp8_caches(rng, kv_cache_dtype, dtype):
  """Both kernels over FP8 caches with per-head scales (prefill tiles and short items)."""
  check(rng, mix=MIX + SHORT_MIX, kv_cache_dtype=kv_cache_dtype, dtype=dtype)


def test_fp8_prefill_with_one_compute_warpgroup(rng):
  """An odd GQA group (3): one compute warpgroup reads the slots the memory warpgroup
  converts (each released by one arrival)."""
  check(rng, mix=((100, 70), (64, 64), (37, 1)), q_heads=6, heads=2, kv_cache_dtype="fp8")


@pytest.mark.parametrize("kv_cache_dtype,dtype,lowest", [("fp8", jnp.bfloat16, -20),
                                                         ("fp8_e5m2", jnp.float16, -5)])
def test_fp8_query_rows_of_any_size(rng, kv_cache_dtype, dtype, lowest):
  """Over FP8 caches both kernels meet the keys with the query split into two e4m3 terms
  per row (a power-of-two scale each): rows up to 2^23 apart (fp16: its normal range),
  elements spread over 2^-8 .. 2^2 of their row, still match the reference."""
  check(rng, mix=((100, 70), (64, 64), (37, 1), (130, 3)), kv_cache_dtype=kv_cache_dtype,
        dtype=dtype, wide_query=lowest)


def test_fp8_prefill_with_a_zero_key_scale(rng):
  """A zero key scale gives uniform attention over the visible keys, as the reference,
  not NaN (the logits' factor is floored at float32's smallest normal, so masked logits
  stay -inf)."""
  check(rng, mix=((100, 70), (64, 64)), kv_cache_dtype="fp8", zero_k_scale=True)


def test_supported_cases():
  """The kernel takes 16-bit NHD / HND caches without the options it lacks; the op then runs
  the rest on Triton (``auto``) or raises for an explicit ``lowering="mosaic"``."""
  from jkv import layout as layout_lib
  flash = layout_lib.planes("flash", 16, 2, 128, jnp.bfloat16, "NHD")
  vllm = layout_lib.planes("vllm", 16, 2, 128, jnp.bfloat16, "NHD")
  options = dict(scale=0.1, quant="none", alibi=False, soft_cap=False, window=False,
                 sinks=False)
  assert mosaic_ragged.supported(*flash, jnp.bfloat16, jnp.bfloat16, 4, 64, **options)
  assert not mosaic_ragged.supported(*vllm, jnp.bfloat16, jnp.bfloat16, 4, 64, **options)
  assert not mosaic_ragged.supported(*flash, jnp.float32, jnp.float32, 4, 64, **options)
  assert not mosaic_ragged.supported(*flash, jnp.bfloat16, jnp.bfloat16, 4, 64,
                                     **dict(options, sinks=True))
  assert not mosaic_ragged.supported(*flash, jnp.bfloat16, jnp.bfloat16, 4, 1 << 16,
                                     **options)   # the info row outgrows shared memory
  for scale in (0.0, -0.1):   # masked logits are -inf before the scale multiplies them
    assert not mosaic_ragged.supported(*flash, jnp.bfloat16, jnp.bfloat16, 4, 64,
                                       **dict(options, scale=scale))
  query = jnp.ones((3, 4, 128), jnp.bfloat16)
  cache = jnp.ones((4, 16, 2, 128), jnp.bfloat16)
  for option in (dict(logits_soft_cap=30.0), dict(sliding_window=8)):   # neither kernel's
    with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel"):
      jkv.ragged_paged_attention(query, cache, cache, jnp.zeros((1, 4), jnp.int32),
                                 jnp.array([3]), jnp.array([0, 3]), **option,
                                 backend=KERNEL, lowering="mosaic")
  with pytest.raises(ValueError, match="lowering must be one of"):
    jkv.ragged_paged_attention(query, cache, cache, jnp.zeros((1, 4), jnp.int32),
                               jnp.array([3]), jnp.array([0, 3]), backend="reference",
                               lowering="cuda")


def test_long_tables_split_and_stages_within_shared_memory():
  """A split's info row stays within shared memory however wide the block table (more
  splits), and a stage count whose tiles do not fit is refused before any kernel runs."""
  from jkv import layout as layout_lib
  from pallas_kernels import mosaic_attention
  splits, pages = mosaic_attention.split_geometry(64, 8, 100_000, 16, None)
  assert pages <= mosaic_attention.MAX_SPLIT_PAGES and splits * pages >= 100_000
  assert mosaic_attention.split_geometry(64, 8, 2048, 16, None) == (1, 2048)   # as before
  key_plane, value_plane = layout_lib.planes("flash", 16, 2, 128, jnp.bfloat16, "NHD")
  cache = jnp.zeros((1, 8, 16, 2, 128), jnp.bfloat16)
  ones = jnp.ones((2,), jnp.float32)
  table, lens = jnp.zeros((1, 2), jnp.int32), jnp.array([5], jnp.int32)
  planes = dict(key_plane=key_plane, value_plane=value_plane, num_blocks=8, scale=0.1,
                interpret=True, stages=8)
  with pytest.raises(ValueError, match="shared memory"):
    mosaic_attention.paged_attention_decode(jnp.zeros((1, 4, 128), jnp.bfloat16), cache,
                                            cache, ones, ones, jnp.int32(0), table, lens,
                                            **planes)
  items = tuple(jnp.zeros((1,), jnp.int32) for _ in range(4))
  with pytest.raises(ValueError, match="shared memory"):
    mosaic_ragged.prefill(jnp.zeros((5, 4, 128), jnp.bfloat16), cache, cache, ones, ones,
                          jnp.int32(0), table, lens, items, **planes)


def test_register_counts_fit_what_the_warpgroups_hold_at_launch(monkeypatch):
  """The compute warpgroups' register increase waits for what the memory warpgroup
  releases: counts past the launch's share (the kernel would hang) are refused."""
  for fp8 in (False, True):
    for wgs in (1, 2):
      compute, memory = mosaic_ragged._register_budget(wgs, fp8)
      assert compute % 8 == memory % 8 == 0
  monkeypatch.setitem(mosaic_ragged.REGISTERS, True, ((216, 240), 80))   # 512 > 3 x 168
  with pytest.raises(ValueError, match="hold at launch"):
    mosaic_ragged._register_budget(2, True)


@pytest.mark.parametrize("mix,outside_seqs", [
    (((2, 4), (37, 1), (3, 3), (100, 70), (130, 3), (5, 0)), ()),   # q_len > kv_len
    (MIX, (0, 4)),   # a decode and a 3-token step whose blocks all lie outside the cache
    (((1, 200), (100, 70)), ())])   # a prefill item 128+ rows before its keys begin
def test_rows_that_see_no_key_read_zero(rng, mix, outside_seqs):
  """Rows that see no key (short items: in no context split, max -1e30 everywhere; long
  items: none at all, a tile count below 0) read 0, as the reference, not NaN."""
  check(rng, mix=mix, outside_seqs=outside_seqs)
