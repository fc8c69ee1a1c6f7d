"""Restoring a training checkpoint (parameters and AdamW state, Orbax) on 1 and 2 local processes:
wall time and peak host memory per process. Prints a markdown table.

  .venv/bin/python bench/orbax_restore.py --sizes=tiny,300m

For each size one process writes a checkpoint the way training does (`checkpointing.Checkpointer`:
float32 parameters and both AdamW moments, after one update). Then N = 1, 2 processes, one CPU
device each (`jax.distributed` on localhost, gloo), each build the model and optimiser sharded over
`fsdp=N` as a resumed run does (random initialisation first) and restore the step into them
collectively. Per process: the restore's wall time, and the resident memory before it and at its
peak (`ru_maxrss`, which includes the initialisation). The file pages are dropped from the page
cache before each restore (fsync + POSIX_FADV_DONTNEED), so the reads come from the disk's side.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tiny: the main job's model (4 x 128, 32 character tokens); 300m: the size of the streaming-load
# test (tests/huggingface_scaling_test.py).
SIZES = {"tiny": dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=32, mlp_dim=384),
         "300m": dict(vocab_size=16384, d_model=1024, n_layers=16, n_heads=16,
                                  n_kv_heads=16, head_dim=64, mlp_dim=4096)}

WORKER = textwrap.dedent("""
    import json, resource, sys, time
    sys.path.insert(0, sys.argv[1])
    size, directory, mode = sys.argv[2], sys.argv[3], sys.argv[4]
    address, processes, pid = sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
    from stabledrl_jax import distributed
    if processes > 1:
      distributed.initialize(address, processes, pid)
    import jax, ml_collections
    from flax import nnx
    from stabledrl_jax import checkpointing, models, optim, sharding
    sys.path.insert(0, sys.argv[1] + "/bench")
    from orbax_restore import SIZES
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    model = sharding.create_model(models.tiny(**SIZES[size]), 0, mesh)
    o = ml_collections.ConfigDict(dict(b1=0.9, b2=0.99, weight_decay=0.1, grad_clip=1.0,
                                       decay_steps=0))
    opt = nnx.Optimizer(model, optim.make_optimizer(1e-5, 0, 100, o), wrt=nnx.Param)
    sharding.replicate_rest(opt, mesh)
    ckpt = checkpointing.Checkpointer(directory, async_save=False)
    if mode == "save":  # after one update, so that the moments are not zeros (which compress)
      opt.update(model, nnx.state(model, nnx.Param))
      ckpt.save(0, model, opt, {"size": size})
      ckpt.wait()
      ckpt.close()
      print(json.dumps({"params": model.config.num_params}))
      sys.exit()
    jax.block_until_ready(nnx.state(opt))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    ckpt.restore(0, model, opt)
    jax.block_until_ready(nnx.state(opt))
    seconds = time.perf_counter() - t0
    ckpt.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "rss_before_mib": rss_before, "peak_rss_mib": peak}))
""")


def drop_from_page_cache(directory: str) -> None:
  for root, _, files in os.walk(directory):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def run_workers(size: str, directory: str, mode: str, processes: int) -> list[dict]:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  procs = [subprocess.Popen([sys.executable, "-c", WORKER, REPO, size, directory, mode, address,
                             str(processes), str(i)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(processes)]
  outs = [p.communicate(timeout=1800) for p in procs]
  for p, (_, err) in zip(procs, outs):
    if p.returncode:
      sys.exit(f"{mode} of {size} on {processes} process(es) failed:\n{err[-3000:]}")
  return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default="tiny,300m")
  p.add_argument("--processes", default="1,2")
  p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
  args = p.parse_args()
  print("| model | checkpoint | processes | restore s (each process) | RSS before, MiB "
        "| peak RSS, MiB |")
  print("|---|---:|---:|---|---|---|")
  with tempfile.TemporaryDirectory(dir=args.dir) as root:
    for size in args.sizes.split(","):
      if size not in SIZES:
        sys.exit(f"--sizes: unknown size {size!r}; expected some of {', '.join(SIZES)}")
      directory = os.path.join(root, size)
      (saved,) = run_workers(size, directory, "save", 1)
      mib = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory)
                for f in fs) / 2**20
      for n in (int(x) for x in args.processes.split(",")):
        drop_from_page_cache(directory)
        rows = run_workers(size, directory, "restore", n)
        print(f"| {size} ({saved['params'] / 1e6:.1f}M params) | {mib:,.0f} MiB | {n} | "
              + " | ".join(" / ".join(f"{r[k]:,.{d}f}" for r in rows) for k, d in (
                  ("seconds", 2), ("rss_before_mib", 0), ("peak_rss_mib", 0))) + " |", flush=True)


if __name__ == "__main__":
  main()
