"""MATH500: competition problems; equivalence of final answers through `math-verify`.

Example keys: `question`, `answer` (the gold final answer, LaTeX). Symbolic checking can take
unbounded time on pathological input (`9^{9^{9^9}}`, huge factorials), and math-verify's own
timeout uses SIGALRM, which only works in the main thread. So every check runs in a separate
worker process with a hard wall-clock limit: on timeout the worker is killed (and restarted
lazily) and the answer counts as wrong. Safe from any thread of a training step.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

from stabledrl_jax.tasks import base, extract

# Real answers check in ~7 ms (at most 0.25 s over LLaDA's 1,500 MATH500 outputs); a second
# is ample for an honest answer and bounds what a pathological one costs a training step.
DEFAULT_TIMEOUT_S = 1.0
STARTUP_TIMEOUT_S = 120.0
MAX_ANSWER_CHARS = 1000


def _worker_main() -> None:
  """The worker: one JSON request per stdin line, one JSON bool per stdout line."""
  from math_verify import LatexExtractionConfig, parse, verify

  # LaTeX extraction only: the plain-expression extractor goes through sympy.parse_expr,
  # which evaluates Python; model output must never reach it.
  configs = [LatexExtractionConfig(boxed_match_priority=0)]
  print(json.dumps("ready"), flush=True)
  for line in sys.stdin:
    predicted, gold = json.loads(line)
    try:
      # The parent enforces the time limit (by killing this process), so math-verify's
      # own signal-based timeouts are off.
      gold_parsed = parse(f"${gold}$", extraction_config=configs, parsing_timeout=None)
      pred_parsed = parse(f"${predicted}$", extraction_config=configs, parsing_timeout=None)
      ok = (
          bool(gold_parsed)
          and bool(pred_parsed)
          and verify(gold_parsed, pred_parsed, timeout_seconds=None)
      )
    except Exception:  # math-verify raising on odd input means "not equivalent"
      ok = False
    print(json.dumps(bool(ok)), flush=True)


class MathChecker:
  """Answer equivalence in a worker process with a hard per-answer time limit; thread-safe.

  The worker is a plain subprocess (`python -m stabledrl_jax.tasks.math500`) speaking JSON
  lines: no fork of a process running JAX threads, no pickles, no re-import of `__main__`.
  """

  def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
    self.timeout_s = timeout_s
    self.timeouts = 0  # answers given up on; a diagnostic for the metrics
    self._lock = threading.Lock()
    self._process: subprocess.Popen | None = None

  def _start(self) -> None:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    self._process = subprocess.Popen(
        [sys.executable, "-m", "stabledrl_jax.tasks.math500"],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    # Start-up (importing sympy) is not the answer's fault: it gets its own, generous limit.
    if self._read_line(STARTUP_TIMEOUT_S) != "ready":
      self._kill()
      raise RuntimeError(
          "math-verify worker failed to start; run "
          "`python -m stabledrl_jax.tasks.math500` to see why"
      )

  def _read_line(self, timeout_s: float) -> object:
    assert self._process is not None and self._process.stdout is not None
    ready, _, _ = select.select([self._process.stdout], [], [], timeout_s)
    if not ready:
      return None
    line = self._process.stdout.readline()
    return json.loads(line) if line else None

  def _kill(self) -> None:
    if self._process is not None:
      self._process.kill()
      self._process.wait()
      for stream in (self._process.stdin, self._process.stdout):
        if stream is not None:
          stream.close()
    self._process = None

  def close(self) -> None:
    with self._lock:
      self._kill()

  def ensure_started(self) -> None:
    """Starts the worker now (it otherwise starts on first use, or after a timeout)."""
    with self._lock:
      self._ensure_started()

  def _ensure_started(self) -> None:
    if self._process is None or self._process.poll() is not None:
      self._kill()
      self._start()

  def equivalent(self, predicted: str, gold: str) -> bool:
    """True when `predicted` and `gold` denote the same answer; False on timeout."""
    if len(predicted) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
      return False
    with self._lock:
      self._ensure_started()
      assert self._process is not None and self._process.stdin is not None
      try:
        self._process.stdin.write(json.dumps([predicted, gold]) + "\n")
        self._process.stdin.flush()
        result = self._read_line(self.timeout_s)
      except (BrokenPipeError, ValueError):
        result = None
      if isinstance(result, bool):
        return result
      self.timeouts += 1
      self._kill()
      return False


_default_checker: MathChecker | None = None
_default_lock = threading.Lock()


def default_checker() -> MathChecker:
  global _default_checker
  with _default_lock:
    if _default_checker is None:
      _default_checker = MathChecker()
      atexit.register(_default_checker.close)
    return _default_checker


def extract_answer(completion: str) -> str | None:
  """The final answer span: `\\boxed{}` in the last `<answer>` tag, the tag, or the last box."""
  span = extract.final_answer_text(extract.until_end_of_turn(completion))
  return span.strip().strip("$").strip() if span else None


def is_correct(completion: str, example: base.Example, checker: MathChecker | None = None) -> bool:
  predicted = extract_answer(completion)
  if not predicted:
    return False
  gold = str(example["answer"]).strip()
  if predicted == gold:
    return True
  return (checker or default_checker()).equivalent(predicted, gold)


def correctness(completion: str, example: base.Example) -> float:
  return 1.0 if is_correct(completion, example) else 0.0


def question(example: base.Example) -> str:
  return f"{example['question']}\nWrite the final answer as \\boxed{{...}}."


def compact_question(example: base.Example) -> str:
  return f"{example['question']}\n"


def reference_completion(example: base.Example) -> str:
  return f"<answer>\\boxed{{{example['answer']}}}</answer>"


def from_record(record: dict) -> dict:
  """A MATH500 jsonl record `{"problem", "answer", ...}` -> an example dict."""
  return {"question": str(record["problem"]), "answer": str(record["answer"])}


TASK = base.Task.of_module("math500", sys.modules[__name__])


if __name__ == "__main__":
  _worker_main()
