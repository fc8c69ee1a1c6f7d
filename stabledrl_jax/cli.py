"""What the commands share (`main`, `evaluate`, `generate`, `export`): the config and multi-process
flags, flag parsing with one-line errors, setup, and for the policy commands the choice of policy
(a Hugging Face checkpoint through `--config`, or a training run's saved step through its workdir)
and loading it onto the devices.

    --config=configs/llada.py:8b --config.model.checkpoint=/path/to/LLaDA-8B-Instruct
    --from_workdir=runs/llada_8b [--step=N]      # the run's recorded config and its latest step
"""
from __future__ import annotations

import contextlib
import errno
import logging as pylogging
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from stabledrl_jax import build, checkpointing, config_lib, distributed, run_record, storage
from stabledrl_jax.models.config import FAMILIES

_WORKDIR_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workdir_config.py")


class PolicyError(ValueError):
  """A policy that cannot be loaded: names the directory, step or key."""


def define_flags(config_default: str | None = None, config_help: str = "") -> None:
  """--config and the multi-process flags, for every command."""
  config_flags.DEFINE_config_file(
      "config", config_lib.resolve_config_arg(config_default) if config_default else None,
      config_help or "Config file, e.g. configs/llada.py:8b with --config.model.checkpoint=DIR "
      "(default: the workdir's record).", lock_config=True)
  flags.DEFINE_bool("distributed", False, "Join a multi-process run (jax.distributed.initialize; "
                    "detected on Cloud TPU and SLURM).")
  flags.DEFINE_string("coordinator_address", None, "Multi-process: HOST:PORT of process 0.")
  flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
  flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")
  flags.DEFINE_integer("heartbeat_timeout", 100, "Multi-process: seconds without a heartbeat "
                       "after which a process counts as dead and the run stops.")


def define_policy_flags(workdir_flag: str = "from_workdir") -> None:
  """`define_flags`, --<workdir_flag> (a training run whose config and step to load) and --step."""
  define_flags()
  flags.DEFINE_string(workdir_flag, None, "A training run's workdir: its config.json and a step.")
  flags.DEFINE_integer("step", None, "The workdir's step to load (default: the latest).")


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing, with a one-line error for a bad flag, a config file that is not there or
  fails to load (e.g. an unknown preset), or an unknown config key."""
  argv = config_lib.resolve_config_flags(argv)
  for arg in argv[1:]:
    if arg.startswith("--config="):
      path = arg.split("=", 1)[1].partition(":")[0]
      if not os.path.isfile(path):
        own = ", ".join(f"configs/{family}.py" for family in FAMILIES)
        sys.exit(f"error: {arg}: no such file (the project's own: {own})")
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    # A config file that raised: absl quotes its traceback; its last line is the cause.
    sys.exit(f"error: {lines[0]} {lines[-1]}" if len(lines) > 1 else f"error: {e}")
  except (AttributeError, KeyError) as e:  # ml_collections: an override of a key that is not there
    sys.exit(f"error: {unknown_key_message(argv, e)}")


def unknown_key_message(argv: list[str], error: Exception) -> str:
  """`unknown config key rl.lrr (did you mean rl.lr?)` for an override of a key the config lacks
  (ml_collections' message names the missing key first, then its suggestion, escaped)."""
  text = str(error.args[0] if error.args else error)
  words = re.findall(r"[A-Za-z_]\w*", text)
  missing = words[0] if words else text
  suggestion = re.search(r'Did you mean \W*"(\w+)\W*"', text)
  for arg in argv[1:]:
    name = arg.split("=")[0][len("--config."):] if arg.startswith("--config.") else ""
    parts = name.split(".")
    if missing in parts:
      prefix = "".join(f"{p}." for p in parts[:parts.index(missing)])
      hint = f" (did you mean {prefix}{suggestion.group(1)}?)" if suggestion else ""
      return f"unknown config key {name}{hint}"
  return f"unknown config key {missing}"


def start(main: Callable[[list[str]], None], workdir_flag: str = "from_workdir") -> None:
  """`app.run(main)` (`one_line_faults`); without --config, `--<workdir_flag>=W` makes
  W/config.json the config."""
  argv = list(sys.argv)
  has_config = any(a == "--config" or a.startswith("--config=") for a in argv[1:])
  workdir = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith(f"--{workdir_flag}=")), None)
  if not has_config and workdir:
    argv.insert(1, f"--config={_WORKDIR_CONFIG}:{workdir}")
  app.run(one_line_faults(main), argv=argv, flags_parser=parse_flags)


