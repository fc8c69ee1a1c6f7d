"""The RL objectives over long runs from one SFT checkpoint per seed: explosions and smoothness.
StableDRL against GRPO, ESPO and SPG with plain importance weights, under the published estimator
settings and a noisy one.

  .venv/bin/python bench/objectives.py --config=configs/sdar.py --seeds=0,1,2 --parallel=2
  .venv/bin/python bench/objectives.py --extra=stabledrl_spg,wd1,noclip,eps_sweep
  .venv/bin/python bench/objectives.py --table_only       # read the finished runs, print the table
  .venv/bin/python bench/objectives.py --regimes= --lrs=3e-5,1e-4,3e-4,1e-3   # the lr frontier
  .venv/bin/python bench/objectives.py ... --table_only --frontier_record=docs/results/NAME.json
  .venv/bin/python bench/objectives.py --regimes= --regime=mu2:rl.updates_per_batch=2  # a variant
  .venv/bin/python bench/objectives.py ... --table_only --record=docs/results/NAME.json  # per seed

Per seed S the main command's SFT stage runs once (`--config.rl.steps=0`, in ROOT/sft_seedS); each
(regime, objective) run then starts RL from a copy of that workdir's checkpoints, in
ROOT/<regime>/<objective>_seedS, with the regime's settings (`regimes` below, printed with the
table). Every run is `python -m stabledrl_jax.main` in its own workdir: a finished one is read back,
not redone, an interrupted one resumes (a changed setting a checkpoint cannot follow stops it: use
a new --root). With `--parallel=N`, N runs share the machine, each pinned to its own CPUs. Extra
arguments after `--` go to every run, SFT included, after the regime's (so they win).

Per run, from metrics.jsonl and eval.jsonl: explosion rate (RL steps whose largest pre-clip
gradient norm over the μ updates is non-finite or above EXPLOSION_FACTOR x the running median of
the per-step gradient norm), mean / median / max gradient norm and the non-finite steps,
smoothness (standard deviation of the step-to-step changes of the mean training reward and of the
held-out mean reward curve), detector events by name, held-out mean reward at every evaluation, and the
reward over the first and the last 10 RL steps. Writes ROOT/objectives.md (per regime and
objective: mean and max - min over seeds) and ROOT/objectives.png (gradient norm and held-out
mean reward against RL step, mean over seeds, one row of panels per regime).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import time
from typing import Any, NamedTuple

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
if BENCH not in sys.path:  # loaded by path (the tests): the sibling bench scripts
  sys.path.insert(0, BENCH)
from stability import finished, read_jsonl, run_all  # noqa: E402  (bench/stability.py)

from stabledrl_jax import config_lib, metrics  # noqa: E402

LABELS = {"stabledrl": "StableDRL", "grpo": "GRPO (d1)", "espo": "ESPO", "spg_is": "SPG + plain IS",
          "stabledrl_spg": "StableDRL-SPG", "wd1": "wd1", "spg": "SPG"}
OBJECTIVES = ("stabledrl", "grpo", "espo", "spg_is")
# The estimator, μ and clip of the `8b` preset (read from it, so they follow the package); lr and
# batch stay the tiny default's. The preset's rl.max_ratio=5 replaces StableDRL's ε clip.
PUBLISHED_KEYS = ("rl.scheme", "rl.num_samples", "rl.coupling", "rl.updates_per_batch",
                  "rl.epsilon", "rl.max_ratio", "rl.ppo_epsilon")
# One independent mask per sequence for the old and the new policy, four updates per batch, the
# `8b` preset's gradient clip; rl.lr is --noisy_lr.
NOISY = {"rl.num_samples": 1, "rl.coupling": "independent", "rl.updates_per_batch": 4,
         "optim.grad_clip": 0.2}
# --extra: more objectives (in every regime), more regimes (noisy plus a change, every objective),
# and the ε sweep (StableDRL in the noisy regime; its ε = 5 run is the noisy stabledrl row).
EXTRA_OBJECTIVES = ("stabledrl_spg", "wd1")
EXTRA_REGIMES = {"noclip": ("noisy_noclip", {"optim.grad_clip": 1e9}),
                 "dual": ("noisy_dual", {"sampler.cache": "dual", "sampler.threshold": 0.9})}
EPS_SWEEP = {"stabledrl_eps100": {"rl.epsilon": 100.0}, "stabledrl_eps1000": {"rl.epsilon": 1000.0},
             "stabledrl_max_ratio5": {"rl.max_ratio": 5.0}}
EXTRAS = (*EXTRA_OBJECTIVES, *EXTRA_REGIMES, "eps_sweep")
EXPLOSION_FACTOR = 10.0
EDGE_STEPS = 10  # reward over the first and the last this many RL steps


# ----------------------------------------------------------------------------- per-run figures


def as_float(v: Any) -> float:
  """A metrics value as a float: metrics.jsonl writes non-finite numbers as null (before: "nan")."""
  return math.nan if v is None else float(v)


def finite(values) -> list[float]:
  return [v for v in values if math.isfinite(v)]


def running_medians(norms: list[float]) -> list[float]:
  """Entry i: the median of the finite, positive values among norms[:i + 1]; nan while there is
  none (a step whose groups all have zero advantage has a zero gradient, not a small one)."""
  out, seen = [], []
  for n in norms:
    if math.isfinite(n) and n > 0:
      seen.append(n)
    out.append(statistics.median(seen) if seen else math.nan)
  return out


def explosions(norm_max: list[float], norm_mean: list[float],
               factor: float = EXPLOSION_FACTOR) -> list[bool]:
  """Per RL step: the largest pre-clip gradient norm over its μ updates (`norm_max`) is non-finite
  or above `factor` x the running median (`running_medians`) of the per-step norms (`norm_mean`,
  the mean over the μ updates) up to and including that step."""
  return [not math.isfinite(m) or (math.isfinite(med) and m > factor * med)
          for m, med in zip(norm_max, running_medians(norm_mean))]


def diff_std(values: list[float]) -> float:
  """The (population) standard deviation of the changes between consecutive finite values; nan
  with fewer than two values."""
  v = finite(values)
  if len(v) < 2:
    return math.nan
  return statistics.pstdev(b - a for a, b in zip(v, v[1:]))


def held_out_curve(evals: list[dict], first_rl_step: int) -> list[tuple[int, float]]:
  """(RL steps done, held-out mean reward) for every evaluation of the RL stage, in order: "before RL"
  is 0, "after N RL steps" N, "after RL" the run's length."""
  points = []
  for e in evals:
    if e["tag"] == "before RL":
      points.append((0, as_float(e["mean_reward"])))
    elif e["tag"].startswith("after") and e["tag"] != "after SFT" and e["step"] >= first_rl_step:
      points.append((e["step"] - first_rl_step + 1, as_float(e["mean_reward"])))
  return sorted(points)


