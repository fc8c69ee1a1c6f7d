"""`get_config(workdir)`: the resolved config a training run recorded in WORKDIR/config.json.

`evaluate`, `generate` and `export` read it for `--from_workdir=W` / `--workdir=W`, so that
`--config.sampler.steps=...` style overrides apply to it as to any config file. Keys added to
the package since the run recorded its config take their defaults (`config_lib.base_config`);
keys moved or removed since are upgraded (`run_record.upgrade`).
"""
from typing import Any

import ml_collections

from stabledrl_jax import config_lib, run_record


def _with_new_keys(defaults: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
  """`record` plus the top-level keys and section keys of `defaults` that it lacks. Values are
  taken whole: a recorded map (e.g. `task.reward_weights`) gains no default entries."""
  out = {key: dict(value) if isinstance(value, dict) else value for key, value in record.items()}
  for key, value in defaults.items():
    if key not in out:
      out[key] = value
    elif isinstance(value, dict) and isinstance(out[key], dict):
      out[key] = {**value, **out[key]}
  return out


def get_config(workdir: str) -> ml_collections.ConfigDict:
  record = run_record.read(workdir)
  if record is None:
    raise FileNotFoundError(f"no {run_record.CONFIG_FILE} in {workdir} (not a training run's "
                            "workdir, or one from before runs recorded their config)")
  family = record.get("family")
  if family in config_lib.FAMILIES:
    defaults = config_lib.base_config(family).to_dict()
    record = _with_new_keys(defaults, run_record.upgrade(record, defaults))
  c = ml_collections.ConfigDict(record)
  c.lock()
  return c
