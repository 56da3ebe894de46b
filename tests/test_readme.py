from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_code(after: str) -> str:
  """The first python code block of README.md after the text ``after``."""
  readme = (ROOT / "README.md").read_text()
  return readme.split(after, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  ci = (ROOT / ".ci" / "run").read_text()
  command = [line for line in ci.splitlines() if line.startswith("python3 -m venv")]
  assert len(command) == 1 and command[0] in readme
  assert 'pip install ".[test]"' in command[0] and "pytest" in command[0]
  assert "pip install . && python -m jkv" in readme


def test_quickstart_runs():
  code = readme_code("## Quickstart")
  namespace = {}
  exec(compile(code, "README quickstart", "exec"), namespace)
  k = namespace["k"]
  assert k.shape == (2, 64, 8, 128)
  assert float(k[1, 5].astype(float).sum()) == 8 * 128  # the written token
  assert not k[1, 6:].any()


def test_quantized_cache_snippet_runs():
  import jax.numpy as jnp
  import numpy as np
  code = readme_code("## Quantized caches")
  rng = np.random.default_rng(0)
  key = jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.float32)
  namespace = dict(jkv=__import__("jkv"), num_blocks=4, kv_heads=2, head_size=64, layer=1,
                   key=key, value=key, slot_mapping=jnp.array([16, 17, 18], jnp.int32),
                   block_table=jnp.array([[1]], jnp.int32), seq_lens=jnp.array([3], jnp.int32))
  exec(compile(code, "README quantized caches", "exec"), namespace)
  k = np.asarray(namespace["k"], np.float32)
  assert k.shape == (1, 16, 2, 64)
  # INT8 truncation (<= amax / 127) plus the bfloat16 of gather (create's default dtype).
  np.testing.assert_allclose(k[0, :3], np.asarray(key), rtol=2**-8, atol=np.abs(key).max() / 127)
  assert not k[0, 3:].any()


def test_save_load_snippet_runs(tmp_path, monkeypatch):
  import jax.numpy as jnp
  import jkv
  code = readme_code("## Saving and loading caches")
  monkeypatch.chdir(tmp_path)
  cache = jkv.PagedKVCache.create(2, 16, 2, 64, kv_cache_dtype="fp8")
  namespace = dict(jkv=jkv, cache=cache)
  exec(compile(code, "README save / load", "exec"), namespace)
  assert (tmp_path / "cache.npz").exists()
  assert jnp.array_equal(namespace["cache"].k_scale, cache.k_scale)


def test_blocks_snippet_runs():
  import jax.numpy as jnp
  import numpy as np
  code = readme_code("## Blocks, host offload")
  namespace = dict(jkv=__import__("jkv"), jnp=jnp, num_blocks=16, kv_heads=2, head_size=64)
  exec(compile(code, "README blocks", "exec"), namespace)
  pool, host, states = namespace["pool"], namespace["host"], namespace["states"]
  np.testing.assert_array_equal(np.asarray(pool.seq_lens)[:2], [20, 5])
  assert host.num_free_blocks == 64
  assert namespace["flash"].layout == "vllm"
  np.testing.assert_array_equal(np.asarray(states.read(0, "ssm", jnp.array([2, 1]))[:, 0, 0, 0]),
                                [1.0, 0.0])


