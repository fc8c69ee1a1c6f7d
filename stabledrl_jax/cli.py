"""What `evaluate`, `generate` and `export` share: flag parsing with one-line errors, the choice of
policy (a Hugging Face checkpoint through `--config`, or a training run's saved step through its
workdir) and loading it onto the devices.

    --config=configs/llada.py:8b --config.model.checkpoint=/path/to/LLaDA-8B-Instruct
    --from_workdir=runs/llada_8b [--step=N]      # the run's recorded config and its latest step
"""
from __future__ import annotations

import os
import sys
from typing import Callable

from absl import app, flags, logging

from stabledrl_jax import build, checkpointing, config_lib, distributed

_WORKDIR_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workdir_config.py")


class PolicyError(ValueError):
  """A policy that cannot be loaded: names the directory, step or key."""


def define_policy_flags(workdir_flag: str = "from_workdir") -> None:
  """--config (optional with a workdir), --<workdir_flag>, --step and the multi-process flags."""
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/llada.py:8b with "
                                  "--config.model.checkpoint=DIR (default: the workdir's record).",
                                  lock_config=True)
  flags.DEFINE_string(workdir_flag, None, "A training run's workdir: its config.json and a step.")
  flags.DEFINE_integer("step", None, "The workdir's step to load (default: the latest).")
  flags.DEFINE_bool("distributed", False, "Join a multi-process run (as `main --distributed`).")
  flags.DEFINE_string("coordinator_address", None, "Multi-process: HOST:PORT of process 0.")
  flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
  flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing, with a one-line error for a bad flag or an unknown config key."""
  try:
    return flags.FLAGS(config_lib.resolve_config_flags(argv))
  except flags.Error as e:
    sys.exit(f"error: {e}")
  except (AttributeError, KeyError) as e:  # ml_collections: an override of a key that is not there
    missing = str(e).strip("'\"")
    named = [a.split("=")[0] for a in argv[1:]
             if a.startswith("--config.") and missing in a.split("=")[0].split(".")]
    sys.exit(f"error: unknown config key {named[0][2:] if named else missing}: the config has no "
             f"key {missing!r} there")


def start(main: Callable[[list[str]], None], workdir_flag: str = "from_workdir") -> None:
  """`app.run(main)`; without --config, `--<workdir_flag>=W` makes W/config.json the config."""
  argv = list(sys.argv)
  has_config = any(a == "--config" or a.startswith("--config=") for a in argv[1:])
  workdir = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith(f"--{workdir_flag}=")), None)
  if not has_config and workdir:
    argv.insert(1, f"--config={_WORKDIR_CONFIG}:{workdir}")
  app.run(main, argv=argv, flags_parser=parse_flags)


def setup(argv: list[str], workdir_flag: str = "from_workdir"):
  """Checks the arguments, quiets library logging, joins a multi-process run; returns
  (config, workdir or None)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  if not f["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if f.config is None:
    sys.exit(f"error: give --config=FILE[:preset] (with --config.model.checkpoint=DIR) or "
             f"--{workdir_flag}=DIR")
  multi = (f.coordinator_address, f.num_processes, f.process_id)
  if f.distributed:
    try:
      distributed.initialize(*multi)
    except ValueError as e:
      sys.exit(f"error: {e}")
  return f.config, f[workdir_flag].value


def load_policy(c, workdir: str | None = None, step: int | None = None):
  """(model, tokenizer, step): the config's checkpoint (or random init), then with a workdir
  the parameters of its step `step` (default the latest). Raises `PolicyError`."""
  try:
    config_lib.validate(c)
    mesh = build.mesh(c)
    tokenizer = build.tokenizer(c)
    model = build.model(c, tokenizer, mesh)
  except AttributeError as e:  # a config (e.g. a hand-edited config.json) without a key
    raise PolicyError(f"the config has no key {str(e).strip(chr(39) + chr(34))!r}") from e
  except (KeyError, OSError, ValueError) as e:
    raise PolicyError(str(e).strip("'\"")) from e
  if workdir is None:
    return model, tokenizer, None
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise PolicyError(f"no checkpoints in {workdir}")
  ckpt = checkpointing.Checkpointer(directory)
  try:
    steps = ckpt.all_steps()
    if not steps or (step is not None and step not in steps):
      raise PolicyError(f"--step={step}: {directory} holds steps {sorted(steps)}")
    step = max(steps) if step is None else step
    ckpt.restore_model(step, model)
  finally:
    ckpt.close()
  return model, tokenizer, step


def fail(message: str) -> None:
  sys.exit(f"error: {message}")
