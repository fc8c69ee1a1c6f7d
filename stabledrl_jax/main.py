"""Entry point: `python -m stabledrl_jax.main --config=configs/sdar.py [--workdir=DIR]`.

Rerunning the same command with the same workdir resumes from its latest checkpoint.
"""
import os

from absl import app, flags
from ml_collections import config_flags

from stabledrl_jax import train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/sdar.py", "Training config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: ./runs/<config>).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config_arg = flags.FLAGS["config"].config_filename
  name = os.path.splitext(os.path.basename(config_arg.split(":")[0]))[0]
  preset = config_arg.split(":")[1] if ":" in config_arg else "tiny"
  workdir = _WORKDIR.value or os.path.join("runs", f"{name}_{preset}")
  train.run(_CONFIG.value, workdir)


if __name__ == "__main__":
  app.run(main)
