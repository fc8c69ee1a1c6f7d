"""Adversarial model output: every grader answers fast, in range, and executes nothing."""

import time

import pytest

from stabledrl_jax.tasks import get_task, math500

EXAMPLES = {
    "countdown": {"numbers": [3, 5, 7], "target": 22},
    "sudoku": {"puzzle": "3102200002100320", "solution": "3142243142131324"},
    "gsm8k": {"question": "q", "answer": "22"},
    "math500": {"question": "q", "answer": "22"},
}


def _payloads(marker):
  code = f"__import__('os').system('touch {marker}')"
  return {
      "nested_parens": "<answer>" + "(" * 5000 + "3 + 5" + ")" * 5000 + "</answer>",
      "nested_boxes": "<answer>" + "\\boxed{" * 3000 + "22" + "}" * 3000 + "</answer>",
      "tower_power": "<answer>9**9**9</answer>",
      "tower_power_latex": "<answer>\\boxed{9^{9^{9^{9}}}}</answer>",
      "factorial_tower": "<answer>\\boxed{(10^{10^{10}})!}</answer>",
      "huge_number": "<answer>" + "9" * 100_000 + "</answer>",
      "huge_product": "<answer>" + " * ".join(["99999999999"] * 200) + "</answer>",
      "division_by_zero": "<answer>3 * 5 + 7 / 0</answer>",
      "python_code": f"<answer>{code}</answer>",
      "python_code_boxed": f"<answer>\\boxed{{{code}}}</answer>",
      "python_lambda": "<answer>(lambda: 3 + 5 * 7)()</answer>",
      "megabytes": "<reasoning>" + "blah 1 + 2 " * 500_000 + "</reasoning><answer>22</answer>",
      "many_tags": "<answer>1</answer>" * 100_000,
      "unclosed": "<answer>" + "\\boxed{" + "1" * 1_000_000,
      "binary_junk": "".join(chr(i % 0x2FF + 1) for i in range(200_000)),
  }


@pytest.mark.parametrize("task_name", sorted(EXAMPLES))
def test_adversarial_outputs_are_graded_fast_and_in_range(task_name, tmp_path):
  task = get_task(task_name)
  example = EXAMPLES[task_name]
  # Pathological answers must count as wrong within the checker's limit, not hang.
  checker = math500.MathChecker(timeout_s=0.5)
  marker = tmp_path / "executed"
  try:
    for name, completion in _payloads(marker).items():
      if task_name == "math500":
        checker.ensure_started()  # worker start-up (importing sympy) is not grading
      start = time.perf_counter()
      if task_name == "math500":
        value = float(math500.is_correct(completion, example, checker=checker))
      else:
        value = task.reward(completion, example)
        task.is_correct(completion, example)
      elapsed = time.perf_counter() - start
      # math500 may spend its 0.5 s checker limit, plus killing the worker.
      budget = 0.9 if task_name == "math500" else 0.5
      assert elapsed < budget, (name, elapsed)
      assert 0.0 <= value <= 1.0, (name, value)
      assert not marker.exists(), name
  finally:
    checker.close()


def test_math_checker_time_limit_holds_from_a_thread():
  import threading

  checker = math500.MathChecker(timeout_s=0.5)
  results = []
  try:
    thread = threading.Thread(
        target=lambda: results.append(checker.equivalent("9^{9^{9^{9}}}", "1"))
    )
    start = time.perf_counter()
    thread.start()
    thread.join(timeout=60)
    assert results == [False] and time.perf_counter() - start < 60
    assert checker.timeouts == 1
    # The worker is restarted and keeps answering.
    assert checker.equivalent("\\frac{1}{2}", "0.5")
  finally:
    checker.close()
