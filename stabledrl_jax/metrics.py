"""Run logging: `metrics.jsonl` (one JSON object per step), TensorBoard events, a console progress
line, and a PNG of the curves at the end. Only process 0 writes.

The files are written by a background thread, so encoding, appending and TensorBoard's event
writing stay off the training loop's critical path; `flush()` waits for them. In a bucket
(`storage`) the JSONL files are rewritten whole once the thread has caught up with the queue.
"""
from __future__ import annotations

import json
import math
import queue
import sys
import threading
import time
from typing import Any, NamedTuple

import jax

from stabledrl_jax import storage


class StepResult(NamedTuple):
  """What a training step reports: the metrics record (floats), and for throughput the tokens it
  processed and its analytic FLOPs per phase (`flops`)."""
  record: dict[str, Any]
  tokens: int
  flops: dict[str, float]


def throughput(step_flops: dict[str, float], tokens: int, wall: float,
               peak: float | None = None) -> dict[str, float]:
  """The step's wall time (`step_s`), tokens/s (in all and per device), the analytic FLOPs of each
  phase (`flops_<phase>`), the achieved TFLOP/s per device over the step's wall time, and MFU
  against the device's bf16 `peak` FLOP/s where it is known (`flops.peak_flops`; not on CPU)."""
  n = jax.device_count()
  total = sum(step_flops.values())
  out = {"step_s": wall, "tokens_per_s": tokens / wall,
         "tokens_per_s_per_device": tokens / wall / n,
         **{f"flops_{k}": v for k, v in step_flops.items()},
         "tflops_per_s_per_device": total / wall / n / 1e12}
  if peak:
    out["mfu"] = total / wall / n / peak
  return out


def _clean(v: Any) -> Any:
  if hasattr(v, "item"):
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return None  # JSON has no nan/inf: null, never a string
  return v


def number(v: Any, spec: str = ".3f") -> str:
  """A recorded figure for the console: `nan` for a null (a non-finite value) or a non-number."""
  return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "nan"


def read_jsonl(path: str | storage.Path) -> list[dict[str, Any]]:
  path = storage.path(path)
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sft_end(workdir: str | storage.Path) -> int | None:
  """The run's first RL step (where its SFT stage ended: `sft.steps`, or earlier with
  `sft.stop_at_accuracy`), from its metrics.jsonl; None without a record."""
  rows = read_jsonl(storage.path(workdir) / "metrics.jsonl")
  if not rows:
    return None
  return 1 + max((r["step"] for r in rows if r.get("stage") == "sft"), default=-1)


def truncated_jsonl(path: storage.Path, last_step: int) -> str:
  """The file's records up to `last_step` (a resumed run rewrites the later ones exactly)."""
  return "".join(json.dumps(r) + "\n" for r in read_jsonl(path) if r["step"] <= last_step)


