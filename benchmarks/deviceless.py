"""The GPU machine's own compile of a jitted function, on a machine without a GPU.

jaxlib's XLA GPU compiler runs without a device when it is given a description of one
(JAX's deviceless ahead-of-time compile: a compile-only client made by
``jax.experimental.topologies.get_topology_desc``). It compiles the Pallas Triton kernels
through jaxlib's own Triton pipeline and ptxas, as the GPU machine does, so the registers
and SASS it gives are the device's: the per-block vLLM write compiles to 124 registers a
thread here and under ``ncu`` on the H100 (2026-12-06), where pip Triton's compile of the
same kernel (:func:`benchmarks.sass_report.compile_sass`) gives 96.

The compiled executable is serialized and its cubins read out of it: XLA stores the
executable as nested riegeli record files (64 KiB blocks, snappy-compressed chunks);
:func:`cubins` decodes them with the small readers below.

Needs the GPU machine's JAX and its CUDA plugin (Python >= 3.11), for example:

  pip install "jax==0.11.2" "jax-cuda12-plugin[with-cuda]==0.11.2" triton

(``triton`` only for its ``cuobjdump``, which reads the cubins.) Then
``python -m benchmarks.sass_report --deviceless CASE ...`` reports them.
"""

from __future__ import annotations

import struct

import jax

# The device described to the compiler: an H100 SXM as the GPU machine's (compute
# capability 9.0, compiled for sm_90a), CUDA 12.9, cuDNN 9.8.
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 9 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

_BLOCK = 1 << 16          # riegeli: a file is cut in blocks of 64 KiB,
_BLOCK_HEADER = 24        # each starting with a header of 24 bytes
_CHUNK_HEADER = 40
# Every riegeli file starts with the same 64 bytes (its first block header and signature
# chunk); their first 8, the block header's hash, find a file inside a larger buffer.
_FILE_START = bytes.fromhex("83af70d10d884a3f")
_ELF = b"\x7fELF"


def compile_serialized(fn, args) -> tuple[bytes, str]:
  """``jax.jit(fn)`` compiled for :data:`H100` from ``args``' shapes and dtypes (arrays or
  ``ShapeDtypeStruct`` leaves): (the executable serialized, the lowered module's text).
  Needs no GPU, and a process whose JAX runs on the CPU only (``JAX_PLATFORMS=cpu`` from
  its start: a CUDA back end that failed to start for want of a GPU takes the compile-only
  client with it)."""
  if jax.config.jax_platforms != "cpu":
    raise RuntimeError("a deviceless compile needs JAX_PLATFORMS=cpu set before JAX starts")
  from jax.experimental import topologies
  topology = topologies.get_topology_desc(platform="cuda", target_config=H100,
                                          topology="1x1x1")
  mesh = topologies.make_mesh(topo=topology, mesh_shape=(1,), axis_names=("x",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                       args)
  # Pallas' Triton lowering asks the abstract mesh which GPU it targets.
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    lowered = jax.jit(fn).lower(*specs)
  return lowered.compile().runtime_executable().serialize(), lowered.as_text()


def cubins(serialized: bytes) -> list[bytes]:
  """The cubins (ELF images) inside a serialized XLA GPU executable."""
  found = []
  _collect(serialized, found)
  return found


def _collect(data: bytes, found: list):
  start = data.find(_FILE_START)
  if start < 0:
    found.extend(_elf_images(data))
    return
  for record in _riegeli_records(data, start):
    _collect(record, found)


def _elf_images(data: bytes) -> list[bytes]:
  images, at = [], data.find(_ELF)
  while at >= 0:
    program_offset, section_offset = struct.unpack_from("<QQ", data, at + 0x20)
    program_size, programs, section_size, sections = struct.unpack_from("<HHHH", data,
                                                                         at + 0x36)
    end = max(section_offset + section_size * sections, program_offset + program_size * programs)
    for s in range(sections):
      header = at + section_offset + s * section_size
      kind, = struct.unpack_from("<I", data, header + 4)
      offset, size = struct.unpack_from("<QQ", data, header + 0x18)
      if kind != 8:   # SHT_NOBITS takes no bytes in the file
        end = max(end, offset + size)
    images.append(data[at:at + end])
    at = data.find(_ELF, at + end)
  return images


def _riegeli_records(data: bytes, start: int) -> list[bytes]:
  """The records of the riegeli file starting at ``data[start]``: its block headers
  dropped, then its chunks after the signature decoded while they are simple chunks
  (type ``r``) that fit in ``data`` (the file's end is not marked in ``data``)."""
  file = bytearray()
  for block in range(start, len(data), _BLOCK):
    file += data[block + _BLOCK_HEADER:block + _BLOCK]
  at, records = 64 - _BLOCK_HEADER, []   # the first chunk after the signature's
  while at + _CHUNK_HEADER <= len(file):
    data_size, = struct.unpack_from("<Q", file, at + 8)
    end = at + _CHUNK_HEADER + data_size
    if file[at + 24] != ord("r") or end > len(file):
      break
    records += _simple_chunk(bytes(file[at + _CHUNK_HEADER:end]))
    at = end
  return records


def _simple_chunk(body: bytes) -> list[bytes]:
  """A riegeli simple chunk: compression type, sizes block, values block."""
  compression = body[0]
  sizes_size, at = _varint(body, 1)
  sizes = _decompress(compression, body[at:at + sizes_size])
  values = _decompress(compression, body[at + sizes_size:])
  records, offset, position = [], 0, 0
  while position < len(sizes):
    size, position = _varint(sizes, position)
    records.append(values[offset:offset + size])
    offset += size
  return records


def _decompress(compression: int, block: bytes) -> bytes:
  if compression == 0:
    return block
  if compression != ord("s"):
    raise NotImplementedError(f"riegeli compression {chr(compression)!r} (only snappy)")
  size, at = _varint(block, 0)
  return _snappy(block, at, size)


def _varint(data, at: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    byte = data[at]
    at += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if byte < 0x80:
      return value, at


def _snappy(data: bytes, at: int, size: int) -> bytes:
  """A raw snappy stream at ``data[at]`` (its own length varint first) -> ``size`` bytes."""
  length, at = _varint(data, at)
  if length != size:
    raise ValueError(f"snappy stream of {length} bytes where {size} were expected")
  out = bytearray()
  while len(out) < size:
    tag = data[at]
    at += 1
    kind = tag & 3
    if kind == 0:   # a literal
      n = tag >> 2
      if n >= 60:
        width = n - 59
        n = int.from_bytes(data[at:at + width], "little")
        at += width
      out += data[at:at + n + 1]
      at += n + 1
      continue
    if kind == 1:   # a copy, 11-bit offset
      n, offset = ((tag >> 2) & 7) + 4, ((tag >> 5) << 8) | data[at]
      at += 1
    else:           # a copy, 16- or 32-bit offset
      width = 2 if kind == 2 else 4
      n, offset = (tag >> 2) + 1, int.from_bytes(data[at:at + width], "little")
      at += width
    if not 0 < offset <= len(out):
      raise ValueError("corrupt snappy stream")
    for _ in range(n):   # byte by byte: a copy may overlap what it writes
      out.append(out[-offset])
  return bytes(out)
