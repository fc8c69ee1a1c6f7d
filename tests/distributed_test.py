"""Multi-process runs on this machine: the local launcher (2 processes x 2 CPU devices, gloo)
against a single process on 4 devices, preemption and resumption, a dead process, and the cluster
scripts."""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from stabledrl_jax import distributed
from tests.train_test import REPO, main_cmd, read_jsonl, strip_timing

LAUNCH = [sys.executable, str(REPO / "launch" / "local.py")]
SMOKE = "configs/sdar.py:smoke"


def launch_local(workdir, *overrides, processes=2, devices=2, timeout=600):
  return subprocess.run([*LAUNCH, f"--processes={processes}", f"--devices_per_process={devices}",
                         "--", f"--config={SMOKE}", f"--workdir={workdir}", *overrides],
                        cwd=REPO, capture_output=True, text=True, timeout=timeout,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})


def assert_metrics_match(got, want):
  # The processes' collectives (gloo) sum in another order than one process does: float rounding.
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for g, w in zip(strip_timing(got), strip_timing(want)):
    assert g.keys() == w.keys()
    for k, v in w.items():
      if isinstance(v, float):
        np.testing.assert_allclose(g[k], v, rtol=1e-4, atol=1e-6, err_msg=f"step {w['step']} {k}")
      else:
        assert g[k] == v, (w["step"], k)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  """An uninterrupted run of the smoke preset in two processes: its workdir and stdout."""
  multi = tmp_path_factory.mktemp("multi")
  out = launch_local(multi)
  assert out.returncode == 0, out.stderr[-3000:]
  return multi, out.stdout


@pytest.mark.slow
def test_two_processes_train_and_match_one_process_on_as_many_devices(tmp_path, two_processes):
  single = tmp_path / "single"
  out = subprocess.run(main_cmd(SMOKE, single), cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "JAX_PLATFORMS": "cpu",
                            "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
  assert out.returncode == 0, out.stderr[-3000:]
  want = read_jsonl(single / "metrics.jsonl")
  assert any(r.get("reward_mean", 0) > 0 for r in want), "no reward: the comparison would be weak"

  multi, stdout = two_processes
  assert stdout.count("(step 1) |") == 1, "only process 0 prints"
  assert sorted(int(p.name) for p in (multi / "checkpoints").iterdir() if p.name.isdigit()) == [7, 11]
  assert_metrics_match(read_jsonl(multi / "metrics.jsonl"), want)
  assert strip_timing(read_jsonl(multi / "eval.jsonl")) == strip_timing(read_jsonl(single / "eval.jsonl"))


PREEMPTED = "preempted at step {}: saved; rerun the same command to resume"


def start_processes(workdir, popen=subprocess.Popen, env=None):
  """The launcher's two processes, started here (with `popen`) so that a test can signal one.
  They load the programs the launcher's runs compiled (the suite's compilation cache)."""
  sys.path.insert(0, str(REPO / "launch"))
  import local
  env = {**(env or os.environ), "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  return [popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for cmd in local.commands(2, local.free_port(), 30, [f"--config={SMOKE}", f"--workdir={workdir}"])]


def signal_at(procs, metrics_dir, step, signum, victim):
  """Send `signum` to process `victim` once step `step`'s metrics are in `metrics_dir`; both
  processes' stdout once they have exited, which must be with code 0."""
  path, deadline = metrics_dir / "metrics.jsonl", time.time() + 600
  while not any(r["step"] >= step for r in read_jsonl_if(path)):
    assert all(p.poll() is None for p in procs) and time.time() < deadline, procs[0].stderr.read()[-3000:]
    time.sleep(0.02)
  os.kill(procs[victim].pid, signum)
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
  return outs[0][0] + outs[1][0]


@pytest.mark.slow
def test_a_signalled_process_makes_both_save_one_step_and_exit_0_and_the_reruns_end_alike(
    tmp_path, two_processes):
  # SIGTERM to process 1 in SFT (steps 0-5), SIGINT to process 0 in RL (steps 6-11): each time both
  # processes save the step in flight (no checkpoint is due there: every 4 steps), the rerun
  # resumes after it, and the metrics end as the uninterrupted run's, exactly (same two processes).
  want, run = read_jsonl(two_processes[0] / "metrics.jsonl"), tmp_path / "run"
  out = signal_at(start_processes(run), run, 1, signal.SIGTERM, victim=1)
  sft_step = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
  assert 1 <= sft_step < 5, "preempted outside SFT's steps 1-4"
  assert out.splitlines().count(PREEMPTED.format(sft_step)) == 1 and out.count("preempted") == 1, out

  out = signal_at(start_processes(run), run, 8, signal.SIGINT, victim=0)
  rl_step = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
  assert f"at step {sft_step + 1}/12" in out and PREEMPTED.format(rl_step) in out, out
  assert 8 <= rl_step < 11 and out.count("preempted") == 1, "preempted outside RL's steps 8-10"
  assert strip_timing(read_jsonl(run / "metrics.jsonl")) == strip_timing(want[:rl_step + 1])

  procs = start_processes(run)
  outs = [p.communicate(timeout=600) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:]
  assert f"at step {rl_step + 1}/12" in outs[0][0] and "preempted" not in outs[0][0]
  assert strip_timing(read_jsonl(run / "metrics.jsonl")) == strip_timing(want)
  assert (strip_timing(read_jsonl(run / "eval.jsonl"))
          == strip_timing(read_jsonl(two_processes[0] / "eval.jsonl")))


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1], ids=["coordinator_dies", "worker_dies"])
def test_when_a_process_dies_the_other_stops_with_an_error_in_bounded_time(tmp_path, victim):
  sys.path.insert(0, str(REPO / "launch"))
  import local  # the launcher's own commands, started here without its failure handling
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
           for cmd in local.commands(2, local.free_port(), 5, [f"--config={SMOKE}", f"--workdir={tmp_path}"])]
  try:
    deadline = time.time() + 300
    while not read_jsonl_if(tmp_path / "metrics.jsonl") and time.time() < deadline:
      assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-2000:]
      time.sleep(0.1)
    assert read_jsonl_if(tmp_path / "metrics.jsonl"), "training never started"
    os.kill(procs[victim].pid, signal.SIGKILL)
    killed_at = time.time()
    survivor = procs[1 - victim]
    _, err = survivor.communicate(timeout=120)
    assert survivor.returncode != 0
    assert time.time() - killed_at < 60  # heartbeat timeout 5 s, plus polling
    # The coordination service's heartbeat names it, or, when the survivor was mid-collective,
    # gloo's transport does first (then as one `error:` line).
    assert re.search(r"another task died|Connection reset by peer|Connection closed by peer", err), err
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def read_jsonl_if(path):
  return read_jsonl(path) if os.path.exists(path) else []


