"""Tasks: prompts, answer extraction, graders, data (docs/method.md, "Tasks and rewards").

task = get_task("countdown")
reward = task.reward_fn({"correctness": 1.0, "format": 0.1})
reward(completion, {"numbers": [3, 5, 7], "target": 22})

A task defined outside the package is named by its import path, `get_task("my_pkg.my_tasks:TASK")`
(a `Task`, see `base.Task`); `jsonl` is the generic task over the user's JSONL files (`jsonl.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from stabledrl_jax.tasks import countdown, gsm8k, jsonl, math500, sorting, sudoku
from stabledrl_jax.tasks.base import Example, RewardFn, Task, weighted_reward

TASKS: dict[str, Task] = {
    task.name: task for task in (countdown.TASK, sorting.TASK, sudoku.TASK, gsm8k.TASK,
                             math500.TASK)
}


def get_task(name: str) -> Task:
  """A built-in task by name, or a `Task` from an import path `package.module:NAME`."""
  if ":" in name:
    task = jsonl.load_object(name, "config.task.name")
    if not isinstance(task, Task):
      raise ValueError(f"config.task.name={name!r}: {type(task).__name__} is not a "
                       "stabledrl_jax.tasks.Task")
    return task
  try:
    return TASKS[name]
  except KeyError:
    raise KeyError(f"unknown task {name!r}; available: {sorted(TASKS)}, 'jsonl' or an import "
                   "path 'package.module:NAME'") from None


def from_config(task_config: Any) -> Task:
  """The task of a run's `config.task` (the `jsonl` task is built from its fields there; Sudoku
  with `task.sft_unfilled` > 0 demonstrates with blanks left empty)."""
  if task_config.name == "jsonl":
    return jsonl.make_task(task_config.prompt_field, task_config.answer_field, task_config.checker)
  task = get_task(task_config.name)
  if task_config.name == "sudoku" and task_config.sft_unfilled:
    return dataclasses.replace(task, demonstrate=functools.partial(
        sudoku.unfilled_demonstration, unfilled=task_config.sft_unfilled))
  return task


__all__ = ["Example", "RewardFn", "TASKS", "Task", "from_config", "get_task", "weighted_reward"]
