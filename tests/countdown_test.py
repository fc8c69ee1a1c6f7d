"""Countdown: generator reachability, the safe arithmetic parser, and the 1.0 / 0.1 / 0 reward."""

import itertools
import operator
from fractions import Fraction

import pytest

from stabledrl_jax.tasks import arithmetic, countdown, get_task


def _brute_force_values(numbers):
  """Independent enumeration: every binary tree over all three numbers, with + - * /."""
  ops = [operator.add, operator.sub, operator.mul, lambda a, b: a / b if b else None]
  values = set()
  for a, b, c in itertools.permutations([Fraction(n) for n in numbers]):
    for f, g in itertools.product(ops, repeat=2):
      left = f(a, b)
      if left is not None:
        for v in (g(left, c), g(c, left)):
          if v is not None:
            values.add(v)
  return values


def test_generated_targets_are_reachable_integers_and_deterministic():
  examples = list(countdown.generate_many(150, seed=3))
  assert examples == list(countdown.generate_many(150, seed=3))
  assert examples != list(countdown.generate_many(150, seed=4))
  for ex in examples:
    assert len(ex["numbers"]) == 3 and all(1 <= n <= 100 for n in ex["numbers"])
    assert isinstance(ex["target"], int) and 1 <= ex["target"] <= 100
    assert Fraction(ex["target"]) in _brute_force_values(ex["numbers"])
    # The stored solution is itself graded correct.
    assert countdown.is_correct(countdown.reference_completion(ex), ex)


@pytest.mark.parametrize(
    "text, value",
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("8 / 4 / 2", 1),
        ("10 - 4 - 3", 3),
        ("-3 + 5", 2),
        ("2 × 3 ÷ 4", Fraction(3, 2)),
        ("\\left(6 \\div 4\\right) \\times 2", 3),
        ("[2 + 3] x 4", 20),
        ("7 − 2", 5),
        ("0.5 * 4", 2),
    ],
)
def test_parser_evaluates_exactly(text, value):
  assert arithmetic.parse_expression(text).value == value


@pytest.mark.parametrize(
    "text",
    [
        "2 ** 3",
        "2 ^ 3",
        "abs(3)",
        "__import__('os')",
        "1 / 0",
        "1 / (2 - 2)",
        "(1 + 2",
        "1 + 2)",
        "",
        "1 2",
        "1..2",
        "9" * 40,
    ],
)
def test_parser_rejects(text):
  with pytest.raises(arithmetic.ExpressionError):
    arithmetic.parse_expression(text)


EXAMPLE = {"numbers": [49, 55, 53], "target": 51}


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("<reasoning>...</reasoning><answer>55 + 49 - 53</answer>", 1.0),
        ("<answer>\\boxed{(55 + 49) - 53}</answer>", 1.0),
        ("<answer>55 + 49 - 53 = 51</answer>", 1.0),
        ("<answer>51 = 55 + 49 - 53</answer>", 1.0),
        ("<answer>55 - 53 + 49 + 0</answer>", 0.1),  # an extra number
        ("<answer>55 - 53</answer>", 0.1),  # a number missing
        ("<answer>55 + 49 + 53</answer>", 0.1),  # wrong value
        ("<answer>55 + 49 - 53 - 53 + 53</answer>", 0.1),  # a number used twice
        ("<answer>fifty-one</answer>", 0.1),
        ("I think it is 55 + 49 - 53.", 0.0),
        ("<answer></answer>", 0.0),
        # The last answer counts, not an earlier one.
        ("<answer>55 + 49 - 53</answer> wait <answer>55 - 49 + 53</answer>", 0.1),
        # Text after the end of the turn is not the model's answer.
        ("<answer>55 - 49</answer><|eot_id|><answer>55 + 49 - 53</answer>", 0.1),
    ],
)
def test_reward_values(completion, reward):
  assert countdown.correctness(completion, EXAMPLE) == reward
  assert get_task("countdown").reward(completion, EXAMPLE) == reward


def test_weighted_rewards_compose_and_unknown_names_fail():
  task = get_task("countdown")
  good = "<reasoning>r</reasoning><answer>55 + 49 - 53</answer>"
  assert task.reward(good, EXAMPLE, {"correctness": 1.0, "format": 0.5}) == 1.5
  assert (
      task.reward("<answer>55 + 49 - 53</answer>", EXAMPLE, {"correctness": 1.0, "format": 0.5})
      == 1.0
  )
  with pytest.raises(KeyError, match="nope"):
    task.reward_fn({"nope": 1.0})


def test_from_record_reads_d1_format():
  assert countdown.from_record({"input": "30,100,93", "output": "23"}) == {
      "numbers": [30, 100, 93],
      "target": 23,
  }
