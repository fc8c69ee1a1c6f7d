"""Sorting digits: deterministic generation, a held-out split by answer, and the grader against an
independent checker (a completion is right when it is a non-decreasing rearrangement)."""

import collections
import itertools

import pytest

from stabledrl_jax.tasks import datasets, get_task, sorting


def _independent_is_right(answer_text, digits):
  """Right iff the text is exactly a non-decreasing permutation of the digits (counted here)."""
  if answer_text is None or not answer_text.isdigit() or not answer_text.isascii():
    return False
  return (collections.Counter(answer_text) == collections.Counter(digits)
          and all(a <= b for a, b in zip(answer_text, answer_text[1:])))


def test_generation_is_deterministic_per_seed():
  first = datasets.generated_examples("sorting", "train", num_train=50, seed=3)
  again = datasets.generated_examples("sorting", "train", num_train=50, seed=3)
  other = datasets.generated_examples("sorting", "train", num_train=50, seed=4)
  assert first == again
  assert first != other
  assert all(len(ex["digits"]) == 8 and ex["digits"].isdigit() for ex in first)
  assert sorting.generate(7, 11, "test") == sorting.generate(7, 11, "test")


def test_held_out_answers_never_occur_in_training():
  # The split over the whole answer space: every multiset of 8 digits is in exactly one split.
  answers = ["".join(c) for c in itertools.combinations_with_replacement("0123456789", 8)]
  assert len(answers) == 24_310
  test_answers = {a for a in answers if sorting.is_test_answer(a)}
  assert 0.04 < len(test_answers) / len(answers) < 0.09  # about TEST_FRACTION = 1/16
  # And over whole generated splits, as main draws them.
  train = datasets.generated_examples("sorting", "train", num_train=20_000, seed=0)
  test = datasets.generated_examples("sorting", "test", num_test=2_000, seed=0)
  train_answers = {"".join(sorted(ex["digits"])) for ex in train}
  held_out = {"".join(sorted(ex["digits"])) for ex in test}
  assert held_out <= test_answers
  assert not train_answers & test_answers
  assert len({ex["digits"] for ex in train}) > 19_900  # instances, not a few repeated ones


@pytest.mark.parametrize("completion", [
    "<answer>01234567</answer>", "<answer>0123 4567</answer>", "<answer>76543210</answer>",
    "<answer>0123456</answer>", "<answer>012345678</answer>", "<answer></answer>", "01234567",
    "<answer>0123456x</answer>", "<answer>０1234567</answer>", "<answer>-1234567</answer>",
    "<answer>11234567</answer><answer>01234567</answer>", "<answer>01234567", "",
    "<answer>01234567</answer><answer>1</answer>", "<answer>0.1234567</answer>",
])
def test_grader_agrees_with_an_independent_checker(completion):
  task = get_task("sorting")
  example = {"digits": "53172604"}
  answer = sorting.extract_answer(completion)
  expected = _independent_is_right(answer, example["digits"])
  assert task.is_correct(completion, example) == expected
  assert (task.correctness(completion, example) == 1.0) == expected


def test_partial_credit_counts_positions_of_a_full_length_answer():
  example = {"digits": "53172604"}  # sorted: 01234567
  assert sorting.correctness("<answer>01234576</answer>", example) == 6 / 8
  assert sorting.correctness("<answer>0123456</answer>", example) == 0.0  # wrong length
  assert sorting.correctness("no answer", example) == 0.0


def test_random_outputs_against_the_independent_checker():
  rng = __import__("random").Random(0)
  task = get_task("sorting")
  for _ in range(2000):
    digits = "".join(rng.choice("0123456789") for _ in range(8))
    answer = "".join(sorted(digits)) if rng.random() < 0.3 else "".join(
        rng.choice("0123456789") for _ in range(rng.randint(6, 9)))
    completion = f"<answer>{answer}</answer>"
    assert task.is_correct(completion, {"digits": digits}) == _independent_is_right(answer, digits)


def test_the_exact_reward_is_the_whole_answer():
  reward = get_task("sorting").reward_fn({"correctness": 0.0, "exact": 1.0})
  assert reward("<answer>01234567</answer>", {"digits": "53172604"}) == 1.0
  assert reward("<answer>01234576</answer>", {"digits": "53172604"}) == 0.0


def test_the_default_reward_is_half_partial_credit_half_the_exact_answer():
  """The config's empty `task.reward_weights` takes the task's mix: 6 of 8 positions right and
  not exact is 0.5 * 6/8; exact is 0.5 + 0.5; a wrong length scores 0."""
  reward = get_task("sorting").reward_fn({})
  assert reward("<answer>01234576</answer>", {"digits": "53172604"}) == 0.375
  assert reward("<answer>01234567</answer>", {"digits": "53172604"}) == 1.0
  assert reward("<answer>0123456</answer>", {"digits": "53172604"}) == 0.0
