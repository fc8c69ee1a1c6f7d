"""Sorting digits: the prompt is a string of `length` decimal digits, the answer the same digits in
ascending order (`"30817"` -> `"01378"`).

Example keys: `digits` (the string to sort). There are 10^length instances (10^8 at the default
8) but only C(length + 9, 9) distinct answers (24,310 at 8), so train and test are split by
*answer*: a sorted string is a test answer when its hash falls in the test bucket
(`TEST_FRACTION` of them), and no training instance, for SFT or RL, ever has a test answer.
Rewards: `correctness`, the fraction of answer positions right when the answer has the right
length (else 0); `exact`, 1 for the whole sorted string (`is_correct`) and 0 otherwise; by
default half of each.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

from stabledrl_jax.tasks import base, extract

DIGITS = "0123456789"
TEST_FRACTION = 1 / 16


def sorted_digits(digits: str) -> str:
  return "".join(sorted(digits))


def is_test_answer(answer: str) -> bool:
  """Whether a sorted string belongs to the test split: a fixed hash, the same in every run."""
  bucket = int.from_bytes(hashlib.blake2b(answer.encode(), digest_size=8).digest(), "little")
  return bucket < TEST_FRACTION * 2**64


def generate(seed: int, index: int, split: str = "train", length: int = 8) -> dict:
  """The `index`-th instance of the stream for (`seed`, `split`): a pure function of its args.
  Draws uniform digit strings and keeps the first whose answer lies in `split`."""
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  if not 2 <= length <= 16:
    raise ValueError(f"length must lie in [2, 16], got {length}")
  rng = np.random.default_rng([seed, index, 0 if split == "train" else 1])
  while True:
    digits = "".join(DIGITS[i] for i in rng.integers(0, 10, size=length))
    if is_test_answer(sorted_digits(digits)) == (split == "test"):
      return {"digits": digits}


def extract_answer(completion: str) -> str | None:
  """The last `<answer>` tag's text with spaces removed; None when absent or not all digits."""
  tagged = extract.last_answer_tag(completion)
  if tagged is None:
    return None
  answer = "".join(tagged.split())
  return answer if answer and all(ch in DIGITS for ch in answer) else None


def correctness(completion: str, example: base.Example) -> float:
  answer, target = extract_answer(completion), sorted_digits(example["digits"])
  if answer is None or len(answer) != len(target):
    return 0.0
  return sum(a == t for a, t in zip(answer, target)) / len(target)


def is_correct(completion: str, example: base.Example) -> bool:
  return extract_answer(completion) == sorted_digits(example["digits"])


def question(example: base.Example) -> str:
  return (f"Sort the digits of {example['digits']} in ascending order. Answer with the sorted "
          "digits as one string.")


def compact_question(example: base.Example) -> str:
  return f"{example['digits']}\n"


def reference_completion(example: base.Example) -> str:
  return f"<answer>{sorted_digits(example['digits'])}</answer>"


TASK = base.Task.of_module(
    "sorting", sys.modules[__name__],
    extra_rewards={"exact": lambda completion, example: float(is_correct(completion, example))},
    # Partial credit alone saturates (0.9 mean reward at 40% exactly sorted, measured on the main job): half of the
    # reward is for the whole answer.
    default_weights={"correctness": 0.5, "exact": 0.5})
