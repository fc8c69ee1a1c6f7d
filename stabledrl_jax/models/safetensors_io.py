"""Streaming safetensors reading and writing, one tensor at a time, bfloat16 included.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets) and the raw bytes. Reading a tensor seeks to its bytes and reads just those, so no
file is ever mapped or held whole; the `safetensors` numpy backend cannot express bfloat16.
"""
import json
import os
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class TensorEntry:
  """Where one tensor's bytes live."""

  def __init__(self, path: str, dtype: np.dtype, shape: tuple[int, ...], begin: int, end: int):
    self.path, self.dtype, self.shape, self.begin, self.end = path, dtype, shape, begin, end

  def read(self) -> np.ndarray:
    """The tensor as a fresh host array (nothing else of the file is read)."""
    out = np.empty(self.shape, self.dtype)
    with open(self.path, "rb") as f:
      f.seek(self.begin)
      if f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != self.end - self.begin:
        raise ValueError(f"truncated tensor data in {self.path}")
    return out


def read_header(path: str) -> dict[str, TensorEntry]:
  """Tensor entries of one .safetensors file."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
  entries = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"tensor {name!r} in {path} has unsupported dtype {info['dtype']}")
    begin, end = info["data_offsets"]
    entries[name] = TensorEntry(path, _DTYPES[info["dtype"]], tuple(info["shape"]),
                                8 + n + begin, 8 + n + end)
  return entries


def index_checkpoint(hf_dir: str) -> dict[str, TensorEntry]:
  """All tensors of `model.safetensors` or of the shards named by `model.safetensors.index.json`."""
  index_path = os.path.join(hf_dir, INDEX_FILE)
  single_path = os.path.join(hf_dir, SINGLE_FILE)
  if os.path.exists(index_path):
    with open(index_path) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.exists(single_path):
    files = [SINGLE_FILE]
  else:
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}")
  entries = {}
  for name in files:
    path = os.path.join(hf_dir, name)
    if not os.path.exists(path):
      raise FileNotFoundError(f"checkpoint shard {path} (listed in {INDEX_FILE}) is missing")
    entries.update(read_header(path))
  return entries


def write_checkpoint(out_dir: str, tensors: list[tuple[str, tuple[int, ...], np.dtype]],
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
  os.makedirs(out_dir, exist_ok=True)
  weight_map, total = {}, 0
  for file_name, shard in zip(names, shards):
    _write_file(os.path.join(out_dir, file_name), shard, fetch)
    for name, _, _, nbytes in shard:
      weight_map[name] = file_name
      total += nbytes
  if len(shards) > 1:
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return names


def _write_file(path: str, shard: Iterable, fetch: Callable[[str], np.ndarray]) -> None:
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape, dtype, nbytes in shard:
    header[name] = {"dtype": _NAMES[dtype], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the format asks for 8-byte aligned data
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dtype, _ in shard:
      array = np.ascontiguousarray(fetch(name), dtype=dtype)
      if array.shape != tuple(shape):
        raise ValueError(f"tensor {name!r}: shape {array.shape}, header says {tuple(shape)}")
      f.write(memoryview(array.reshape(-1).view(np.uint8)))
