"""Checkpoint loading whose disk reads per process fall with the number of processes (slow).

Bytes read are the kernel's count of bytes a process caused to be fetched from the storage layer
(`read_bytes` in /proc/self/io): the library maps the files, so page faults, not read() calls, do
the reading, and only this counter sees them. The files are dropped from the page cache first
(fsync + POSIX_FADV_DONTNEED), and each process loads its own copy of the checkpoint, so no
process is served pages another one read: on separate hosts nothing would be shared either.
"""
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from stabledrl_jax import models
from stabledrl_jax.models import hf_config, weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOAD_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    hf_dir, address, processes, pid = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    from stabledrl_jax import distributed
    if processes > 1:
      distributed.initialize(address, processes, pid)
    import jax, numpy as np
    from jax.sharding import Mesh
    from stabledrl_jax import models
    from stabledrl_jax.models import weights
    from tests.huggingface_scaling_test import pattern

    def read_bytes():
      return int(next(l for l in open("/proc/self/io") if l.startswith("read_bytes")).split()[1])
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    jax.device_put(np.ones(4)).block_until_ready()  # backend up before the baseline
    before = read_bytes()
    model, cfg = models.load_pretrained(hf_dir, dtype="float32", mesh=mesh)
    values = [weights.variable(model, s.path).get_value() for s in weights.weight_specs(cfg)]
    jax.block_until_ready(values)
    after = read_bytes()
    for k, (spec, value) in enumerate(zip(weights.weight_specs(cfg), values)):
      hf_shape = value.shape[::-1] if spec.transpose else value.shape
      for shard in value.addressable_shards:
        index = shard.index[::-1] if spec.transpose else shard.index
        want = pattern(k, hf_shape, index).astype(np.float32)
        got = np.asarray(shard.data)
        np.testing.assert_array_equal(got.T if spec.transpose else got, want, err_msg=spec.hf_name)
    print(json.dumps({"read_bytes": after - before}))
""")


def pattern(k: int, shape: tuple, index: tuple | None = None) -> np.ndarray:
  """Tensor `k`'s values (or the block `index` of them): small integers, exact in bfloat16, that
  differ along every axis and between tensors, so a misplaced block cannot pass."""
  index = index or tuple(slice(None) for _ in shape)
  grids = np.ix_(*[np.arange(n)[s] for n, s in zip(shape, index)])
  value = sum((i + 1) * g for i, g in enumerate(grids)) + k
  return (value % 97).astype(ml_dtypes.bfloat16)


def write_checkpoint(out, cfg) -> int:
  """The 300M model in bfloat16 as four shards + index (one shard in memory at a time); the
  checkpoint's size in bytes."""
  specs = weights.weight_specs(cfg)
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  shapes = []
  for spec in specs:
    shape = tuple(weights.variable(abstract, spec.path).get_value().shape)
    shapes.append(shape[::-1] if spec.transpose else shape)
  os.makedirs(out)
  weight_map = {}
  for i in range(4):
    name = f"model-{i + 1:05d}-of-00004.safetensors"
    save_file({specs[k].hf_name: pattern(k, shapes[k]) for k in range(i, len(specs), 4)},
              os.path.join(out, name))
    weight_map.update({specs[k].hf_name: name for k in range(i, len(specs), 4)})
  json.dump({"metadata": {}, "weight_map": weight_map},
            open(os.path.join(out, "model.safetensors.index.json"), "w"))
  json.dump(hf_config.config_to_hf(cfg), open(os.path.join(out, "config.json"), "w"))
  return sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)
             if f.endswith(".safetensors"))


def drop_from_page_cache(directory) -> None:
  spec = importlib.util.spec_from_file_location(
      "bench_orbax_restore", os.path.join(REPO, "bench", "orbax_restore.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  bench.drop_from_page_cache(str(directory))


def load(dirs, timeout=600) -> list[int]:
  """Bytes read by each of len(dirs) processes (one CPU device each) loading onto fsdp=len(dirs);
  process i reads dirs[i]."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  procs = [subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT, REPO, d, address, str(len(dirs)),
                             str(i)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i, d in enumerate(dirs)]
  outs = [p.communicate(timeout=timeout) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return [json.loads(out.strip().splitlines()[-1])["read_bytes"] for out, _ in outs]


@pytest.mark.slow
def test_two_processes_each_read_at_most_0p6_of_a_300m_checkpoint(tmp_path):
  if not os.path.exists("/proc/self/io"):
    pytest.skip("no /proc/self/io to count bytes read")
  cfg = models.tiny(vocab_size=16384, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=16,
                    head_dim=64, mlp_dim=4096)
  assert 2.9e8 < cfg.num_params < 3.2e8
  size = write_checkpoint(str(tmp_path / "a"), cfg)
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  drop_from_page_cache(tmp_path / "a")
  (alone,) = load([str(tmp_path / "a")])
  print(f"checkpoint {size / 2**20:.0f} MiB; one process read {alone / 2**20:.0f} MiB")
  if alone < 0.95 * size:  # the counter or the eviction does not work on this filesystem
    pytest.skip(f"one process loading the whole checkpoint counted {alone} of {size} bytes")
  drop_from_page_cache(tmp_path / "a")
  drop_from_page_cache(tmp_path / "b")
  each = load([str(tmp_path / "a"), str(tmp_path / "b")])
  print("two processes read " + ", ".join(f"{b / 2**20:.0f} MiB ({b / size:.2f})" for b in each))
  assert max(each) <= 0.6 * size
