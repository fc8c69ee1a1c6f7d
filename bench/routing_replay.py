"""Routing replay on the tiny mixture-of-experts main job: held-out accuracy, ratio spread, clip
fraction and explosions with and without `rl.routing_replay`, per seed (issue 41).

  .venv/bin/python bench/routing_replay.py --seeds=0,1,2 --parallel=2
  .venv/bin/python bench/routing_replay.py --seeds=0,1,2 --record   # + docs/results JSON

Each (arm, seed) runs the main job, `python -m stabledrl_jax.main --config=configs/llada2.py
--config.seed=S [--config.rl.routing_replay=True]`, in ROOT/<arm>_seed<S> (a finished run is
read back, not redone; an interrupted one resumes). With `--parallel=N`, N runs share the
machine, each pinned to its own CPUs (`taskset`). Both arms of a seed run the same SFT, so
they differ from the first RL step on. Per run, from its eval.jsonl and metrics.jsonl: held-out
exact accuracy (mean reward) before and after RL, the mean and largest per-step max |log10
ratio| (`log10_ratio_max`), the mean clip fraction, and explosion steps (the largest pre-clip
gradient norm of a step non-finite or above 10x the running median, `bench/objectives.py`).
`--record` writes the table, one row per run and one per arm (mean and max - min over the
seeds), to docs/results/DATE_llada2_routing_replay.json, which `bench/report.py` renders into
docs/llada2.md; `--read_only` starts nothing and tables the finished runs (an unfinished one is
named in the notes). Extra flags after `--` go to every run.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/llada2.py"
ARMS = {"no replay": [], "routing replay": ["--config.rl.routing_replay=True"]}


def _objectives_bench():
  spec = importlib.util.spec_from_file_location("objectives_bench",
                                                os.path.join(REPO, "bench", "objectives.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def read_jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def summary(workdir: str) -> dict | None:
  """One finished run's figures, or None while it is not finished."""
  evals = {e["tag"]: e for e in read_jsonl(os.path.join(workdir, "eval.jsonl"))}
  if "after RL" not in evals:
    return None
  rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  sft = [r for r in rows if r.get("stage") == "sft"]
  rl = [r for r in rows if r.get("stage") == "rl"]
  bench = _objectives_bench()
  top = [float(r.get("grad_norm_max", r["grad_norm"])) for r in rl]
  mean = [float(r["grad_norm"]) for r in rl]
  ratio = [float(r["log10_ratio_max"]) for r in rl]
  return {"sft_steps": len(sft),
          "before": evals["before RL"]["accuracy"],
          "before_reward": evals["before RL"]["mean_reward"],
          "after": evals["after RL"]["accuracy"], "after_reward": evals["after RL"]["mean_reward"],
          "log10_ratio_mean": statistics.fmean(ratio), "log10_ratio_top": max(ratio),
          "clip_fraction": statistics.fmean(float(r["clip_fraction"]) for r in rl),
          "explosions": sum(bench.explosions(top, mean)),
          "minutes": sum(float(r["step_s"]) for r in rows) / 60}


