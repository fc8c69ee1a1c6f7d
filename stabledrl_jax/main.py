"""Entry point: `python -m stabledrl_jax.main --config=configs/sdar.py [--workdir=DIR]`.

Rerunning the same command with the same workdir resumes from its latest checkpoint.

On several hosts, run the same command on every one with `--distributed` (`launch/` has the
scripts): on Cloud TPU and under SLURM that is all; elsewhere add `--coordinator_address=HOST:PORT
--num_processes=N --process_id=I` (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).
"""
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from stabledrl_jax import config_lib, distributed, train
from stabledrl_jax.cli import parse_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", config_lib.resolve_config_arg("configs/sdar.py"),
    "Training config file (configs/NAME.py[:PRESET]: the package's own, from any directory).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: ./runs/<config>).")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Join a multi-process run "
                                 "(jax.distributed.initialize; detected on Cloud TPU and SLURM).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "Multi-process: HOST:PORT of "
                                   "process 0's coordinator.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout", 100, "Multi-process: seconds without a "
                                  "heartbeat after which a process counts as dead and the run stops.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config_arg = flags.FLAGS["config"].config_filename
  name = os.path.splitext(os.path.basename(config_arg.split(":")[0]))[0]
  preset = config_arg.split(":")[1] if ":" in config_arg else "tiny"
  workdir = _WORKDIR.value or os.path.join("runs", f"{name}_{preset}")
  if not flags.FLAGS["verbosity"].present:  # library INFO chatter (Orbax, TFDS) off the console
    logging.set_verbosity(logging.WARNING)
  multi = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if any(v is not None for v in multi) and not _DISTRIBUTED.value:
    sys.exit("error: --coordinator_address/--num_processes/--process_id need --distributed")
  if _DISTRIBUTED.value:
    try:
      distributed.initialize(*multi, heartbeat_timeout_s=_HEARTBEAT.value)
    except ValueError as e:
      sys.exit(f"error: {e}")
  try:
    train.run(_CONFIG.value, workdir)
  except train.SetupError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
