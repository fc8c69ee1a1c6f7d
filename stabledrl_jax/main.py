"""Entry point: `python -m stabledrl_jax.main --config=configs/sdar.py [--workdir=DIR]`.

Rerunning the same command with the same workdir resumes from its latest checkpoint.

On several hosts, run the same command on every one with `--distributed` (`launch/` has the
scripts): on Cloud TPU and under SLURM that is all; elsewhere add `--coordinator_address=HOST:PORT
--num_processes=N --process_id=I` (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).
"""
import os
import sys

from absl import app, flags

from stabledrl_jax import cli, storage, train

cli.define_flags("configs/sdar.py", "Training config file (configs/NAME.py[:PRESET]: the "
                 "project's own, from any directory).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: ./runs/<config>_<preset>).")


def main(argv):
  c, workdir = cli.setup(argv, "workdir")
  if workdir is None:
    config_arg = flags.FLAGS["config"].config_filename
    name = os.path.splitext(os.path.basename(config_arg.split(":")[0]))[0]
    preset = config_arg.split(":")[1] if ":" in config_arg else "tiny"
    workdir = os.path.join("runs", f"{name}_{preset}")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    cli.fail(f"--workdir={workdir}: a file, not a directory")
  cli.log_to(workdir, create=True)  # library log lines and a fault's traceback: WORKDIR/debug.log
  try:
    train.run(c, workdir)
  except train.SetupError as e:
    sys.exit(f"error: {e}")
  except Exception as e:  # a bucket that disappeared mid-run: said so, in one line
    storage.raise_if_bucket_lost(workdir, e)
    raise


if __name__ == "__main__":
  app.run(cli.one_line_faults(main), flags_parser=cli.parse_flags)
