"""Runs whose workdir, checkpoint and data live in a Cloud Storage bucket (`gs://`), against a real
storage server: fake-gcs-server on 127.0.0.1 in a private network namespace, the preconditions it
lacks supplied by the harness (tests/gcs_emulator.py). The processes see the server only through
the standard environment variables; nothing may land in a local `gs:` directory."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from flax import nnx

from stabledrl_jax import models, storage
from stabledrl_jax.models import huggingface
from tests import gcs_emulator
from tests.distributed_test import SMOKE, assert_metrics_match
from tests.huggingface_scaling_test import write_checkpoint
from tests.train_test import REPO, main_cmd, read_jsonl

# 2 SFT + 2 RL steps, a checkpoint after each: the stages, a resume and the closing export, fast.
SHORT = ("--config.sft.steps=2", "--config.rl.steps=2", "--config.checkpoint.every=1",
         "--config.eval.every=2", "--config.eval.num_examples=8")
LAUNCH = [sys.executable, str(REPO / "launch" / "local.py"), "--processes=2",
          "--devices_per_process=2", "--"]


def no_gs_directory(*roots) -> None:
  """A gs:// path taken for a local one lands in `<cwd>/gs:/...` (os.path.abspath)."""
  for root in roots:
    assert not (root / "gs:").exists(), f"a run wrote to local disk instead of the bucket: {root}"


def wait_for(path, proc, timeout=600) -> None:
  deadline = time.time() + timeout
  while not path.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert path.exists(), f"never written: {path}"