class MetricsWriter:
  """Appends step records to WORKDIR/metrics.jsonl and WORKDIR/tb; prints progress lines.

  `write` only queues the record; a background thread writes it. A write that failed there (disk
  full, a record JSON cannot hold) is raised by the next `write` or `flush`.
  """

  def __init__(self, workdir: str | storage.Path, *, total_steps: int, resume_step: int | None,
               stage_ends: dict[str, int] | None = None):
    """`stage_ends`: each stage's end (the step after its last), for the console's ETA of the
    stage in progress (default: one stage of `total_steps`)."""
    self.active = jax.process_index() == 0
    workdir = storage.path(workdir)
    self.path = workdir / "metrics.jsonl"
    self.eval_path = workdir / "eval.jsonl"
    self.total = total_steps
    self.stage_ends = stage_ends or {}
    self._first: tuple[str, int, float] | None = None  # (stage, step, when): the ETA's origin
    self._tb = None
    self._thread = None
    self._error: BaseException | None = None
    if not self.active:
      return
    self._files = {p: storage.Appender(p, "" if resume_step is None else truncated_jsonl(p, resume_step))
                   for p in (self.path, self.eval_path)}
    from tensorboardX import SummaryWriter
    # TensorBoard hides the events of steps >= purge_step written before: those a resumed run
    # repeats (a fresh start: all of an earlier attempt's), as metrics.jsonl is cut. The suffix
    # keeps a restart within the same second from overwriting the file (named by the second).
    self._tb = SummaryWriter(str(workdir / "tb"),
                             purge_step=0 if resume_step is None else resume_step + 1,
                             filename_suffix=f".{time.time_ns()}")
    self._queue: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._drain, name="metrics-writer", daemon=True)
    self._thread.start()

  def write(self, step: int, record: dict[str, Any], *, eval_record: bool = False) -> None:
    if not self.active:
      return
    self._raise_if_failed()
    self._queue.put((step, dict(record), eval_record))

  def flush(self) -> None:
    """Wait until every queued record is on disk."""
    if self._thread is not None:
      self._queue.join()
    self._raise_if_failed()

  def _raise_if_failed(self) -> None:
    if self._error is not None:
      raise RuntimeError(f"writing metrics to {self.path} failed: {self._error!r}") from self._error

  def _drain(self) -> None:
    while True:
      item = self._queue.get()
      try:
        if item is not None and self._error is None:
          self._write_now(*item)
        if item is None or self._queue.empty():  # caught up: a bucket's files are rewritten
          self._sync()
      except Exception as e:  # surfaced by the next write() / flush()
        self._error = e
      finally:
        self._queue.task_done()
      if item is None:
        return

  def _sync(self) -> None:
    if self._error is None:
      for f in self._files.values():
        f.sync()

  def _write_now(self, step: int, record: dict[str, Any], eval_record: bool) -> None:
    record = {"step": step, **{k: _clean(v) for k, v in record.items()}}
    line = json.dumps(record) + "\n"
    self._files[self.eval_path if eval_record else self.path].append(line)
    prefix = "eval/" if eval_record else ""
    for k, v in record.items():
      if k != "step" and isinstance(v, (int, float)):
        self._tb.add_scalar(prefix + k, v, step)

  def stage_span(self, stage: str) -> tuple[int, int]:
    """[start, end) of `stage`'s steps: it ends at its `stage_ends` entry and starts at the end of
    the stage before it in `stage_ends`' order (one stage of `total` without `stage_ends`)."""
    names = list(self.stage_ends)
    if stage not in names:
      return 0, self.total
    i = names.index(stage)
    return (self.stage_ends[names[i - 1]] if i else 0), self.stage_ends[stage]

  def progress(self, step: int, stage: str, record: dict[str, Any]) -> None:
    """The console line of `step`: `[stage] done/of the stage (step N)`, and the stage's ETA: its
    steps left at its own rate since the first step this process logged in it, which is left
    out (it compiles); a stage's own rate, as RL steps cost far more than SFT steps."""
    now = time.time()
    if self._first is None or self._first[0] != stage:
      self._first = (stage, step, now)
    if not self.active:
      return
    start, end = self.stage_span(stage)
    _, first, t_first = self._first
    eta = "after the next step"  # the first step's time is mostly compilation
    if step > first:
      left = (now - t_first) / (step - first) * (end - step - 1)
      eta = f"{int(left // 60)}m{int(left % 60):02d}s"
    parts = [f"[{stage}] {step - start + 1}/{end - start} (step {step})",
             f"loss {record['loss']:.4f}"]
    if "reward_mean" in record:
      parts.append(f"reward {record['reward_mean']:.3f}")
    parts += [f"grad {record['grad_norm']:.3g}"]
    if "clip_fraction" in record:
      parts.append(f"clip {record['clip_fraction']:.2f}")
    parts += [f"{record['tokens_per_s']:.0f} tok/s", f"ETA {stage} {eta}"]
    if record.get("events"):
      parts.append("EVENT " + ", ".join(record["events"]))
    print(" | ".join(parts), flush=True)

  def close(self) -> None:
    """Write what is queued and stop the thread (warns, rather than raises, on a failed write:
    `close` runs in `finally` blocks and must not hide the exception in flight)."""
    if self._thread is not None:
      self._queue.put(None)
      self._thread.join()
      self._thread = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._error is not None:
      print(f"warning: writing metrics to {self.path} failed: {self._error!r}", file=sys.stderr,
            flush=True)


def curve_panels(rows: list[dict], evals: list[dict]) -> list[tuple[str, list]]:
  """(title, [(step, value)]) per panel of curves.png: each stage's loss on its own panel (the
  SFT loss is ~100x the RL loss), RL reward, gradient norm over both stages, held-out mean reward.
  A panel without data (e.g. SFT with sft.steps=0) is left out."""
  def points(key, stage=None):
    return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))
            and (stage is None or r.get("stage") == stage)]
  panels = [("SFT loss", points("loss", "sft")), ("RL loss", points("loss", "rl")),
            ("RL reward", points("reward_mean", "rl")), ("gradient norm", points("grad_norm")),
            ("held-out mean reward", [(e["step"], e["mean_reward"]) for e in evals
                                      if isinstance(e.get("mean_reward"), (int, float))])]
  return [(title, pts) for title, pts in panels if pts]


def plot_curves(workdir: str | storage.Path) -> str | None:
  """WORKDIR/curves.png: `curve_panels`, the SFT stage shaded on the panels that span it (the RL
  panels keep their own steps)."""
  workdir = storage.path(workdir)
  rows = read_jsonl(workdir / "metrics.jsonl")
  evals = read_jsonl(workdir / "eval.jsonl")
  if not rows or jax.process_index() != 0:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = curve_panels(rows, evals)
  sft_steps = [r["step"] for r in rows if r.get("stage") == "sft"]
  fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
  for ax, (title, pts) in zip(axes[0], panels):
    ax.plot(*zip(*pts), "o-" if title.startswith("held-out") else "-", lw=1)
    if sft_steps and min(x for x, _ in pts) <= max(sft_steps):
      ax.axvspan(min(sft_steps), max(sft_steps) + 1, color="0.9", label="SFT")
      ax.legend(loc="best", fontsize="small")
    ax.set_title(title)
    ax.set_xlabel("step")
  fig.tight_layout()
  path = workdir / "curves.png"
  with path.open("wb") as f:
    fig.savefig(f, dpi=80, format="png")
  plt.close(fig)
  return str(path)
