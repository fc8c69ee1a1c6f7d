"""Tests for stabledrl_jax.sft: the SFT targets."""
import pytest

from stabledrl_jax import build, config_lib, sft
from stabledrl_jax.tasks import get_task, sudoku


def test_weaker_demonstrator_targets_depend_only_on_seed_step_and_global_row():
  c = config_lib.base_config("sdar")
  config_lib.apply_preset(c, "sudoku")
  s = sft.Settings.from_config(c)
  task = build.task(c)
  examples = [sudoku.generate(0, i, blanks=8) for i in range(8)]
  full = sft.targets(s, task, examples, 3, 0)
  # Two processes holding rows [0, 4) and [4, 8) build the same targets as one process.
  assert full == (sft.targets(s, task, examples[:4], 3, 0)
                  + sft.targets(s, task, examples[4:], 3, 4))
  assert full != sft.targets(s, task, examples, 4, 0)
  answers = [t[len("<answer>"):-len("</answer>")] for t in full]
  assert all(a[i] in ("0", ex["solution"][i]) for a, ex in zip(answers, examples) for i in range(16))
  assert 0 < sum(a.count("0") for a in answers) < sum(ex["puzzle"].count("0") for ex in examples)
  references = [f"<answer>{ex['solution']}</answer>" for ex in examples]
  c.task.sft_unfilled = 0.0
  assert sft.targets(s, build.task(c), examples, 3, 0) == references
  assert sft.targets(s, get_task("sudoku"), examples, 3, 0) == references  # no demonstrator
  for value in (1.0, -0.1):
    c.task.sft_unfilled = value
    with pytest.raises(ValueError, match="config.task.sft_unfilled="):
      config_lib.validate(c)
