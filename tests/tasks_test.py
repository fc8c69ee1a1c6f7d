"""The task registry: every task gives prompts, rewards in range and a grader."""

import pytest

from stabledrl_jax.tasks import get_task
from stabledrl_jax.tasks.base import FORMAT_INSTRUCTION

EXAMPLES = {
    "countdown": ({"numbers": [3, 5, 7], "target": 22}, "<answer>3 * 5 + 7</answer>"),
    "sudoku": (
        {"puzzle": "3102200002100320", "solution": "3142243142131324"},
        "<answer>3142243142131324</answer>",
    ),
    "gsm8k": ({"question": "2 + 3?", "answer": "5"}, "<answer>5</answer>"),
    "math500": ({"question": "1/2?", "answer": "\\frac{1}{2}"}, "<answer>\\boxed{0.5}</answer>"),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_task_grades_and_prompts(name):
  task = get_task(name)
  example, good = EXAMPLES[name]
  assert task.name == name
  assert task.is_correct(good, example) and task.reward(good, example) == 1.0
  assert not task.is_correct("no answer", example) and task.reward("no answer", example) == 0.0
  assert task.prompt(example).endswith(FORMAT_INSTRUCTION)
  assert task.messages(example)[0]["role"] == "user"
  weights = {"correctness": 1.0, "format": 0.25}
  completion = "<reasoning>r</reasoning>" + good
  assert task.reward(completion, example, weights) == 1.25
  with pytest.raises(ValueError, match="style"):
    task.prompt(example, "fancy")


def test_unknown_task():
  with pytest.raises(KeyError, match="available"):
    get_task("chess")
