"""Orbax checkpoints of a training run: model, optimiser, and a JSON record of everything else.

The model's part is its trainable parameters (`lora.trainable`): every parameter, or with LoRA
the adapters alone (the frozen base is rebuilt from `model.checkpoint` or the seed on resume, as
`build.model` builds it); the optimiser's state then holds the adapters' moments alone too.

Saves are asynchronous and atomic (Orbax writes a temporary directory and renames it when the
save is complete), so a run killed at any moment leaves its last finished checkpoint intact. The
JSON part holds the stage, the data-iterator states, the RNG seed and counters. Restoring reads
into the shardings of the model and optimiser it is given, so a run can resume on another mesh.
A step that cannot be restored is named with its cause in one line and, unless told not to,
set aside for the previous step (`restore_latest`); temporary folders a killed save left are
removed at start.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
from flax import nnx

from stabledrl_jax import lora, storage

T = TypeVar("T")


class CheckpointError(RuntimeError):
  """No step of a checkpoint directory could be restored (one line: the step and the cause)."""


def cause(e: BaseException) -> str:
  """An exception as one short line: TensorStore's messages end in spec dumps, and nest the
  cause last after `: `."""
  text = (str(e).splitlines() or [""])[0].split(" [tensorstore_spec")[0]
  if len(text) > 240:
    text = ": ".join(text.split(": ")[-2:])
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _params(model: nnx.Module) -> nnx.State:
  """What a checkpoint holds of `model`: its trainable parameters (`lora.trainable`)."""
  return nnx.state(model, lora.trainable(model))


def _abstract(tree):
  """Shape/dtype/sharding targets: Orbax restores straight into these shardings."""
  def leaf(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
  return jax.tree.map(leaf, tree)


class Checkpointer:
  """Keep-N asynchronous checkpoints under `directory`; one per saved step."""

  def __init__(self, directory: str | storage.Path, *, keep: int = 2, async_save: bool = True):
    self.directory = storage.path(directory)
    if jax.process_index() == 0:  # what killed saves left (Orbax's own cleanup runs late)
      for tmp in self.directory.glob("*.orbax-checkpoint-tmp*"):
        tmp.rmtree()
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("model", "optimizer", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def restore_latest(self, restore: Callable[[int], T], *, fallback: bool = True,
                     set_aside: bool = False, log: Callable[[str], None] = print
                     ) -> tuple[int, T] | None:
    """(step, `restore(step)`) of the latest step that restores; None without steps. A step that
    fails is named with its cause in one line; with `fallback` the previous step is tried (said
    so), with `set_aside` the failed step's folder is renamed `N.unreadable-<time>` (kept, and
    out of the way of the steps the resumed run saves). Raises `CheckpointError`."""
    steps = sorted(self.all_steps(), reverse=True)
    for i, step in enumerate(steps):
      try:
        return step, restore(step)
      except Exception as e:  # whatever Orbax or TensorStore raise for a damaged step
        failed = f"{self.directory}/{step}: cannot restore ({cause(e)})"
        if not fallback:
          raise CheckpointError(f"{failed}; set checkpoint.fallback=True to resume from the "
                                "previous step") from e
        if i == len(steps) - 1:
          raise CheckpointError(f"{failed}, and no earlier step is left") from e
        if set_aside and jax.process_index() == 0:
          aside = self.directory / f"{step}.unreadable-{int(time.time())}"
          (self.directory / str(step)).rename(aside)
          self._manager.reload()
          failed += f"; moved to {aside}"
        log(f"{failed}; falling back to step {steps[i + 1]}")
    return None

  def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer, meta: dict[str, Any]) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(nnx.to_pure_dict(_params(model))),
        optimizer=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(optimizer))),
        meta=ocp.args.JsonSave(meta)))

  def read_meta(self, step: int) -> dict[str, Any]:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, Any]:
    """Load step `step` into `model` and `optimizer` in place; returns the JSON record."""
    model_state = _params(model)
    opt_state = nnx.state(optimizer)
    out = self._manager.restore(step, args=ocp.args.Composite(
        model=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(model_state))),
        optimizer=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(opt_state))),
        meta=ocp.args.JsonRestore()))
    nnx.replace_by_pure_dict(model_state, out["model"])
    nnx.replace_by_pure_dict(opt_state, out["optimizer"])
    nnx.update(model, model_state)
    nnx.update(optimizer, opt_state)
    return out["meta"]

  def restore_model(self, step: int, model: nnx.Module) -> dict[str, Any]:
    """Load only the model parameters of step `step` (no optimiser needed); returns the record."""
    state = _params(model)
    out = self._manager.restore(step, args=ocp.args.Composite(
        model=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(state))),
        meta=ocp.args.JsonRestore()))
    nnx.replace_by_pure_dict(state, out["model"])
    nnx.update(model, state)
    return out["meta"]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def save_params(path: str | storage.Path, model: nnx.Module) -> None:
  """A one-off, atomic save of a model's trainable parameters (e.g. the frozen KL reference),
  replacing whatever `path` held."""
  with ocp.StandardCheckpointer() as saver:
    saver.save(storage.path(path), nnx.to_pure_dict(_params(model)), force=True)


def restore_params(path: str | storage.Path, model: nnx.Module) -> None:
  """Load parameters written by `save_params` into `model` in place, in its shardings."""
  state = _params(model)
  with ocp.StandardCheckpointer() as loader:
    loaded = loader.restore(storage.path(path), _abstract(nnx.to_pure_dict(state)))
  nnx.replace_by_pure_dict(state, loaded)
  nnx.update(model, state)
