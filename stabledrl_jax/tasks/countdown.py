"""Countdown: combine three numbers (1-100) with + - * / to reach a target.

Example keys: `numbers` (list of 3 ints), `target` (int); generated examples add `solution` (one
equation that reaches the target). Reward (docs/method.md §7): 1.0 when the last `<answer>` equation uses
exactly the given numbers, once each, and evaluates to the target within 1e-5; 0.1 for a present
but wrong answer; 0.0 for none. A `\boxed{}` equation counts as the answer when the tag is
missing or holds no equation (LLaDA often boxes its answer and garbles the tag).
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from collections.abc import Iterator
from fractions import Fraction

import numpy as np

from stabledrl_jax.tasks import arithmetic, base, extract

CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.1
TOLERANCE = 1e-5
_OPS = ("+", "-", "*", "/")


def _combine(a: Fraction, b: Fraction, op: str) -> Fraction | None:
  if op == "+":
    return a + b
  if op == "-":
    return a - b
  if op == "*":
    return a * b
  return a / b if b != 0 else None


def reachable(numbers: list[int]) -> dict[Fraction, str]:
  """Every value an expression using each of the three numbers exactly once can take."""
  out: dict[Fraction, str] = {}
  for a, b, c in itertools.permutations(range(3)):
    x, y, z = (Fraction(numbers[i]) for i in (a, b, c))
    for op1, op2 in itertools.product(_OPS, repeat=2):
      inner = _combine(x, y, op1)
      if inner is None:
        continue
      inner_text = f"({numbers[a]} {op1} {numbers[b]})"
      # Both operand orders around the inner pair: (x op y) op z and z op (x op y).
      for value, text in (
          (_combine(inner, z, op2), f"{inner_text} {op2} {numbers[c]}"),
          (_combine(z, inner, op2), f"{numbers[c]} {op2} {inner_text}"),
      ):
        if value is not None and value not in out:
          out[value] = text
  return out


def generate(seed: int, index: int, target_range: tuple[int, int] = (1, 100)) -> dict:
  """The `index`-th example of the stream for `seed`: pure function of (seed, index)."""
  rng = np.random.default_rng([seed, index])
  lo, hi = target_range
  while True:
    numbers = [int(n) for n in rng.integers(1, 101, size=3)]
    options = sorted(
        (int(v), text)
        for v, text in reachable(numbers).items()
        if v.denominator == 1 and lo <= v <= hi
    )
    if options:
      target, solution = options[int(rng.integers(len(options)))]
      return {"numbers": numbers, "target": target, "solution": solution}


def generate_many(n: int, seed: int, target_range: tuple[int, int] = (1, 100)) -> Iterator[dict]:
  for i in range(n):
    yield generate(seed, i, target_range)


def _equation_candidates(answer: str) -> list[str]:
  # "55 - 53 = 2" or "2 = 55 - 53": the side with an operator is the expression.
  parts = [p for p in answer.split("=") if p.strip()]
  if len(parts) <= 1:
    return [answer]
  return sorted(parts, key=lambda p: -sum(p.count(op) for op in "+-*/x\u00d7\u00f7"))


def answer_candidates(completion: str) -> list[str]:
  """Equation texts, in priority order: the last `<answer>` tag (a `\\boxed{}` inside it
  wins), then the last `\\boxed{}` of the completion (models often box the equation and
  drop or garble the tag)."""
  text = extract.until_end_of_turn(completion)
  candidates = []
  tagged = extract.last_answer_tag(text)
  if tagged:
    boxed = extract.last_boxed(tagged)
    candidates.append(boxed if boxed else tagged)
  boxed = extract.last_boxed(text)
  if boxed and boxed not in candidates:
    candidates.append(boxed)
  return candidates


def _parse_equation(equation: str) -> arithmetic.Expression | None:
  for part in _equation_candidates(equation):
    parsed = arithmetic.try_parse_expression(part)
    if parsed is not None:
      return parsed
  return None


def extract_answer(completion: str) -> arithmetic.Expression | str | None:
  """The first candidate that parses as arithmetic (as an `Expression`), else the first
  candidate's raw text (present but unparseable), else None (no answer)."""
  candidates = answer_candidates(completion)
  for candidate in candidates:
    parsed = _parse_equation(candidate)
    if parsed is not None:
      return parsed
  return candidates[0] if candidates else None


def score_equation(answer: arithmetic.Expression | str, numbers: list[int], target: float) -> bool:
  """True when the expression uses exactly `numbers`, once each, and equals `target`."""
  if isinstance(answer, str):
    return False
  return (
      Counter(answer.numbers) == Counter(Fraction(n) for n in numbers)
      and abs(float(answer.value) - float(target)) < TOLERANCE
  )


def correctness(completion: str, example: base.Example) -> float:
  answer = extract_answer(completion)
  if answer is None:
    return 0.0
  if score_equation(answer, list(example["numbers"]), example["target"]):
    return CORRECT_REWARD
  return FORMAT_REWARD


def is_correct(completion: str, example: base.Example) -> bool:
  return correctness(completion, example) == CORRECT_REWARD


def question(example: base.Example) -> str:
  nums = ", ".join(str(n) for n in example["numbers"])
  return (
      f"Using the numbers [{nums}], write an equation that equals {example['target']}. "
      "Use + - * / and parentheses; use every number exactly once."
  )


def compact_question(example: base.Example) -> str:
  return f"{' '.join(str(n) for n in example['numbers'])} = {example['target']}\n"


def reference_completion(example: base.Example) -> str:
  if "solution" not in example:
    solution = reachable(list(example["numbers"])).get(Fraction(example["target"]))
    if solution is None:
      raise ValueError(f"target {example['target']} unreachable from {example['numbers']}")
  else:
    solution = example["solution"]
  return f"<answer>{solution}</answer>"


def from_record(record: dict) -> dict:
  """d1's jsonl form `{"input": "30,100,93", "output": "23"}` -> an example dict."""
  numbers = [int(x) for x in str(record["input"]).split(",")]
  if len(numbers) != 3:
    raise ValueError(f"expected 3 numbers, got {record['input']!r}")
  return {"numbers": numbers, "target": int(record["output"])}


TASK = base.Task.of_module("countdown", sys.modules[__name__])