def summarise_rows(rows: list[dict], evals: list[dict]) -> dict[str, Any]:
  """A run's figures from its metrics.jsonl and eval.jsonl records (`rows` may hold SFT rows)."""
  rl = [r for r in rows if r.get("stage") == "rl"]
  mean = [as_float(r["grad_norm"]) for r in rl]
  top = [as_float(r.get("grad_norm_max", r["grad_norm"])) for r in rl]
  reward = [as_float(r["reward_mean"]) for r in rl]
  first = rl[0]["step"] if rl else 0
  acc = held_out_curve(evals, first)
  tags = {e["tag"]: as_float(e["mean_reward"]) for e in evals}
  events = collections.Counter(name for r in rl for name in r.get("events", []))
  return {
      "steps": len(rl),
      "finished": "after RL" in tags,
      "explosion_rate": sum(explosions(top, mean)) / len(rl) if rl else math.nan,
      "norm_mean": statistics.fmean(finite(mean)) if finite(mean) else math.nan,
      "norm_median": statistics.median(finite(mean)) if finite(mean) else math.nan,
      "norm_max": max(finite(top), default=math.nan),
      "nonfinite": sum(not math.isfinite(n) for n in top),
      "reward_smoothness": diff_std(reward),
      "held_out_smoothness": diff_std([a for _, a in acc]),
      "collapses": sum(n for name, n in events.items() if name.endswith("_collapse")),
      "kl_alarms": events.get("kl_alarm", 0),
      "events": dict(events),
      "before": tags.get("before RL", math.nan),
      "after": tags.get("after RL", math.nan),
      "solved_before": next((as_float(e["accuracy"]) for e in evals
                             if e["tag"] == "before RL" and "accuracy" in e), math.nan),
      "solved_after": next((as_float(e["accuracy"]) for e in evals
                            if e["tag"] == "after RL" and "accuracy" in e), math.nan),
      "reward_first": statistics.fmean(reward[:EDGE_STEPS]) if reward else math.nan,
      "reward_last": statistics.fmean(reward[-EDGE_STEPS:]) if reward else math.nan,
      "held_out_curve": acc,
      "norm_curve": [(r["step"] - first + 1, n) for r, n in zip(rl, top)],
  }