def test_launcher_reports_a_failed_process_and_its_exit_code(tmp_path):
  out = launch_local(tmp_path, "--config.rl.nope=1", timeout=120)
  assert out.returncode == 1
  assert "unknown config key rl.nope" in out.stderr
  assert "launch: process" in out.stderr and "exited with code 1" in out.stderr


def test_partial_multi_process_flags_are_an_error(monkeypatch):
  with pytest.raises(ValueError, match="process_id missing"):
    distributed.initialize("127.0.0.1:1234", 2)
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")  # the environment fills in what flags leave out
  with pytest.raises(ValueError, match="coordinator_address, process_id missing"):
    distributed.initialize()
  monkeypatch.setenv("JAX_PROCESS_ID", "one")
  with pytest.raises(ValueError, match="JAX_PROCESS_ID='one' is not an integer"):
    distributed.initialize()
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
  with pytest.raises(ValueError, match=r"process_id=3 is not in \[0, num_processes=2\)"):
    distributed.initialize()
  with pytest.raises(ValueError, match=r"process_id=2 is not in \[0, num_processes=2\)"):
    distributed.initialize("127.0.0.1:1234", 2, 2)
  out = subprocess.run(main_cmd(SMOKE, "/nonexistent", "--num_processes=2"), cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 1 and "need --distributed" in out.stderr


def test_slurm_script_starts_one_process_per_node_with_the_first_node_as_coordinator(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] && '
                                    "printf 'gpu-07\\ngpu-08\\ngpu-09\\n'\n")
  # srun: run the command once per task, as SLURM would on each node.
  (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                'for i in $(seq 0 $((SLURM_NTASKS - 1))); do SLURM_PROCID=$i "$@"; done\n')
  for f in bin_dir.iterdir():
    f.chmod(0o755)
  env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[07-09]",
         "SLURM_NNODES": "3", "SLURM_NTASKS": "3", "PYTHON": "echo"}
  out = subprocess.run(["bash", str(REPO / "launch" / "slurm.sbatch"), "--config=configs/llada.py:8b",
                        "--workdir=/shared/runs/a b"], capture_output=True, text=True, env=env, timeout=60)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines == [f"-m stabledrl_jax.main --distributed --coordinator_address=gpu-07:12355 "
                   f"--num_processes=3 --process_id={i} --config=configs/llada.py:8b "
                   f"--workdir=/shared/runs/a b" for i in range(3)]


def test_tpu_script_runs_the_same_command_on_every_worker():
  env = {**os.environ, "DRY_RUN": "1"}
  out = subprocess.run(["bash", str(REPO / "launch" / "tpu.sh"), "sdrl", "us-east5-a", "v5p-16",
                        "--config=configs/sdar.py:8b", "--workdir=gs://bucket/runs/a b"],
                       capture_output=True, text=True, env=env, timeout=60)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0].startswith("gcloud compute tpus queued-resources create sdrl --node-id=sdrl "
                             "--zone=us-east5-a --accelerator-type=v5p-16 --runtime-version=v2-alpha-tpuv5")
  train = lines[-1]
  assert "tpu-vm ssh sdrl --zone=us-east5-a --worker=all" in train
  assert "stabledrl_jax.main\\ --distributed\\ --config=configs/sdar.py:8b" in train
  assert "gs://bucket/runs/a\\\\\\ b" in train  # the space survives the remote shell
  out = subprocess.run(["bash", str(REPO / "launch" / "tpu.sh"), "sdrl", "us-east5-a", "tpu-x"],
                       capture_output=True, text=True, env=env, timeout=60)
  assert out.returncode != 0 and "set RUNTIME" in out.stderr
