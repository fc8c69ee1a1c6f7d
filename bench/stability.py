"""Stability under estimation noise: StableDRL against GRPO, ESPO and SPG with plain importance
weights, on the same SFT model, prompts and seeds (docs/method.md §8). One command:

  .venv/bin/python bench/stability.py --config=configs/sdar.py
  .venv/bin/python bench/stability.py --config=configs/sdar.py:sudoku   # the task of the recorded
                                      # table, docs/results/2026-12-03_stability_sudoku.json

First the main command's SFT stage runs once (`--config.rl.steps=0`, in ROOT/sft); then, for each
objective, RL starts from a copy of that checkpoint under two noise regimes:
  realistic    independent masks for the old and the new policy, one Monte Carlo sample;
  adversarial  the same, plus docs/method.md §8's ratio explosion on 70% of the rollouts
               (`--config.rl.adversarial=0.7`: easy masks for the new policy, hard for the old).
Every run is `python -m stabledrl_jax.main` in its own workdir (a finished run is read back, an
interrupted one resumes). Prints a table per regime (explosion rate = fraction of RL steps whose
largest gradient norm over the μ updates is non-finite or > 1e3; median and max gradient norm;
held-out accuracy after RL) and saves ROOT/stability.png (gradient norm and reward against step,
one line per objective, one column per regime). Extra arguments after `--` go to every run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OBJECTIVES = {"stabledrl": "StableDRL", "grpo": "GRPO (d1)", "espo": "ESPO",
              "spg_is": "SPG + plain IS"}
REGIMES = {
    "realistic": ["--config.rl.coupling=independent", "--config.rl.num_samples=1"],
    "adversarial": ["--config.rl.coupling=independent", "--config.rl.num_samples=1",
                    "--config.rl.adversarial=0.7"],
}
EXPLOSION = 1e3


def read_jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  return [json.loads(line) for line in open(path) if line.strip()]


def as_float(v) -> float:
  return math.nan if v is None else float(v)  # non-finite: null (before: "nan" / "inf")


def finished(workdir: str, tag: str) -> bool:
  return any(e["tag"] == tag for e in read_jsonl(os.path.join(workdir, "eval.jsonl")))


def launch(cmd: list[str], workdir: str, cpus: str | None) -> tuple[subprocess.Popen, object]:
  if cpus is not None and shutil.which("taskset"):
    cmd = ["taskset", "-c", cpus, *cmd]
  os.makedirs(workdir, exist_ok=True)
  log = open(os.path.join(workdir, "stdout.log"), "a")
  print(" ".join(cmd), flush=True)
  return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log


def run_all(jobs: list[tuple[str, list[str]]], parallel: int) -> None:
  """Runs `(workdir, command)` jobs, `parallel` at a time, each pinned to its share of the CPUs."""
  per = max((os.cpu_count() or 1) // parallel, 1)
  free = [f"{i * per}-{(i + 1) * per - 1}" for i in range(parallel)] if parallel > 1 else [None]
  pending, running = list(jobs), {}
  while pending or running:
    while pending and free:
      workdir, cmd = pending.pop(0)
      cpus = free.pop(0)
      running[workdir] = (*launch(cmd, workdir, cpus), cpus, time.time())
    for workdir, (proc, log, cpus, t0) in list(running.items()):
      if proc.poll() is None:
        continue
      del running[workdir]
      log.close()
      free.append(cpus)
      if proc.returncode:
        sys.exit(f"{workdir} failed (rc {proc.returncode}); see {workdir}/stdout.log")
      print(f"{workdir}: done in {(time.time() - t0) / 60:.1f} min", flush=True)
    time.sleep(1)


def summarise(workdir: str) -> dict:
  rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("stage") == "rl"]
  norms = [as_float(r.get("grad_norm_max", r["grad_norm"])) for r in rows]
  finite = sorted(n for n in norms if math.isfinite(n))
  evals = {e["tag"]: e for e in read_jsonl(os.path.join(workdir, "eval.jsonl"))}
  return {
      "steps": len(rows),
      "explosion_rate": sum(not math.isfinite(n) or n > EXPLOSION for n in norms) / max(len(norms), 1),
      "median": finite[len(finite) // 2] if finite else math.nan,
      "max": max(norms, key=lambda n: (not math.isfinite(n), n)) if norms else math.nan,
      "skipped": rows[-1]["skipped_updates"] if rows else 0,
      "ratio": max((as_float(r.get("log10_ratio_max", 0.0)) for r in rows), default=math.nan),
      "before": evals.get("before RL", {}).get("mean_reward", math.nan),
      "after": evals.get("after RL", {}).get("mean_reward", math.nan),
      "events": sum(len(r.get("events", [])) for r in rows),
      "curve": [(r["step"], as_float(r.get("grad_norm_max", r["grad_norm"])), r["reward_mean"])
                for r in rows],
  }


def plot(results: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(2, len(REGIMES), figsize=(6 * len(REGIMES), 7), squeeze=False)
  for col, regime in enumerate(REGIMES):
    for obj, summary in results[regime].items():
      label, curve = OBJECTIVES[obj], summary["curve"]
      if not curve:
        continue
      steps = [s - curve[0][0] + 1 for s, _, _ in curve]
      # Non-finite norms are drawn at the top of the axis as crosses.
      norms = [n if math.isfinite(n) else math.nan for _, n, _ in curve]
      line, = axes[0, col].plot(steps, norms, "-o", ms=3, label=label)
      bad = [s for s, (_, n, _) in zip(steps, curve) if not math.isfinite(n)]
      if bad:
        top = max([n for n in norms if math.isfinite(n)] + [EXPLOSION])
        axes[0, col].plot(bad, [top * 10] * len(bad), "x", color=line.get_color(), ms=8)
      axes[1, col].plot(steps, [r for _, _, r in curve], "-o", ms=3, label=label)
    axes[0, col].axhline(EXPLOSION, color="grey", ls=":", lw=1)
    axes[0, col].set(yscale="log", title=f"{regime}: gradient norm (max over μ updates)",
                     xlabel="RL step")
    axes[1, col].set(title=f"{regime}: RL reward (rollout mean)", xlabel="RL step")
    axes[0, col].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/sdar.py")
  p.add_argument("--root", default="runs/stability")
  p.add_argument("--steps", type=int, default=15, help="RL steps per run")
  p.add_argument("--prompts", type=int, default=8, help="rl.prompts_per_step")
  p.add_argument("--eval_examples", type=int, default=64)
  p.add_argument("--objectives", default=",".join(OBJECTIVES))
  p.add_argument("--parallel", type=int, default=2)
  p.add_argument("extra", nargs="*", help="more flags for main, after --")
  args = p.parse_args()
  objectives = args.objectives.split(",")
  for o in objectives:
    if o not in OBJECTIVES:
      sys.exit(f"--objectives: unknown {o!r}; expected some of {list(OBJECTIVES)}")
  # The clean SFT demonstrator and a small learning rate: this bench compares gradients under
  # estimation noise from a model RL can only nudge, not the main job's recovery from a weak one.
  common = [sys.executable, "-m", "stabledrl_jax.main", f"--config={args.config}",
            "--config.task.sft_unfilled=0", "--config.rl.lr=1e-5",
            f"--config.rl.prompts_per_step={args.prompts}",
            f"--config.eval.num_examples={args.eval_examples}", *args.extra]
  sft = os.path.join(args.root, "sft")
  if not finished(sft, "after SFT"):
    run_all([(sft, [*common, f"--workdir={sft}", "--config.rl.steps=0"])], parallel=1)
  jobs = []
  for regime, flags in REGIMES.items():
    for obj in objectives:
      workdir = os.path.join(args.root, f"{regime}_{obj}")
      if finished(workdir, "after RL"):
        continue
      if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        shutil.copytree(os.path.join(sft, "checkpoints"), os.path.join(workdir, "checkpoints"))
      jobs.append((workdir, [*common, f"--workdir={workdir}", f"--config.rl.steps={args.steps}",
                             f"--config.eval.every={args.steps}", f"--config.rl.objective={obj}",
                             *flags]))
  run_all(jobs, args.parallel)

  results = {regime: {o: summarise(os.path.join(args.root, f"{regime}_{o}")) for o in objectives}
             for regime in REGIMES}
  for regime in REGIMES:
    print(f"\n{regime} ({' '.join(REGIMES[regime])}), {args.steps} RL steps, "
          f"{args.prompts} prompts per step, held-out accuracy on {args.eval_examples} puzzles")
    print("| objective | explosion rate | median ‖g‖ | max ‖g‖ | skipped updates | "
          "max log10 ρ | held-out acc. before → after | events |")
    print("|---|---|---|---|---|---|---|---|")
    for o in objectives:
      r = results[regime][o]
      print(f"| {OBJECTIVES[o]} | {r['explosion_rate']:.2f} | {r['median']:.3g} | {r['max']:.3g} | "
            f"{r['skipped']} | {r['ratio']:.1f} | {r['before']:.3f} → {r['after']:.3f} | "
            f"{r['events']} |")
  png = os.path.join(args.root, "stability.png")
  plot(results, png)
  print(f"\nplots: {png}")


if __name__ == "__main__":
  main()