def started_from(rows: list[dict], evals: list[dict], sft_steps: int) -> str | None:
  """Why an RL run did not start from the SFT stage's last checkpoint (None if it did): its
  metrics must hold RL rows only, the first at step `sft_steps`, and a "before RL" evaluation."""
  if any(r.get("stage") != "rl" for r in rows):
    return "it ran SFT steps of its own"
  if not rows:
    return "no RL step recorded"
  if rows[0]["step"] != sft_steps:
    return f"its first RL step is {rows[0]['step']}, not the SFT run's end {sft_steps}"
  if not any(e["tag"] == "before RL" and e["step"] == sft_steps for e in evals):
    return f"no 'before RL' evaluation at step {sft_steps}"
  return None


def spread(values: list[float]) -> tuple[float, float]:
  """(mean, max - min) of the finite values; (nan, nan) when there are none."""
  v = finite(values)
  return (statistics.fmean(v), max(v) - min(v)) if v else (math.nan, math.nan)


def mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float, bool]]:
  """(x, mean of the finite y over the curves with a point at x, whether some y was non-finite)."""
  at = collections.defaultdict(list)
  for curve in curves:
    for x, y in curve:
      at[x].append(y)
  return [(x, statistics.fmean(finite(ys)) if finite(ys) else math.nan,
           len(finite(ys)) < len(ys)) for x, ys in sorted(at.items())]


# ----------------------------------------------------------------------------- plan


class Run(NamedTuple):
  regime: str
  variant: str      # the table's row: the objective, or StableDRL with an ε setting
  seed: int
  overrides: dict   # config key -> value: the regime's, then the variant's


def flags_of(overrides: dict) -> list[str]:
  return [f"--config.{k}={v}" for k, v in overrides.items()]


def regimes(published: dict, noisy_lr: float, names: list[str], extras: list[str],
            family: str, custom: list[str] = (), lrs: list[float] = ()) -> dict[str, dict]:
  """The regimes to run, by name: config overrides on top of the tiny default. `custom`: more
  regimes as `NAME:key=value,key=value` (noisy plus those config keys); `lrs`: the noisy regime
  at each rate, named `noisy_lr<rate>` (the learning-rate frontier)."""
  defined = {"published": dict(published), "noisy": {**NOISY, "rl.lr": noisy_lr}}
  for n in names:
    if n not in defined:
      raise ValueError(f"--regimes: unknown {n!r}; expected some of {list(defined)}")
  out = {n: defined[n] for n in names}
  for extra, (name, change) in EXTRA_REGIMES.items():
    if extra in extras:
      if extra == "dual" and family != "llada":
        raise ValueError("--extra=dual: cached rollouts are LLaDA's (--config=configs/llada.py)")
      out[name] = {**defined["noisy"], **change}
  for lr in lrs:
    out[f"noisy_lr{lr:g}"] = {**defined["noisy"], "rl.lr": lr}
  for text in custom:
    name, _, body = text.partition(":")
    pairs = [p.partition("=") for p in body.split(",") if p]
    if not name or name in out or not pairs or any(not k or not eq for k, eq, _ in pairs):
      raise ValueError(f"--regime={text!r}: expected a new NAME:key=value[,key=value...] "
                       f"(config keys, e.g. noisy_mu2:rl.updates_per_batch=2)")
    out[name] = {**defined["noisy"], **{k: v for k, _, v in pairs}}
  return out


