"""Does RL raise held-out accuracy by more than the spread between seeds? The main command, once
per seed, then a table of held-out accuracy before and after RL.

  .venv/bin/python bench/rl_seeds.py --config=configs/sdar.py --seeds=0,1,2
  .venv/bin/python bench/rl_seeds.py --config=configs/llada.py --seeds=0,1,2 --parallel=2

Each seed runs `python -m stabledrl_jax.main --config=CONFIG --config.seed=S` in its own workdir
under `--root` (a finished run is read back, not redone; an interrupted one resumes). With
`--parallel=N`, N runs share the machine, each pinned to its own CPUs, so the wall times in the
table are then per run on fewer cores. Extra arguments after `--` go to every run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_evals(workdir: str) -> dict[str, dict]:
  path = os.path.join(workdir, "eval.jsonl")
  if not os.path.exists(path):
    return {}
  return {e["tag"]: e for e in map(json.loads, filter(str.strip, open(path)))}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/sdar.py")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--root", default="runs/seeds")
  p.add_argument("--parallel", type=int, default=1)
  p.add_argument("extra", nargs="*", help="more flags for main, after --")
  args = p.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  name = os.path.splitext(os.path.basename(args.config.partition(":")[0]))[0]
  workdirs = {s: os.path.join(args.root, f"{name}_seed{s}") for s in seeds}
  cpus = os.cpu_count() or 1
  per_run = max(cpus // args.parallel, 1)
  pending, running, walls = list(seeds), {}, {}
  while pending or running:
    while pending and len(running) < args.parallel:
      s = pending.pop(0)
      if "after RL" in read_evals(workdirs[s]):
        continue
      slot = min(set(range(args.parallel)) - {r[3] for r in running.values()})
      cmd = [sys.executable, "-m", "stabledrl_jax.main", f"--config={args.config}",
             f"--workdir={workdirs[s]}", f"--config.seed={s}", *args.extra]
      if args.parallel > 1 and hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", f"{slot * per_run}-{(slot + 1) * per_run - 1}", *cmd]
      os.makedirs(workdirs[s], exist_ok=True)
      log = open(os.path.join(workdirs[s], "stdout.log"), "a")
      print(f"seed {s}: {' '.join(cmd)}", flush=True)
      running[s] = (subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log,
                    time.time(), slot)
    for s, (proc, log, t0, _) in list(running.items()):
      if proc.poll() is not None:
        del running[s]
        log.close()
        walls[s] = time.time() - t0
        if proc.returncode:
          sys.exit(f"seed {s} failed (rc {proc.returncode}); see {workdirs[s]}/stdout.log")
        print(f"seed {s}: done in {walls[s] / 60:.1f} min", flush=True)
    time.sleep(2)

  print(f"\n{name}: held-out mean reward ('accuracy') and solve rate (exact answers), greedy")
  print(f"{'seed':>4} | {'before RL':>9} | {'after RL':>8} | {'gain':>6} | solved before -> after "
        f"| {'gain':>6} | wall")
  table = {"mean reward": ([], []), "solve rate": ([], [])}
  for s in seeds:
    e = read_evals(workdirs[s])
    before, after = e["before RL"], e["after RL"]
    for (b, a), key in zip(table.values(), ("mean_reward", "accuracy")):
      b.append(before[key])
      a.append(after[key])
    wall = f"{walls[s] / 60:.1f} min" if s in walls else "earlier"
    print(f"{s:>4} | {before['mean_reward']:9.3f} | {after['mean_reward']:8.3f} | "
          f"{after['mean_reward'] - before['mean_reward']:+6.3f} | {before['accuracy']:.3f} -> "
          f"{after['accuracy']:.3f}        | {after['accuracy'] - before['accuracy']:+6.3f} | "
          f"{wall}")
  for label, (befores, afters) in table.items():
    gains = [a - b for b, a in zip(befores, afters)]
    spread = max(befores) - min(befores)
    print(f"{label}: mean {statistics.mean(befores):.3f} -> {statistics.mean(afters):.3f}, "
          f"smallest gain {min(gains):+.3f}, spread between seeds before RL (max - min) "
          f"{spread:.3f}: the smallest gain {'is' if min(gains) >= 0.05 else 'is NOT'} >= 0.05 "
          f"and {'exceeds' if min(gains) > 3 * spread else 'does NOT exceed'} 3x the spread")
  print("\nRL step phases, seconds, median over the RL steps after the first (which compiles)")
  print(" | ".join(["seed", "sampler", *PHASES]))
  for s in seeds:
    print(" | ".join([f"{s:>4}", *phase_medians(workdirs[s])]))


PHASES = ("step_s", "rollout_s", "score_s", "behaviour_s", "update_s")


def phase_medians(workdir: str) -> list[str]:
  """The rollout sampler and the median seconds of each phase of the run's RL steps."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rl = [r for r in map(json.loads, filter(str.strip, f)) if r.get("stage") == "rl"][1:]
  if not rl or not all(k in rl[0] for k in PHASES):
    return ["(no phase times in metrics.jsonl)"]
  return [rl[0]["rollout_sampler"], *(f"{statistics.median(r[k] for r in rl):.3f}" for k in PHASES)]


if __name__ == "__main__":
  main()