LOG_FILE = "debug.log"  # in the workdir: library log lines, and the traceback of a fault
log_dir: str | None = None  # the command's workdir, once known (`log_to`)


def log_to(workdir: str, create: bool = False) -> None:
  """Library log lines (Orbax's, TensorStore's errors from their threads, ...) and a fault's
  traceback go to `workdir`/debug.log, not the terminal (unless --verbosity or --logtostderr);
  `create`: make `workdir` (training's), else only an existing one is used."""
  global log_dir
  local = not storage.is_remote(workdir)  # a bucket's (gs://...): a local temporary file
  if local and create:
    with contextlib.suppress(OSError):
      os.makedirs(workdir, exist_ok=True)
  if local and not os.path.isdir(workdir):
    return
  log_dir = workdir if local else None
  f = flags.FLAGS
  if f["verbosity"].present or f["logtostderr"].value or f["alsologtostderr"].value:
    return
  try:
    stream = open(os.path.join(workdir, log_name()) if local else temporary_log(), "a")
  except OSError:
    return
  pylogging.raiseExceptions = False  # a full disk must not print logging's own tracebacks
  logging.get_absl_handler().python_handler.stream = stream

  def to_log(*args) -> None:  # what library threads and callbacks raise, e.g. TensorStore's
    with contextlib.suppress(Exception):
      info = args[0] if len(args) == 1 else None
      exc = (info.exc_type, info.exc_value, info.exc_traceback) if info else args[:3]
      stream.write("".join(traceback.format_exception(*exc)))
      stream.flush()

  sys.unraisablehook = sys.excepthook = threading.excepthook = to_log


def temporary_log() -> str:
  return os.path.join(tempfile.gettempdir(), f"stabledrl_jax-{os.getpid()}-{LOG_FILE}")


def log_name() -> str:
  index = jax.process_index() if jax.process_count() > 1 else 0
  return LOG_FILE if index == 0 else f"debug.process_{index}.log"


