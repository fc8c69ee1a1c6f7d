"""Joining a multi-process (multi-host) run, and the console output of one.

Every process of a run executes the same program on its own devices (JAX's multi-controller
model): `initialize` connects them through a coordinator, after which `jax.devices()` lists the
devices of all processes and one mesh spans them. On Cloud TPU and under SLURM the coordinator,
process count and process id are detected; elsewhere they are given (flags of `main`, the
environment variables `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, or the
`launch/` scripts). If a process dies, the coordinator notices its missing heartbeats and stops
the others with an error within `heartbeat_timeout_s` instead of leaving them hanging in a
collective.
"""
from __future__ import annotations

import os

import jax


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_s: int = 100) -> None:
  """`jax.distributed.initialize`, with CPU collectives over gloo (for runs of several local
  processes; TPU and GPU use their own interconnects). Arguments left None come from the
  environment (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), else from the
  cluster (Cloud TPU, SLURM). Call before any other JAX call."""
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  num_processes = _env_int("JAX_NUM_PROCESSES") if num_processes is None else num_processes
  process_id = _env_int("JAX_PROCESS_ID") if process_id is None else process_id
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
           "process_id": process_id}
  if (num_processes is not None or process_id is not None) and None in given.values():
    missing = [k for k, v in given.items() if v is None]
    raise ValueError(f"multi-process flags: {', '.join(missing)} missing (give all three of "
                     "coordinator_address, num_processes, process_id, or let Cloud TPU/SLURM "
                     "supply them)")
  if num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id} is not in [0, num_processes={num_processes})")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX's preemption service would take SIGTERM for itself: every command would then ignore it.
  # Training handles SIGTERM and SIGINT in `preemption`; the other commands stop on them.
  jax.config.update("jax_enable_preemption_service", False)
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             heartbeat_timeout_seconds=heartbeat_timeout_s)


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def is_main() -> bool:
  """Whether this is process 0, the one that prints and writes the metrics files."""
  return jax.process_index() == 0


def log(message: str) -> None:
  """Print `message` (flushed) on process 0 only."""
  if is_main():
    print(message, flush=True)
