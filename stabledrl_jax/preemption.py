"""Preemption: SIGTERM or SIGINT asks a training run to save at the next step boundary and stop.

Cloud TPU maintenance events and preemptible/spot VMs send SIGTERM before they take a VM away,
SLURM does before a time limit (with `--signal`) or on `scancel`, and Ctrl-C sends SIGINT. The
signal may reach one process of a multi-process run or all of them: each process only notes it,
and at every step boundary the processes agree, with one tiny all-reduce of that note, whether
any of them was signalled, so all of them save the same step and stop together (docs/preemption.md).

JAX's own preemption service (`multihost_utils.reached_preemption_sync_point`) reacts to SIGTERM
alone and only in multi-process runs; one agreement here covers both signals and one process.
"""
from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Listener:
  """While entered, SIGTERM and SIGINT are noted instead of ending the process (in the main
  thread; elsewhere signals keep their handlers). `agreed()` is the step boundary's question."""

  def __init__(self):
    self.signalled: str | None = None
    self._previous: dict[int, object] = {}

  def __enter__(self) -> Listener:
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._note) for s in SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _note(self, signum, frame) -> None:
    self.signalled = self.signalled or signal.Signals(signum).name

  def agreed(self) -> bool:
    """Whether any process of the run has been signalled; every process must call this at the
    same step boundary (in a multi-process run it is a collective) and gets the same answer."""
    noted = self.signalled is not None
    if jax.process_count() == 1:
      return noted
    return bool(np.any(multihost_utils.process_allgather(np.int32(noted))))