def test_mla_snippet_runs():
  import jax.numpy as jnp
  import numpy as np
  code = readme_code("## MLA and the indexer cache")
  rng = np.random.default_rng(0)
  def rand(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  namespace = dict(jkv=__import__("jkv"), jnp=jnp, num_blocks=4, q_nope=rand(3, 2, 512),
                   q_pe=rand(3, 2, 64), kv_c=rand(3, 512), k_pe=rand(3, 64),
                   slot_mapping=jnp.array([16, 17, 18]), positions=jnp.array([0, 1, 2]),
                   block_table=jnp.array([[1]]), seq_lens=jnp.array([3]),
                   index_keys=rand(3, 128))
  exec(compile(code, "README MLA", "exec"), namespace)
  assert namespace["q_out"].shape == (3, 2, 576)
  np.testing.assert_array_equal(np.asarray(namespace["latent"][0, :3]),
                                np.asarray(namespace["kv_c"]))
  assert namespace["rope_key"].shape == (1, 16, 64)


def test_ragged_snippet_runs():
  import jax.numpy as jnp
  import numpy as np
  import jkv
  code = readme_code("## Ragged attention")
  cache = jkv.PagedKVCache.create(8, 16, 8, 128, num_layers=2, layout="flash")
  namespace = dict(jkv=jkv, jnp=jnp, cache=cache, block_size=16, kv_heads=8, head_size=128)
  exec(compile(code, "README ragged attention", "exec"), namespace)
  out, cache = namespace["out"], namespace["cache"]
  assert out.shape == (28, 32, 128)
  # Every written K / V is 1, so every real row averages ones; padding rows read 0.
  np.testing.assert_allclose(np.asarray(out[:25], np.float32), 1.0, rtol=1e-2)
  assert not np.asarray(out[25:], np.float32).any()
  k, _ = cache.gather(0, namespace["block_table"], namespace["kv_lens"])
  assert float(k[1, 16:40].astype(float).sum()) == 24 * 8 * 128   # the chunk was written


def test_prefix_caching_snippet_runs():
  import jax.numpy as jnp
  import numpy as np
  code = readme_code("## Prefix caching")
  prompt = np.arange(40, dtype=np.int32)
  namespace = dict(jkv=__import__("jkv"), jnp=jnp, prompt=prompt)
  exec(compile(code, "README prefix caching", "exec"), namespace)
  assert int(namespace["num_cached"][0]) == 32            # 2 full pages, not the last one
  pool = namespace["pool"]
  assert int(pool.ref_count[pool.block_table[1, 0]]) == 1  # shared from the cache


def test_max_collection_snippet_runs():
  import jax.numpy as jnp
  import numpy as np
  import jkv
  code = readme_code("### Mojo MAX's collection")
  rng = np.random.default_rng(0)
  key = jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.bfloat16)
  host = jnp.zeros((6, 2, 4, 16, 2, 64), jnp.bfloat16)
  namespace = dict(jkv=jkv, jnp=jnp, num_blocks=6, num_layers=4, kv_heads=2, head_size=64,
                   key=key, value=-key, slot_mapping=jnp.array([16, 17, 40], jnp.int32),
                   query=jnp.ones((2, 4, 64), jnp.bfloat16),
                   block_tables=jnp.array([[1, 0], [2, 3]], jnp.int32),
                   seq_lens=jnp.array([2, 9], jnp.int32), kv_lens=jnp.array([2, 9], jnp.int32),
                   cu_q_lens=jnp.array([0, 1, 2], jnp.int32),
                   pairs=jnp.array([[1, 5]], jnp.int32), host=host)
  exec(compile(code, "README MAX collection", "exec"), namespace)
  collection, key_canonical = namespace["collection"], namespace["key"]
  assert collection.shape == (6, 2, 4, 16, 2, 64)
  np.testing.assert_array_equal(np.asarray(collection[1, 1, 3, 0], np.float32),
                                -np.asarray(key[0], np.float32))
  np.testing.assert_array_equal(np.asarray(collection[5]), np.asarray(collection[1]))
  np.testing.assert_array_equal(np.asarray(key_canonical[3, 2, 8], np.float32),
                                np.asarray(key[2], np.float32))
  np.testing.assert_array_equal(np.asarray(namespace["host"][5]), np.asarray(collection[1]))


def test_max_quantized_collection_snippet_runs():
  import jax.numpy as jnp
  import numpy as np
  code = readme_code("**Per-token FP8 / INT8 with MAX's")
  rng = np.random.default_rng(0)
  key = jnp.asarray(rng.standard_normal((3, 2, 128)), jnp.float32)
  query = jnp.asarray(rng.standard_normal((1, 4, 128)), jnp.float32)
  namespace = dict(jkv=__import__("jkv"), num_blocks=4, kv_heads=2, key=key, value=-key,
                   slot_mapping=jnp.array([16, 17, 18], jnp.int32), query=query,
                   block_tables=jnp.array([[1]], jnp.int32), seq_lens=jnp.array([3], jnp.int32))
  exec(compile(code, "README MAX quantized collection", "exec"), namespace)
  assert namespace["scales"].shape == (4, 2, 8, 16, 2, 2)
  out, out_arrays = (np.asarray(namespace[n], np.float32) for n in ("out", "out_arrays"))
  np.testing.assert_array_equal(out, out_arrays)
  # Attention over 3 tokens whose values are -key (FP8 per 64-element group): within 1/16.
  assert np.abs(out).max() > 0.1
  assert np.abs(out).max() <= np.abs(key).max() * (1 + 1 / 16)