@pytest.mark.slow
def test_a_bucket_run_survives_kill_9_and_a_lost_bucket_and_the_commands_use_it(tmp_path):
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  want_dir = tmp_path / "local"
  out = subprocess.run(main_cmd(SMOKE, want_dir, *SHORT), cwd=REPO, capture_output=True,
                       text=True, timeout=600, env={**os.environ, **env})
  assert out.returncode == 0, out.stderr[-3000:]
  want = read_jsonl(want_dir / "metrics.jsonl")

  with gcs_emulator.running() as gcs:
    run, objects = gcs.url("run"), gcs.objects / "run"
    cmd = [*LAUNCH, f"--config={SMOKE}", f"--workdir={run}", *SHORT]
    quiet = dict(cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # kill -9 (every process) once step 1's checkpoint is complete in the bucket
    proc = gcs.popen(cmd, start_new_session=True, **quiet)
    wait_for(objects / "checkpoints" / "1" / "commit_success.txt", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()

    # the rerun resumes; the bucket then disappears: one line naming it, the run stops
    proc = gcs.popen(cmd, **quiet)
    for line in proc.stdout:
      if "resumed from" in line:
        assert run in line, line
        gcs.lose_bucket()
        break
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode != 0
    lost = [l for l in stderr.splitlines() if l.startswith(f"error: {run}: no bucket gs://bkt")]
    assert lost, stderr[-3000:]

    # the bucket is back: the same command resumes from its last complete checkpoint
    gcs.lose_bucket(False)
    out = gcs.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout
    assert_metrics_match(read_jsonl(objects / "metrics.jsonl"), want)
    assert (sorted(p.name for p in (objects / "hf").iterdir())  # no .in_progress left
            == sorted(p.name for p in (want_dir / "hf").iterdir()))

    # the commands read the run from the bucket, and export writes there
    policy = [f"--from_workdir={run}"]
    out = gcs.run([sys.executable, "-m", "stabledrl_jax.evaluate", *policy, "--max_examples=4"],
                  capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(read_jsonl(objects / "eval_step3.jsonl")) == 4
    out = gcs.run([sys.executable, "-m", "stabledrl_jax.generate", *policy, "--prompt=1234"],
                  capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-3000:]
    out = gcs.run([sys.executable, "-m", "stabledrl_jax.export", f"--workdir={run}",
                   f"--out={gcs.url('exported')}"], capture_output=True, text=True, timeout=600,
                  cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    # the same step as the run's closing export, and the same format as the local run's
    for name in ("model.safetensors", "config.json"):
      assert (gcs.objects / "exported" / name).read_bytes() == (objects / "hf" / name).read_bytes()
    assert (json.loads((objects / "hf" / "config.json").read_text())
            == json.loads((want_dir / "hf" / "config.json").read_text()))
  no_gs_directory(REPO, tmp_path)


LOAD_SCRIPT = textwrap.dedent("""
    import json, sys
    import gcsfs
    fetched = {}
    _cat = gcsfs.GCSFileSystem._cat_file
    async def counting(self, path, *args, **kwargs):  # every byte gcsfs downloads, per object
      data = await _cat(self, path, *args, **kwargs)
      fetched[path] = fetched.get(path, 0) + len(data)
      return data
    gcsfs.GCSFileSystem._cat_file = counting
    sys.path.insert(0, sys.argv[1])
    hf_dir, address, pid = sys.argv[2], sys.argv[3], int(sys.argv[4])
    from stabledrl_jax import build, config_lib, distributed
    distributed.initialize(address, 2, pid)
    import jax, numpy as np
    from jax.sharding import Mesh
    from stabledrl_jax import models
    from stabledrl_jax.models import weights
    from tests.huggingface_scaling_test import pattern
    c = config_lib.base_config("sdar")
    c.model.checkpoint = hf_dir
    c.task.name, c.task.source, c.task.source_dir = "jsonl", "local", sys.argv[5]
    c.sft.steps = 0
    examples = build.held_out(c, build.task(c), "/nonexistent")
    from stabledrl_jax import storage
    from stabledrl_jax.tasks import datasets
    gsm8k = datasets.load_source("gsm8k", "test", source="local", source_dir=sys.argv[6],
                                 data_dir=sys.argv[7] + f"/{pid}")
    try:
      storage.check_bucket("gs://nobucket/run")
      bad_bucket = None
    except FileNotFoundError as e:
      bad_bucket = str(e)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    model, cfg = models.load_pretrained(hf_dir, dtype="float32", mesh=mesh)
    for k, spec in enumerate(weights.weight_specs(cfg)):
      value = weights.variable(model, spec.path).get_value()
      hf_shape = value.shape[::-1] if spec.transpose else value.shape
      for shard in value.addressable_shards:
        index = shard.index[::-1] if spec.transpose else shard.index
        got = np.asarray(shard.data)
        np.testing.assert_array_equal(got.T if spec.transpose else got,
                                      pattern(k, hf_shape, index).astype(np.float32))
    print(json.dumps({"bytes": sum(v for k, v in fetched.items() if k.endswith(".safetensors")),
                      "examples": examples, "gsm8k": [gsm8k[i]["question"] for i in range(len(gsm8k))],
                      "bad_bucket": bad_bucket}))
""")


@pytest.mark.slow
def test_two_processes_load_a_bucket_checkpoint_reading_their_own_rows_and_a_bucket_task(tmp_path):
  seed = tmp_path / "seed"
  cfg = models.tiny(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4,
                    head_dim=32, mlp_dim=256)
  size = write_checkpoint(str(seed / "hf"), cfg)
  rows = [{"question": f"{i} + {i} = ?", "answer": str(2 * i)} for i in range(3)]
  (seed / "data").mkdir()
  for split in ("train", "test"):
    (seed / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  # a built-in task's files in the bucket: prepared (TFDS) into a local folder
  (seed / "gsm8k").mkdir()
  gsm8k = [{"question": f"What is {i} + 1?", "answer": f"{i} plus 1.\n#### {i + 1}"} for i in range(3)]
  for split in ("train", "test"):
    (seed / "gsm8k" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm8k))
  with gcs_emulator.running(seed=seed) as gcs:
    procs = [gcs.popen([sys.executable, "-c", LOAD_SCRIPT, str(REPO), gcs.url("hf"),
                        "127.0.0.1:12355", str(i), gcs.url("data"), gcs.url("gsm8k"),
                        str(tmp_path / "prepared")], cwd=REPO,
                       env={"JAX_PLATFORMS": "cpu",
                            "XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  assert all(0 < r["bytes"] <= 0.6 * size for r in results), ([r["bytes"] for r in results], size)
  for r in results:
    assert [e["question"] for e in r["examples"]] == [row["question"] for row in rows]
    assert sorted(r["gsm8k"]) == sorted(row["question"] for row in gsm8k)
    assert r["bad_bucket"].startswith("gs://nobucket/run: no bucket gs://nobucket"), r["bad_bucket"]
  no_gs_directory(REPO, tmp_path)


def test_a_bucket_the_credentials_cannot_reach_is_one_line_naming_the_workdir(tmp_path):
  """No credentials (the service answers 401 to an anonymous caller): the run stops before its
  first step with one line naming the workdir, and writes nothing."""
  with gcs_emulator.running() as gcs:
    gcs.refuse_anonymous()
    out = gcs.run(main_cmd(SMOKE, gcs.url("run")), capture_output=True, text=True, timeout=300,
                  cwd=REPO)
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith(f"error: {gcs.url('run')}: "), errors
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    gcs.refuse_anonymous(False)
    assert not any(gcs.objects.iterdir())
  no_gs_directory(REPO, tmp_path)


def test_a_half_written_export_is_refused_naming_it(tmp_path):
  huggingface.export_pretrained(models.Transformer(models.tiny(), rngs=nnx.Rngs(0)), tmp_path / "hf")
  assert huggingface.read_hf_config(tmp_path / "hf")["model_type"]
  (tmp_path / "hf" / storage.IN_PROGRESS).write_text("")  # what a killed bucket export leaves
  with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'hf'} is incomplete"):
    models.load_pretrained(str(tmp_path / "hf"))