def one_line_faults(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
  """`main` with any fault as one line on stderr (`fault_line`) and its traceback appended to
  `log_dir`/debug.log (or a temporary file), where also goes what library threads print while
  the process ends (Orbax's closed event loops, ...). Ctrl-C says how to resume."""
  def run(argv: list[str]) -> None:
    try:
      main(argv)
    except (SystemExit, app.UsageError):
      raise
    except BaseException as e:  # KeyboardInterrupt too
      log = keep_traceback(traceback.format_exc())
      line = fault_line(e)
      sys.stderr.write(f"error: {line}" + (f" (traceback: {log})" if log else "") + "\n")
      sys.stderr.flush()
      if log:
        with contextlib.suppress(OSError):
          os.dup2(os.open(log, os.O_WRONLY | os.O_APPEND), 2)
      sys.exit(130 if isinstance(e, KeyboardInterrupt) else 1)
  return run


def keep_traceback(text: str) -> str | None:
  """`text` appended to `log_dir`/debug.log, else to a temporary file; its path, or None when
  neither can be written (e.g. a full disk)."""
  stamp = f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n"
  for path in (os.path.join(log_dir, log_name()) if log_dir else None, temporary_log()):
    if not path:
      continue
    try:
      with open(path, "a") as f:
        f.write(stamp + text)
      return path
    except OSError:
      continue
  return None


def fault_line(e: BaseException) -> str:
  """One line a user can act on: the disk full, a permission refused, a file that is not there
  (found anywhere in the exception's chain, as Orbax and TensorStore wrap them), an interrupt;
  else the exception's type and first line."""
  if isinstance(e, KeyboardInterrupt):
    return ("interrupted (Ctrl-C); rerun the same command to resume (training: from its last "
            "checkpoint)")
  chain, seen = [], e
  while seen is not None and len(chain) < 20:
    chain.append(seen)
    seen = seen.__cause__ or seen.__context__
  for err in chain:
    text = str(err)
    if (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left" in text:
      where = f" writing {err.filename}" if getattr(err, "filename", None) else ""
      return f"no space left on device{where}; free space and rerun the same command to resume"
    if isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
      return f"{error_text(err)} (check the workdir's permissions)"
  return error_text(e) if isinstance(e, OSError) else f"{type(e).__name__}: {error_text(e)}"


def setup(argv: list[str], workdir_flag: str = "from_workdir"):
  """Checks the arguments, quiets library logging, joins a multi-process run; returns
  (config, the value of --<workdir_flag>)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  if not f["verbosity"].present:  # library INFO chatter (Orbax, TFDS) off the console
    logging.set_verbosity(logging.WARNING)
  if f.config is None:
    sys.exit(f"error: give --config=FILE[:preset] (with --config.model.checkpoint=DIR) or "
             f"--{workdir_flag}=DIR")
  multi = (f.coordinator_address, f.num_processes, f.process_id)
  if any(v is not None for v in multi) and not f.distributed:
    sys.exit("error: --coordinator_address/--num_processes/--process_id need --distributed")
  if f.distributed:
    try:
      distributed.initialize(*multi, heartbeat_timeout_s=f.heartbeat_timeout)
    except ValueError as e:
      sys.exit(f"error: {e}")
  if f[workdir_flag].value:
    log_to(f[workdir_flag].value)
  return f.config, f[workdir_flag].value


def load_policy(c, workdir: str | None = None, step: int | None = None):
  """(model, tokenizer, step): the config's checkpoint (or random init), then with a workdir
  the parameters of its step `step` (default the latest that restores). Raises `PolicyError`."""
  if workdir is not None:
    check_family(c, workdir)
    if not run_record.has_checkpoint(workdir):
      raise PolicyError(f"{workdir} holds no checkpoint yet (not a training run's workdir, or one "
                        "stopped before its first save)")
  try:
    build.settings(c)  # every key checked, as training checks it
    mesh = build.mesh(c)
    tokenizer = build.tokenizer(c)
    model = build.model(c, tokenizer, mesh)
  except AttributeError as e:  # a config (e.g. a hand-edited config.json) without a key
    raise PolicyError(f"the config has no key {error_text(e)!r}") from e
  except (KeyError, OSError, ValueError) as e:
    raise PolicyError(error_text(e)) from e
  if workdir is None:
    return model, tokenizer, None
  directory = storage.path(workdir) / "checkpoints"
  ckpt = checkpointing.Checkpointer(directory)
  try:
    if step is None:  # the latest step that restores, said when it is not the latest
      step, _ = ckpt.restore_latest(lambda s: ckpt.restore_model(s, model), log=distributed.log)
    elif step not in ckpt.all_steps():
      raise PolicyError(f"--step={step}: {directory} holds steps {ckpt.all_steps()}")
    else:
      try:
        ckpt.restore_model(step, model)
      except Exception as e:  # a damaged step
        raise PolicyError(f"{directory}/{step}: cannot restore ({checkpointing.cause(e)})") from e
  except checkpointing.CheckpointError as e:
    raise PolicyError(str(e)) from e
  finally:
    ckpt.close()
  return model, tokenizer, step


def check_family(c, workdir: str) -> None:
  """A `--config` of another family than the run in `workdir` trained: one line naming both."""
  record = run_record.read(workdir)
  if record and record.get("family") not in (None, c.family):
    raise PolicyError(f"family mismatch: {workdir} trained a {record['family']} model; the config "
                      f"is {c.family} (leave out --config to use the run's own)")


def error_text(e: BaseException) -> str:
  """An exception's message as one line: a KeyError's quotes off (its `str` is the repr of its
  argument), an OSError's path whole and first, every other message as it is."""
  if isinstance(e, OSError) and e.strerror and e.filename:
    return f"{e.filename}: {e.strerror}"
  text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
  return str(text).splitlines()[0] if str(text) else repr(e)


def fail(message: str) -> None:
  sys.exit(f"error: {message}")
