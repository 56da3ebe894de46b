import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jkv import layout


@pytest.mark.parametrize("name,kv_layout", [("vllm", "NHD"), ("asm", "NHD"), ("flash", "NHD"),
                                            ("hnd", "NHD"), ("packed", "NHD"),
                                            ("packed", "HND")])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32])
def test_plane_offsets_match_array_indexing(name, kv_layout, dtype):
  """Plane.offset (what the kernels scatter through) == the element's place in the array."""
  nb, bs, h, d = 3, 16, 2, 32
  k_shape, v_shape = layout.cache_shapes(name, nb, bs, h, d, dtype, kv_layout)
  key_plane, value_plane = layout.planes(name, bs, h, d, dtype, kv_layout)
  x = layout.vector_width(dtype)
  for which, plane in (("k", key_plane), ("v", value_plane)):
    shape = k_shape if which == "k" or v_shape is None else v_shape
    flat = np.arange(int(np.prod(shape))).reshape(shape)
    for o, head, dim in itertools.product(range(bs), range(h), range(d)):
      if name in ("vllm", "asm") and which == "k":
        want = flat[1, head, dim // x, o, dim % x]
      elif name == "vllm":
        want = flat[1, head, dim, o]
      elif name == "asm":
        want = flat[1, head, o // x, dim, o % x]
      elif name == "flash":
        want = flat[1, o, head, dim]
      elif name == "hnd":
        want = flat[1, head, o, dim]
      else:
        col = dim + (d if which == "v" else 0)
        want = flat[1, o, head, col] if kv_layout == "NHD" else flat[1, head, o, col]
      block_start = flat[1].min()
      assert plane.offset(o, head, dim) == want - block_start


@pytest.mark.parametrize("name,kv_layout", [("vllm", "NHD"), ("asm", "NHD"), ("flash", "NHD"),
                                            ("hnd", "NHD"), ("packed", "NHD"),
                                            ("packed", "HND")])
def test_sizes_read_back_from_shapes(name, kv_layout):
  k_shape, _ = layout.cache_shapes(name, 5, 16, 3, 80, jnp.bfloat16, kv_layout)
  assert layout.blocks_of(name, k_shape, kv_layout) == (5, 16)
  assert layout.heads_of(name, k_shape, kv_layout) == (3, 80)


def test_blocks_of_and_errors():
  assert layout.blocks_of("vllm", (7, 2, 4, 16, 8)) == (7, 16)
  assert layout.blocks_of("hnd", (7, 2, 16, 64)) == (7, 16)
  assert layout.blocks_of("packed", (7, 16, 2, 128)) == (7, 16)
  with pytest.raises(ValueError, match="layout must be one of"):
    layout.cache_shapes("nhd", 1, 16, 1, 64, jnp.bfloat16)
  with pytest.raises(ValueError, match="head_size 60 must be a multiple of x=8"):
    layout.cache_shapes("vllm", 1, 16, 1, 60, jnp.bfloat16)
  with pytest.raises(ValueError, match="block_size 8 must be a multiple of x=16"):
    layout.cache_shapes("asm", 1, 8, 1, 64, jnp.float8_e4m3fn)


@pytest.mark.parametrize("name,kv_layout", [("vllm", "NHD"), ("asm", "NHD"), ("flash", "NHD"),
                                            ("hnd", "NHD"), ("packed", "NHD"),
                                            ("packed", "HND")])
def test_heads_dim_is_where_the_shapes_keep_heads(name, kv_layout):
  """heads_dim (what sharding splits over tp) is the dim of size num_heads in both shapes."""
  k_shape, v_shape = layout.cache_shapes(name, 5, 16, 7, 64, jnp.bfloat16, kv_layout)
  dim = layout.heads_dim(name, kv_layout)
  assert k_shape[dim] == 7 and (v_shape is None or v_shape[dim] == 7)
  assert layout.heads_dim("paged5d", "NHD") == 3 and layout.heads_dim("paged5d", "HND") == 2


def test_kv_layout_hnd_only_where_it_means_something():
  layout.check_layout("packed", "HND")
  layout.check_layout("hnd", "HND")
  with pytest.raises(ValueError, match="pass layout='hnd'"):
    layout.check_layout("flash", "HND")
  for name in ("vllm", "asm"):
    with pytest.raises(ValueError, match=f"layout '{name}' has a fixed order"):
      layout.check_layout(name, "HND")


def test_sub_byte_dtypes_and_odd_packed_rows_are_refused():
  with pytest.raises(ValueError, match="narrower than a byte"):
    layout.vector_width(jnp.float4_e2m1fn)
  assert layout.vector_width(jnp.int8) == 16 and layout.vector_width(jnp.float32) == 4
  with pytest.raises(ValueError, match="must be even"):
    layout.heads_of("packed", (4, 16, 2, 33))


@pytest.mark.parametrize("name,kv_layout", [("vllm", "NHD"), ("asm", "NHD"), ("flash", "NHD"),
                                            ("hnd", "NHD"), ("packed", "NHD"),
                                            ("packed", "HND")])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_kernel_index_math_matches_python(name, kv_layout, dtype):
  """Inside a kernel the plane formulas run on int32 arrays through lax's truncating
  div / rem (so Triton sees their contiguity): same offsets as Python's // and %, and
  flat_elem_offset(h * D + d) == elem_offset(h, d)."""
  bs, h, d = 32, 3, 64
  for plane in layout.planes(name, bs, h, d, dtype, kv_layout):
    e = np.arange(h * d)
    want = np.asarray([plane.elem_offset(int(i) // d, int(i) % d) for i in e])
    np.testing.assert_array_equal(np.asarray(plane.flat_elem_offset(jnp.asarray(e, jnp.int32))),
                                  want)
    np.testing.assert_array_equal([plane.flat_elem_offset(int(i)) for i in e], want)
    heads, dims = jnp.asarray(e // d, jnp.int32), jnp.asarray(e % d, jnp.int32)
    np.testing.assert_array_equal(np.asarray(plane.elem_offset(heads, dims)), want)
    o = np.arange(bs)
    np.testing.assert_array_equal(np.asarray(plane.token_offset(jnp.asarray(o, jnp.int32))),
                                  [plane.token_offset(int(i)) for i in o])