def plan(objectives: list[str], regime_overrides: dict[str, dict], extras: list[str],
         seeds: list[int]) -> list[Run]:
  """Every run, in table order: regime, then objective or ε setting, then seed."""
  for e in extras:
    if e not in EXTRAS:
      raise ValueError(f"--extra: unknown {e!r}; expected some of {list(EXTRAS)}")
  objectives = [*objectives, *(o for o in EXTRA_OBJECTIVES if o in extras and o not in objectives)]
  runs = []
  for regime, overrides in regime_overrides.items():
    variants = {o: {"rl.objective": o} for o in objectives}
    if "eps_sweep" in extras and regime == "noisy":
      variants.setdefault("stabledrl", {"rl.objective": "stabledrl"})  # its ε = 5 point
      variants.update({k: {"rl.objective": "stabledrl", **v} for k, v in EPS_SWEEP.items()})
    runs += [Run(regime, v, s, {**overrides, **o}) for v, o in variants.items() for s in seeds]
  if "eps_sweep" in extras and "noisy" not in regime_overrides:
    raise ValueError("--extra=eps_sweep runs in the noisy regime: add noisy to --regimes")
  return runs


def published_settings(config: str) -> tuple[dict, str]:
  """The PUBLISHED_KEYS of `config`'s `8b` preset, and the config's family."""
  path = config_lib.resolve_config_arg(config.partition(":")[0])
  spec = importlib.util.spec_from_file_location("objectives_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("8b")
  return {k: c[k.split(".")[0]][k.split(".")[1]] for k in PUBLISHED_KEYS}, c.family


# ----------------------------------------------------------------------------- output

COLUMNS = (  # (summary key, header, format)
    ("explosion_rate", "explosion rate", ".3f"), ("norm_mean", "mean ‖g‖", ".3g"),
    ("norm_median", "median ‖g‖", ".3g"), ("norm_max", "max ‖g‖", ".3g"),
    ("nonfinite", "non-finite steps", ".3g"), ("reward_smoothness", "σ Δreward", ".3f"),
    ("held_out_smoothness", "σ Δheld-out", ".3f"), ("collapses", "collapse events", ".3g"),
    ("kl_alarms", "KL alarms", ".3g"), ("before", "mean reward before RL", ".3f"),
    ("after", "mean reward after RL", ".3f"), ("solved_after", "accuracy after RL", ".3f"),
    ("reward_first", "reward first 10", ".3f"),
    ("reward_last", "reward last 10", ".3f"))


def table(results: dict[tuple[str, str], list[dict]], planned: int) -> str:
  """Markdown: one row per (regime, objective), each figure as mean (max - min) over the seeds'
  runs (`planned` per row; those with RL steps count, finished or not)."""
  head = ["regime", "objective", "runs", *(h for _, h, _ in COLUMNS), "events (sum over seeds)"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for (regime, variant), summaries in results.items():
    done = sum(s["finished"] for s in summaries)
    runs = f"{done}/{planned}" + (f" + {len(summaries) - done} unfinished"
                                  if done < len(summaries) else "")
    cells = []
    for key, _, fmt in COLUMNS:
      m, d = spread([as_float(s[key]) for s in summaries])
      cells.append(f"{m:{fmt}} ({d:{fmt}})" if summaries else "—")
    events = collections.Counter()
    for s in summaries:
      events.update(s["events"])
    named = ", ".join(f"{k} {n}" for k, n in sorted(events.items())) or "none"
    lines.append(f"| {regime} | {LABELS.get(variant, variant)} | {runs} | "
                 + " | ".join(cells) + f" | {named} |")
  return "\n".join(lines)


def held_out_table(results: dict[tuple[str, str], list[dict]]) -> str:
  """Markdown: held-out mean reward (mean over seeds) at every evaluation, one column per row of
  `table`."""
  keys = [k for k, v in results.items() if v]
  curves = {k: dict((x, y) for x, y, _ in mean_curve([s["held_out_curve"] for s in results[k]]))
            for k in keys}
  steps = sorted({x for c in curves.values() for x in c})
  head = ["RL step", *(f"{r} {LABELS.get(v, v)}" for r, v in keys)]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for x in steps:
    lines.append(f"| {x} | " + " | ".join(f"{curves[k][x]:.3f}" if x in curves[k] else ""
                                          for k in keys) + " |")
  return "\n".join(lines)


def plot(results: dict[tuple[str, str], list[dict]], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = list(dict.fromkeys(r for r, _ in results))
  fig, axes = plt.subplots(len(names), 2, figsize=(12, 3.5 * len(names)), squeeze=False)
  for row, regime in enumerate(names):
    norm_ax, acc_ax = axes[row]
    for (r, variant), summaries in results.items():
      if r != regime or not summaries:
        continue
      label = LABELS.get(variant, variant)
      norms = mean_curve([s["norm_curve"] for s in summaries])
      line, = norm_ax.plot([x for x, _, _ in norms],
                           [y if y > 0 else math.nan for _, y, _ in norms], "-", lw=1, label=label)
      bad = [x for x, _, b in norms if b]  # a non-finite norm in some seed: a cross at the top
      if bad:
        top = max(finite(y for _, y, _ in norms) + [1.0])
        norm_ax.plot(bad, [top * 10] * len(bad), "x", color=line.get_color(), ms=6)
      acc = mean_curve([s["held_out_curve"] for s in summaries])
      acc_ax.plot([x for x, _, _ in acc], [y for _, y, _ in acc], "o-", ms=3, lw=1,
                  color=line.get_color(), label=label)
    norm_ax.set(yscale="log", xlabel="RL step",
                title=f"{regime}: gradient norm (max over μ updates, mean over seeds)")
    acc_ax.set(xlabel="RL step", title=f"{regime}: held-out mean reward (mean over seeds)")
    if norm_ax.get_legend_handles_labels()[0]:
      norm_ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


# ----------------------------------------------------------------------------- the lr frontier


def frontier_cells(results: dict[tuple[str, str], list[dict]], lrs: list[float]
                   ) -> dict[tuple[str, float], dict[str, Any]]:
  """(objective, lr) -> the figures of the `noisy_lr<lr>` regime's finished runs: per seed the
  held-out accuracy (exactly sorted) and mean reward after RL; whether each improved on its own
  accuracy before RL, and whether it collapsed (held-out mean reward after RL below half its value
  before RL); the explosion rate, mean over seeds."""
  cells = {}
  for (regime, variant), summaries in results.items():
    lr = next((x for x in lrs if regime == f"noisy_lr{x:g}"), None)
    done = [s for s in summaries if s["finished"]]
    if lr is None or not done:
      continue
    cells[(variant, lr)] = {
        "seeds": [s["seed"] for s in done],
        "accuracy": [s["solved_after"] for s in done],
        "reward": [s["after"] for s in done],
        "improved": sum(s["solved_after"] > s["solved_before"] for s in done),
        "collapsed": sum(s["after"] < 0.5 * s["before"] for s in done),
        "explosion_rate": statistics.fmean(s["explosion_rate"] for s in done),
        "accuracy_before": statistics.fmean(s["solved_before"] for s in done),
        "reward_before": statistics.fmean(s["before"] for s in done)}
  return cells


def largest_improving_lr(cells: dict[tuple[str, float], dict[str, Any]], objective: str,
                         seeds: int) -> float | None:
  """The largest lr at which `objective` ran all `seeds` seeds and improved on every one."""
  return max((lr for (o, lr), c in cells.items()
              if o == objective and len(c["seeds"]) == seeds and c["improved"] == seeds),
             default=None)


def frontier_record(cells, seeds: int, args: argparse.Namespace) -> dict[str, Any]:
  """`--frontier_record`: the frontier table in the docs/results format."""
  from scarce_demos import commit, machine  # noqa: PLC0415

  def ms(values):
    m, d = spread(values)
    return f"{m:.3f} ({d:.3f})"
  rows = [[LABELS.get(o, o), f"{lr:g}",
           ", ".join(f"{s}: {a:.3f}" for s, a in zip(c["seeds"], c["accuracy"])),
           ms(c["accuracy"]), ms(c["reward"]), f"{c['improved']}/{len(c['seeds'])}",
           f"{c['collapsed']}/{len(c['seeds'])}", f"{c['explosion_rate']:.3f}"]
          for (o, lr), c in cells.items()]
  objectives = list(dict.fromkeys(o for o, _ in cells))

  def best_of(o):
    if not any(oo == o and len(c["seeds"]) == seeds for (oo, _), c in cells.items()):
      return f"no rate run on all {seeds} seeds"
    return largest_improving_lr(cells, o, seeds) or "none"
  best = "; ".join(f"{LABELS.get(o, o)}: {best_of(o)}" for o in objectives)
  before = next(iter(cells.values()), {})
  return {"title": f"The learning-rate frontier: {args.rl_steps} RL steps from each seed's SFT "
                   "checkpoint",
          "columns": ["objective", "lr", "held-out accuracy after RL, per seed",
                      "accuracy: mean (max − min)", "mean reward: mean (max − min)",
                      "improved on its start", "collapsed", "explosion rate"],
          "align": "llllllll", "rows": rows,
          "command": shlex.join(["bench/objectives.py", *sys.argv[1:]]),
          "commit": commit(), "machine": machine(),
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "notes": f"held-out before RL (mean over seeds): accuracy "
                   f"{before.get('accuracy_before', math.nan):.3f}, mean reward "
                   f"{before.get('reward_before', math.nan):.3f}; improved: accuracy after RL "
                   "above the run's own before RL; collapsed: mean reward after RL below half "
                   "its value before RL; explosion rate: as in the objectives table. Largest lr "
                   f"improving on every one of {seeds} seeds: {best}"}


def plot_frontier(cells, path: str) -> None:
  """Held-out accuracy and mean reward after RL against lr (log), one colour per objective, each
  seed a point (objectives side by side around each lr), the mean over seeds joined by a line, and
  the start (mean over seeds) dashed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  objectives = list(dict.fromkeys(o for o, _ in cells))
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  for ax, key, title in ((axes[0], "accuracy", "held-out accuracy (exactly sorted) after RL"),
                         (axes[1], "reward", "held-out mean reward after RL")):
    for i, o in enumerate(objectives):
      lrs = sorted(lr for (oo, lr) in cells if oo == o)
      nudge = 1.0 + 0.06 * (i - (len(objectives) - 1) / 2)
      line, = ax.plot([lr * nudge for lr in lrs],
                      [statistics.fmean(cells[(o, lr)][key]) for lr in lrs], "-", lw=1,
                      label=LABELS.get(o, o))
      for lr in lrs:
        ys = cells[(o, lr)][key]
        ax.plot([lr * nudge] * len(ys), ys, "o", ms=4, color=line.get_color(), alpha=0.7)
    start = statistics.fmean(c[f"{key}_before"] for c in cells.values())
    ax.axhline(start, ls="--", color="grey", lw=1, label="before RL")
    ax.set(xscale="log", xlabel="RL learning rate", title=title, ylim=(-0.03, 1.03))
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


# ----------------------------------------------------------------------------- orchestration


def workdir_of(root: str, run: Run) -> str:
  return os.path.join(root, run.regime, f"{run.variant}_seed{run.seed}")


def copy_checkpoints(sft: str, workdir: str) -> None:
  """The SFT stage's checkpoints into `workdir` (whole or not at all)."""
  dst = os.path.join(workdir, "checkpoints")
  if os.path.isdir(dst):
    return
  os.makedirs(workdir, exist_ok=True)
  shutil.rmtree(dst + ".tmp", ignore_errors=True)
  shutil.copytree(os.path.join(sft, "checkpoints"), dst + ".tmp")
  os.replace(dst + ".tmp", dst)


def collect(runs: list[Run], root: str, sfts: dict[int, str]
            ) -> tuple[dict[tuple[str, str], list[dict]], list[str]]:
  """The summaries of the runs with RL steps, by (regime, objective), and the runs that did not
  start RL from their seed's SFT checkpoint."""
  results: dict[tuple[str, str], list[dict]] = {}
  problems = []
  for run in runs:
    workdir = workdir_of(root, run)
    rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    evals = read_jsonl(os.path.join(workdir, "eval.jsonl"))
    results.setdefault((run.regime, run.variant), [])
    if not any(r.get("stage") == "rl" for r in rows):
      continue
    sft = metrics.sft_end(sfts[run.seed])
    why = "no SFT run recorded" if sft is None else started_from(rows, evals, sft)
    if why:
      problems.append(f"{workdir} did not start RL from {sfts[run.seed]}'s checkpoint: {why}")
    results[(run.regime, run.variant)].append({**summarise_rows(rows, evals), "seed": run.seed})
  return results, problems


def seed_record(results, settings: dict[str, dict], args: argparse.Namespace) -> dict[str, Any]:
  """`--record`: every (regime, objective) with its seeds side by side (docs/results/ format,
  `bench/report.py` renders it): held-out mean reward after RL, the lowest held-out evaluation
  during RL, and the steps above EXPLOSION_FACTOR x the running median of ‖g‖."""
  from scarce_demos import commit, machine  # noqa: PLC0415  (bench/scarce_demos.py imports this)

  def per_seed(runs, value):
    return ", ".join(f"{r['seed']}: {value(r)}" for r in runs)
  rows = [[regime, LABELS.get(variant, variant),
           per_seed(runs, lambda r: "stopped" if math.isnan(r["after"]) else f"{r['after']:.3f}"),
           per_seed(runs, lambda r: f"{min(a for _, a in r['held_out_curve']):.3f}"),
           per_seed(runs, lambda r: round(r["explosion_rate"] * r["steps"]))]
          for (regime, variant), runs in results.items() if runs]
  regimes = "; ".join(f"`{r}`: `{' '.join(flags_of(o))}`" for r, o in settings.items())
  return {"title": f"{args.rl_steps} RL steps from each seed's SFT checkpoint, per seed",
          "columns": ["regime", "objective", "held-out mean reward after RL",
                      "lowest held-out during RL", f"steps above {EXPLOSION_FACTOR:g}x the "
                      "running median ‖g‖"],
          "align": "lllll", "rows": rows, "command": shlex.join(["bench/objectives.py",
                                                                 *sys.argv[1:]]),
          "commit": commit(), "machine": machine(),
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "notes": f"regimes: {regimes}"}


def report(results, problems: list[str], settings: dict[str, dict], extras: list[str],
           args: argparse.Namespace, planned: int) -> str:
  """ROOT/objectives.md: the date and command, the regimes, `table` and `held_out_table`."""
  name = os.path.splitext(os.path.basename(args.config.partition(":")[0]))[0]
  lines = [f"# Objectives over long RL runs ({name})", "",
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `{shlex.join(sys.orig_argv)}`",
           "", f"{args.rl_steps} RL steps from the SFT checkpoint of each seed ({args.seeds}); "
           f"every run: `{shlex.join([f'--config={args.config}', *args.extra_flags])}`", "",
           "Regimes (config overrides of the tiny default):"]
  lines += [f"- `{r}`: `{' '.join(flags_of(o))}`" for r, o in settings.items()]
  if "eps_sweep" in extras:
    sweep = ", ".join(f"{k}: `{flags_of(v)[0]}`" for k, v in EPS_SWEEP.items())
    lines.append(f"- ε sweep, noisy regime: {sweep}; the noisy StableDRL row is ε = 5")
  lines += ["", f"Each figure: mean over seeds (max − min). Explosion: the largest pre-clip ‖g‖ of "
            f"an RL step's μ updates is non-finite or > {EXPLOSION_FACTOR:g}x the running median "
            "of the per-step ‖g‖ (mean over the μ updates; zero norms left out); ‖g‖ figures over "
            "the finite norms; σ Δ: standard deviation of the step-to-step changes of the mean "
            "training reward and of the held-out mean reward curve.", "", table(results, planned),
            "", "Held-out mean reward at each evaluation (mean over seeds):", "",
            held_out_table(results)]
  lines += ["", *(f"**{p}**" for p in problems)] if problems else []
  return "\n".join(lines) + "\n"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/sdar.py")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--objectives", default=",".join(OBJECTIVES))
  p.add_argument("--regimes", default="published,noisy")
  p.add_argument("--extra", default="", help=f"comma-separated, some of {','.join(EXTRAS)}")
  p.add_argument("--noisy_lr", type=float, default=1e-4, help="rl.lr of the noisy regimes")
  p.add_argument("--lrs", default="", help="comma-separated rates: the noisy regime at each")
  p.add_argument("--regime", action="append", default=[],
                 help="NAME:key=value,...: a regime of the noisy one plus those config keys")
  p.add_argument("--rl_steps", type=int, default=300)
  p.add_argument("--root", default=None, help="default runs/objectives_<config name>")
  p.add_argument("--parallel", type=int, default=1)
  p.add_argument("--table_only", action="store_true", help="only read the runs there are")
  p.add_argument("--record", default="", help="also write the per-seed table here "
                 "(docs/results/NAME.json)")
  p.add_argument("--frontier_record", default="", help="with --lrs: also write the frontier "
                 "table here (docs/results/NAME.json) and its figure beside it (NAME.png)")
  p.add_argument("extra_flags", nargs="*", help="more flags for main, after --")
  args = p.parse_args()
  name = os.path.splitext(os.path.basename(args.config.partition(":")[0]))[0]
  root = os.path.abspath(args.root or os.path.join("runs", f"objectives_{name}"))
  seeds = [int(s) for s in args.seeds.split(",")]
  extras = [e for e in args.extra.split(",") if e]
  for flag in args.extra_flags:
    if flag.split("=")[0] in ("--config.rl.steps", "--config.seed"):
      sys.exit(f"error: {flag} after --: give --rl_steps / --seeds (the SFT runs set rl.steps=0)")
  published, family = published_settings(args.config)
  try:
    for o in args.objectives.split(","):
      if o not in LABELS:
        raise ValueError(f"--objectives: unknown {o!r}; expected some of {list(LABELS)}")
    lrs = [float(x) for x in args.lrs.split(",") if x]
    if args.frontier_record and not lrs:
      raise ValueError("--frontier_record: give the rates with --lrs")
    settings = regimes(published, args.noisy_lr, [r for r in args.regimes.split(",") if r], extras,
                       family, args.regime, lrs)
    runs = plan(args.objectives.split(","), settings, extras, seeds)
  except ValueError as e:
    sys.exit(f"error: {e}")

  common = [sys.executable, "-m", "stabledrl_jax.main", f"--config={args.config}"]
  sfts = {s: os.path.join(root, f"sft_seed{s}") for s in seeds}
  if not args.table_only:
    run_all([(sfts[s], [*common, f"--workdir={sfts[s]}", f"--config.seed={s}",
                        "--config.rl.steps=0", *args.extra_flags])
             for s in seeds if not finished(sfts[s], "after SFT")], args.parallel)
    jobs = []
    for run in runs:
      workdir = workdir_of(root, run)
      if finished(workdir, "after RL"):
        continue
      copy_checkpoints(sfts[run.seed], workdir)
      jobs.append((workdir, [*common, f"--workdir={workdir}", f"--config.seed={run.seed}",
                             f"--config.rl.steps={args.rl_steps}", *flags_of(run.overrides),
                             *args.extra_flags]))
    run_all(jobs, args.parallel)

  results, problems = collect(runs, root, sfts)
  text = report(results, problems, settings, extras, args, len(seeds))
  print("\n" + text)
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, "objectives.md"), "w") as f:
    f.write(text)
  if args.record:
    with open(args.record, "w") as f:
      json.dump(seed_record(results, settings, args), f, indent=1)
      f.write("\n")
  if args.frontier_record:
    cells = frontier_cells(results, lrs)
    with open(args.frontier_record, "w") as f:
      json.dump(frontier_record(cells, len(seeds), args), f, indent=1)
      f.write("\n")
    plot_frontier(cells, os.path.splitext(args.frontier_record)[0] + ".png")
  png = os.path.join(root, "objectives.png")
  plot(results, png)
  print(f"table: {os.path.join(root, 'objectives.md')}\nplots: {png}")
  if problems:
    sys.exit("\n".join(problems))


if __name__ == "__main__":
  main()
