"""Safetensors reading by slices (the `safetensors` library) and streaming writing.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets) and the raw bytes. Reading goes through `safe_open(..., framework="np")`, which maps the
file and returns bfloat16 as `ml_dtypes.bfloat16`; `get_slice` copies only the requested slice, so
only the pages under it are read from disk. The library's writer takes every tensor of a file at
once; ours below calls `fetch` once per tensor, so one tensor at a time sits on the host.
In a bucket (`gs://`) the header is parsed here and each slice's rows are one ranged download.
"""
import functools
import json
import os
import struct
from typing import Callable, Iterable

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open

from stabledrl_jax import storage

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(hf_dir: str | storage.Path) -> list[storage.Path]:
  """Paths of `model.safetensors` or of the shards named by `model.safetensors.index.json`."""
  hf_dir = storage.path(hf_dir)
  index_path = hf_dir / INDEX_FILE
  single_path = hf_dir / SINGLE_FILE
  if index_path.exists():
    names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
  elif single_path.exists():
    names = [SINGLE_FILE]
  else:
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}")
  paths = [hf_dir / name for name in names]
  for path in paths:
    if not path.exists():
      raise FileNotFoundError(f"checkpoint shard {path} (listed in {INDEX_FILE}) is missing")
  return paths


class Reader:
  """Tensor names, shapes and slices of a checkpoint directory (one file or shards + index).

  Each `read` maps the tensor's file only for the copy: a mapped page counts in the process's
  resident memory while the map is open, so maps held across tensors would add the checkpoint's
  size to the peak. Before the copy, the rows under the slice are asked for with
  POSIX_FADV_WILLNEED: the page faults of the copy then find them cached and start no readahead,
  which (up to `read_ahead_kb`, megabytes on some machines) would read the neighbouring rows
  another process holds.
  """

  def __init__(self, hf_dir: str | storage.Path):
    self._files, self._shapes, self._rows = {}, {}, {}  # name -> path, shape, (first byte, row bytes)
    self._dtypes = {}  # name -> dtype, of a bucket's tensors
    for path in checkpoint_files(hf_dir):
      if storage.is_remote(path):
        self._add_remote(path)
        continue
      with open(path, "rb") as f:
        (offset,) = struct.unpack("<Q", f.read(8))
      offset += 8
      with safe_open(path, framework="np") as f:
        for name in f.offset_keys():  # the data are these tensors back to back, in this order
          tensor = f.get_slice(name)
          shape = tuple(tensor.get_shape())
          itemsize = _DTYPES[tensor.get_dtype()].itemsize if tensor.get_dtype() in _DTYPES else 0
          self._files[name], self._shapes[name] = path, shape
          self._rows[name] = (offset, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
          offset += int(np.prod(shape, dtype=np.int64)) * itemsize

  def _add_remote(self, path: storage.Path) -> None:
    """The tensors of a file in a bucket, from its header (two ranged downloads)."""
    fs, key = _filesystem(path)
    (length,) = struct.unpack("<Q", fs.cat_file(key, start=0, end=8))
    header = json.loads(fs.cat_file(key, start=8, end=8 + length))
    for name, entry in header.items():
      if name == "__metadata__":
        continue
      shape, (begin, _) = tuple(entry["shape"]), entry["data_offsets"]
      dtype = _DTYPES.get(entry["dtype"])
      if dtype is None:
        raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which is not read")
      self._files[name], self._shapes[name], self._dtypes[name] = path, shape, dtype
      self._rows[name] = (8 + length + begin, int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize)

  def _read_remote(self, name: str, index: tuple) -> np.ndarray:
    """The rows under `index` in one ranged download, then the rest of `index` on the host."""
    shape, dtype = self.shape(name), self._dtypes[name]
    if not shape:
      first, last, step, rest = 0, 1, 1, ()
    else:
      (first, last, step), rest = index[0].indices(shape[0]), index[1:]
      last = max(last, first)
    begin, row_bytes = self._rows[name]
    fs, key = _filesystem(self._files[name])
    data = fs.cat_file(key, start=begin + first * row_bytes, end=begin + last * row_bytes)
    rows = np.frombuffer(data, dtype=dtype).reshape((last - first,) + shape[1:])
    return rows[(slice(None, None, step),) + tuple(rest)] if shape else rows.reshape(())

  def __contains__(self, name: str) -> bool:
    return name in self._files

  def shape(self, name: str) -> tuple[int, ...]:
    return self._shapes[name]

  def read(self, name: str, index: tuple | None = None) -> np.ndarray:
    """The slice `index` (a tuple of slices, as `make_array_from_callback` passes) of a tensor;
    the whole tensor by default. Only the rows under the slice are read from disk."""
    index = tuple(index) if index is not None else ()
    index += tuple(slice(None) for _ in self.shape(name)[len(index):])
    if name in self._dtypes:
      return self._read_remote(name, index)
    if index:
      first, last, _ = index[0].indices(self.shape(name)[0])
      begin, row_bytes = self._rows[name]
      if row_bytes and last > first:
        fd = os.open(self._files[name], os.O_RDONLY)
        try:
          os.posix_fadvise(fd, begin + first * row_bytes, (last - first) * row_bytes,
                           os.POSIX_FADV_WILLNEED)
        finally:
          os.close(fd)
    with safe_open(self._files[name], framework="np") as f:
      return f.get_slice(name)[index]


def _filesystem(path: storage.Path):
  """(fsspec filesystem, key) of a bucket's file: ranged reads without read-ahead."""
  import fsspec  # pylint: disable=import-outside-toplevel
  return fsspec.core.url_to_fs(os.fspath(path))


@functools.lru_cache(maxsize=None)
def _relayout(transpose: bool, dtype: str, sharding: NamedSharding):
  return jax.jit(lambda x: (x.T if transpose else x).astype(dtype), out_shardings=sharding)


def read_sharded(reader: Reader, name: str, *, transpose: bool, dtype: str,
                 sharding: NamedSharding) -> jax.Array:
  """Tensor `name` (transposed if asked, cast to `dtype`) as a global array with `sharding`.

  On one process each device's block is read directly. Across processes a device's block is
  often a column slice, and columns of a row-major tensor span every page of it, so every
  process would read the whole tensor: instead each process reads a contiguous run of rows (its
  1/processes share) and a compiled reshard moves the blocks to the devices that hold them.
  """
  hf_shape = reader.shape(name)
  devices = sorted(sharding.device_set, key=lambda d: (d.process_index, d.id))
  several = len({d.process_index for d in devices}) > 1
  if several and hf_shape and hf_shape[0] % len(devices) == 0:
    rows = NamedSharding(Mesh(np.array(devices), ("rows",)), PartitionSpec("rows"))
    staged = jax.make_array_from_callback(hf_shape, rows, lambda idx: reader.read(name, idx))
    return _relayout(transpose, dtype, sharding)(staged)

  def block(idx):
    host = reader.read(name, tuple(idx)[::-1] if transpose else tuple(idx))
    return (host.T if transpose else host).astype(dtype, copy=False)
  shape = hf_shape[::-1] if transpose else hf_shape
  return jax.make_array_from_callback(shape, sharding, block)


def read_stacked(reader: Reader, names: list[str], *, transpose: bool, dtype: str,
                 sharding: NamedSharding) -> jax.Array:
  """Tensors `names` of one shape (e.g. a layer's experts, one tensor each), transposed if asked
  and cast to `dtype`, stacked along a new first axis as a global array with `sharding`. Each
  device's block is read slice by slice: only its stack entries and only its part of each, so the
  host never holds the whole stack (4.3 GB per projection of LLaDA2.0-flash in float32)."""
  hf_shape = reader.shape(names[0])
  shape = (len(names), *(hf_shape[::-1] if transpose else hf_shape))

  def block(idx):
    rest = tuple(idx[1:])
    parts = [reader.read(names[i], rest[::-1] if transpose else rest)
             for i in range(len(names))[idx[0]]]
    return np.stack([(p.T if transpose else p).astype(dtype, copy=False) for p in parts])
  return jax.make_array_from_callback(shape, sharding, block)


def write_checkpoint(out_dir: str | storage.Path, tensors: list[tuple[str, tuple[int, ...], np.dtype]],
                     fetch: Callable[[str], np.ndarray], max_shard_bytes: int) -> list[str]:
  """Write tensors (name, shape, dtype) into one file or shards + index; `fetch(name)` is called
  once per tensor while writing, so at most one tensor is on the host at a time."""
  shards, current, size = [], [], 0
  for name, shape, dtype in tensors:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append((name, shape, np.dtype(dtype), nbytes))
    size += nbytes
  shards.append(current)
  if len(shards) == 1:
    names = [SINGLE_FILE]
  else:
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  out_dir = storage.path(out_dir)
  storage.makedirs(out_dir)
  weight_map, total = {}, 0
  for file_name, shard in zip(names, shards):
    _write_file(out_dir / file_name, shard, fetch)
    for name, _, _, nbytes in shard:
      weight_map[name] = file_name
      total += nbytes
  if len(shards) > 1:
    (out_dir / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
  return names


def _write_file(path: storage.Path, shard: Iterable, fetch: Callable[[str], np.ndarray]) -> None:
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape, dtype, nbytes in shard:
    header[name] = {"dtype": _NAMES[dtype], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the format asks for 8-byte aligned data
  with path.open("wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dtype, _ in shard:
      array = np.ascontiguousarray(fetch(name), dtype=dtype)
      if array.shape != tuple(shape):
        raise ValueError(f"tensor {name!r}: shape {array.shape}, header says {tuple(shape)}")
      f.write(memoryview(array.reshape(-1).view(np.uint8)))
