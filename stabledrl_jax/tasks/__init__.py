"""Tasks of the paper (SPEC §7): prompts, answer extraction, graders, data.

task = get_task("countdown")
reward = task.reward_fn({"correctness": 1.0, "format": 0.1})
reward(completion, {"numbers": [3, 5, 7], "target": 22})
"""

from __future__ import annotations

from stabledrl_jax.tasks import countdown, gsm8k, math500, sudoku
from stabledrl_jax.tasks.base import Example, RewardFn, Task, weighted_reward

TASKS: dict[str, Task] = {
    task.name: task for task in (countdown.TASK, sudoku.TASK, gsm8k.TASK, math500.TASK)
}


def get_task(name: str) -> Task:
  try:
    return TASKS[name]
  except KeyError:
    raise KeyError(f"unknown task {name!r}; available: {sorted(TASKS)}") from None


__all__ = ["Example", "RewardFn", "TASKS", "Task", "get_task", "weighted_reward"]