def run_all(workdirs: dict, parallel: int, extra: list[str]) -> None:
  cpus = os.cpu_count() or 1
  per_run = max(cpus // parallel, 1)
  pending = [k for k in workdirs if summary(workdirs[k]) is None]
  running = {}
  while pending or running:
    while pending and len(running) < parallel:
      key = pending.pop(0)
      arm, seed = key
      slot = min(set(range(parallel)) - {r[2] for r in running.values()})
      cmd = [sys.executable, "-m", "stabledrl_jax.main", f"--config={CONFIG}",
             f"--workdir={workdirs[key]}", f"--config.seed={seed}", *ARMS[arm], *extra]
      if parallel > 1 and hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", f"{slot * per_run}-{(slot + 1) * per_run - 1}", *cmd]
      os.makedirs(workdirs[key], exist_ok=True)
      log = open(os.path.join(workdirs[key], "stdout.log"), "a")
      print(f"{arm}, seed {seed}: {' '.join(cmd)}", flush=True)
      running[key] = (subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log,
                      slot)
    for key, (proc, log, _) in list(running.items()):
      if proc.poll() is not None:
        del running[key]
        log.close()
        if proc.returncode:
          sys.exit(f"{key} failed (rc {proc.returncode}); see {workdirs[key]}/stdout.log")
        print(f"{key[0]}, seed {key[1]}: done", flush=True)
    time.sleep(5)


def table(results: dict) -> list[list[str]]:
  rows = []
  for arm in ARMS:
    runs = {s: r for (a, s), r in results.items() if a == arm and r is not None}
    if not runs:
      continue
    for seed, r in sorted(runs.items()):
      rows.append([arm, str(seed), str(r["sft_steps"]),
                   f"{r['before']:.3f} ({r['before_reward']:.3f})",
                   f"{r['after']:.3f} ({r['after_reward']:.3f})",
                   f"{r['after'] - r['before']:+.3f}",
                   f"{r['log10_ratio_mean']:.4f} / {r['log10_ratio_top']:.4f}",
                   f"{r['clip_fraction']:.3f}", str(r["explosions"])])
    gains = [r["after"] - r["before"] for r in runs.values()]
    afters = [r["after"] for r in runs.values()]
    ratio = [r["log10_ratio_mean"] for r in runs.values()]
    rows.append([f"**{arm}, mean**", f"{len(runs)} seeds", "", "",
                 f"{statistics.fmean(afters):.3f} (spread {max(afters) - min(afters):.3f})",
                 f"{statistics.fmean(gains):+.3f} (min {min(gains):+.3f})",
                 f"{statistics.fmean(ratio):.4f} / "
                 f"{max(r['log10_ratio_top'] for r in runs.values()):.4f}",
                 f"{statistics.fmean(r['clip_fraction'] for r in runs.values()):.3f}",
                 str(sum(r["explosions"] for r in runs.values()))])
  return rows


COLUMNS = ["run", "seed", "SFT steps", "held-out before RL: accuracy (mean reward)", "after RL",
           "gain (accuracy)", "per-step max log10 ratio: mean / largest", "clip fraction",
           "explosion steps"]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--root", default="runs/routing_replay")
  p.add_argument("--parallel", type=int, default=1)
  p.add_argument("--record", action="store_true",
                 help="write docs/results/DATE_llada2_routing_replay.json")
  p.add_argument("--read_only", action="store_true", help="start nothing; table the finished runs")
  p.add_argument("extra", nargs="*", help="more flags for main, after --")
  args = p.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  workdirs = {(arm, s): os.path.join(args.root, f"{arm.replace(' ', '_')}_seed{s}")
              for arm in ARMS for s in seeds}
  started = datetime.datetime.now(datetime.timezone.utc)
  if not args.read_only:
    run_all(workdirs, args.parallel, args.extra)
  results = {k: summary(w) for k, w in workdirs.items()}
  rows = table(results)
  print(" | ".join(COLUMNS))
  for row in rows:
    print(" | ".join(row))
  if args.record:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    rec = {"title": "Routing replay on the tiny mixture-of-experts main job (configs/llada2.py)",
           "columns": COLUMNS, "align": "lllllllll", "rows": rows,
           "command": (f"bench/routing_replay.py --seeds={args.seeds} --parallel={args.parallel} "
                       "--record" + (" -- " + " ".join(args.extra) if args.extra else "")),
           "commit": commit,
           "machine": f"the {os.cpu_count()}-core CPU VM, {args.parallel} runs at a time",
           "date": (f"{started:%Y-%m-%d %H:%M}-"
                    f"{datetime.datetime.now(datetime.timezone.utc):%H:%M} UTC"),
           "notes": "60 StableDRL RL steps after SFT stopped at 30% validation accuracy (the main "
                    "job's settings); accuracy = exactly sorted, 256 held-out strings, greedy; "
                    "both arms of a seed share their SFT; spread = max - min over the seeds"
                    + "".join(f"; {a}, seed {s_}: not finished" for (a, s_), r in results.items()
                              if r is None),
           "runs": {f"{a}/seed{s}": r for (a, s), r in results.items()}}
    path = os.path.join(REPO, "docs", "results", f"{started:%Y-%m-%d}_llada2_routing_replay.json")
    with open(path, "w") as f:
      json.dump(rec, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
