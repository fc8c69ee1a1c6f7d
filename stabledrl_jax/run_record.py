"""WORKDIR/config.json: the resolved config of a run, written before its first step.

A rerun in the same workdir is compared with it key by key. Every change is printed with its old
and new value; a change the saved state cannot follow (model shapes, family, task, tokenizer,
seed, group size, ...) stops the run with that one-line list before anything is loaded. Safe
changes (more RL steps, evaluation, logging, checkpointing, detectors, controls, the mesh, the
rollouts' fast decoding) resume
and are appended to WORKDIR/config_changes.jsonl.
"""
from __future__ import annotations

import json
from typing import Any

from stabledrl_jax import storage

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"
# Keys (or sections, ending in ".") a resumed run can take from the new config.
RESUMABLE = ("rl.steps", "eval.", "log_every", "checkpoint.", "stability.", "controls.", "mesh.",
             "rollout_mesh.", "task.data_dir", "task.source_dir", "model.remat", "sampler.cache",
             "sampler.threshold", "optim.offload_state")


# Keys that moved: (old section, old key) -> (new section, new key), per family.
MOVED = {"sdar": {("model", "block_size"): ("sampler", "block_length")}}


class ConfigChangeError(ValueError):
  """A rerun whose config cannot resume the saved run."""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"a": {"b": 1}} -> {"a.b": 1}."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
  """(key, old, new) for every flattened key that differs, sorted; a missing side is None."""
  a, b = flatten(old), flatten(new)
  return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def resumable(key: str) -> bool:
  return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE)


def describe(diff: list[tuple[str, Any, Any]]) -> str:
  return ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diff)


def read(workdir: str | storage.Path) -> dict[str, Any] | None:
  path = storage.path(workdir) / CONFIG_FILE
  if not path.exists():
    return None
  return json.loads(path.read_text())


def upgrade(record: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
  """A recorded config in today's schema: moved keys under their new names (`MOVED`), keys that
  `schema` (a whole config of today) does not have dropped."""
  out = {key: dict(value) if isinstance(value, dict) else value for key, value in record.items()}
  for (section, key), (new_section, new_key) in MOVED.get(record.get("family"), {}).items():
    if key in out.get(section, {}):
      out.setdefault(new_section, {})[new_key] = out[section].pop(key)
  for section, value in list(out.items()):
    if section not in schema:
      del out[section]
    elif isinstance(value, dict) and isinstance(schema[section], dict):
      out[section] = {k: v for k, v in value.items() if k in schema[section]}
  return out


def write(workdir: str | storage.Path, config: dict[str, Any]) -> None:
  """Atomic: a killed write leaves the previous config.json."""
  workdir = storage.path(workdir)
  storage.makedirs(workdir)
  storage.write_atomic(workdir / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True))


def check(config: dict[str, Any], workdir: str | storage.Path, *, has_checkpoint: bool,
          main_process: bool = True, defaults: dict[str, Any] | None = None) -> list[str]:
  """Compare `config` with the workdir's record and record it; returns the lines to print.

  Raises `ConfigChangeError` (one line listing the non-resumable changes) when the workdir holds
  a checkpoint the new config cannot resume; nothing is written then. A key the record lacks
  whose new value is its value in `defaults` (a key added since the run started, at its default)
  is a change that resumes.
  """
  old = read(workdir)
  if old is not None:
    old = upgrade(old, config)
  diff = changes(old, config) if old is not None else []
  added = flatten(defaults or {})
  if diff and has_checkpoint:
    refused = [d for d in diff if not resumable(d[0])
               and not (d[1] is None and d[0] in added and added[d[0]] == d[2])]
    if refused:
      raise ConfigChangeError(
          f"{storage.path(workdir) / CONFIG_FILE}: cannot resume with changed {describe(refused)} "
          "(use a new --workdir, or undo these overrides)")
  lines = [f"config changed since the last run: {k}: {a!r} -> {b!r}" for k, a, b in diff]
  if main_process:
    if diff:
      storage.append_text(storage.path(workdir) / CHANGES_FILE,
                          json.dumps({"changes": [[k, a, b] for k, a, b in diff]}) + "\n")
    if diff or old is None:
      write(workdir, config)
  return lines


def has_checkpoint(workdir: str | storage.Path) -> bool:
  """Whether the run saved a step (Orbax names each step's directory by its number)."""
  path = storage.path(workdir) / "checkpoints"
  return path.is_dir() and any(p.name.isdigit() for p in path.iterdir())
