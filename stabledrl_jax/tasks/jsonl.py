"""A generic task over the user's own JSONL files: a prompt field, a gold-answer field, a checker.

    --config.task.name=jsonl --config.task.source=local --config.task.source_dir=DIR
    --config.task.prompt_field=question --config.task.answer_field=answer
    --config.task.checker=number

`DIR/train.jsonl` and `DIR/test.jsonl` hold one JSON object per line. Examples are
`{"question": <prompt field>, "answer": <answer field>}`. The checker scores a completion:
`number` (the final number against the gold field's last number, as GSM8K), `math` (final-answer
equivalence through math-verify, with its time limit, as MATH500) or an import path
`pkg.module:function` of a reward function `(completion, example) -> float` in [0, 1]
(1 = correct).
"""

from __future__ import annotations

import importlib
from typing import Any

from stabledrl_jax.tasks import base, extract, gsm8k, math500

CHECKERS = ("number", "math")


def load_object(path: str, what: str) -> Any:
  """The object at `pkg.module:attr`; a one-line `ValueError` naming `what` when it is not there."""
  module_name, sep, attr = path.partition(":")
  if not sep or not module_name or not attr:
    raise ValueError(f"{what}={path!r}: expected an import path 'package.module:NAME'")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"{what}={path!r}: cannot import module {module_name!r} ({e})") from None
  obj = module
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"{what}={path!r}: module {module_name!r} defines no {attr}")
    obj = getattr(obj, part)
  return obj


def number_correctness(completion: str, example: base.Example) -> float:
  """1.0 when the completion's final number equals the gold answer's last number (so a GSM8K
  answer field, a worked solution ending `#### 18`, works as it is)."""
  gold = extract.last_number(str(example["answer"]))
  if gold is None:
    raise ValueError(f"gold answer {example['answer']!r} has no number "
                     "(config.task.checker='number')")
  return 1.0 if gsm8k.numbers_match(gsm8k.extract_answer(completion), gold) else 0.0


def checker_reward(checker: str) -> base.RewardFn:
  if checker == "number":
    return number_correctness
  if checker == "math":
    return math500.correctness
  if ":" not in checker:
    raise ValueError(f"config.task.checker={checker!r}: expected one of {CHECKERS} or an import "
                     "path 'package.module:function'")
  fn = load_object(checker, "config.task.checker")
  if not callable(fn):
    raise ValueError(f"config.task.checker={checker!r}: {type(fn).__name__} is not a function")
  return fn


def record_reader(prompt_field: str, answer_field: str):
  """JSONL record -> example; a record without a field names it (the reader adds file and line)."""

  def from_record(record: dict) -> dict:
    for key, field in (("prompt_field", prompt_field), ("answer_field", answer_field)):
      if field not in record:
        raise ValueError(f"no field {field!r} (config.task.{key}); the record has {sorted(record)}")
    return {"question": str(record[prompt_field]), "answer": str(record[answer_field])}

  return from_record


def make_task(prompt_field: str = "question", answer_field: str = "answer",
              checker: str = "number") -> base.Task:
  correctness = checker_reward(checker)  # its values are checked where rewards are summed
  return base.Task(
      name="jsonl",
      question=lambda example: str(example["question"]),
      compact_question=lambda example: f"{example['question']}\n",
      extract_answer=math500.extract_answer if checker == "math" else gsm8k.extract_answer,
      correctness=correctness,
      is_correct=lambda completion, example: correctness(completion, example) >= 1.0,
      reference_completion=lambda example: f"<answer>{example['answer']}</answer>",
      from_record=record_reader(prompt_field, answer_field),
  )
