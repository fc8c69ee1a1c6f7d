"""`get_config(workdir)`: the resolved config a training run recorded in WORKDIR/config.json.

`evaluate`, `generate` and `export` read it for `--from_workdir=W` / `--workdir=W`, so that
`--config.sampler.steps=...` style overrides apply to it as to any config file.
"""
import ml_collections

from stabledrl_jax import run_record


def get_config(workdir: str) -> ml_collections.ConfigDict:
  record = run_record.read(workdir)
  if record is None:
    raise FileNotFoundError(f"no {run_record.CONFIG_FILE} in {workdir} (not a training run's "
                            "workdir, or one from before runs recorded their config)")
  c = ml_collections.ConfigDict(record)
  c.lock()
  return c
