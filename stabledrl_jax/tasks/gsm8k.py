"""GSM8K: grade-school word problems; correctness on the final number.

Example keys: `question`, `answer` (the gold final answer as text, e.g. "18"); examples read from
the GSM8K jsonl also keep `reasoning` (the worked solution before `####`).
"""

from __future__ import annotations

import math
import re
import sys

from stabledrl_jax.tasks import base, extract

REL_TOLERANCE = 1e-6
_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")


def parse_gold(answer_field: str) -> tuple[str, str]:
  """GSM8K's `answer` field -> (worked reasoning, final answer text after `####`)."""
  if "####" not in answer_field:
    raise ValueError("GSM8K answer has no '####' final-answer marker")
  reasoning, final = answer_field.rsplit("####", 1)
  # `<<16-3-4=9>>` are GSM8K's calculator annotations, not text a model should learn.
  reasoning = _CALCULATOR_RE.sub("", reasoning)
  return reasoning.strip(), final.strip().replace(",", "")


def extract_answer(completion: str) -> float | None:
  """The final number of the answer span (`\\boxed{}` / `<answer>`), else of the whole text.

  Thousands commas, `$`, `%` and trailing units ("18 dollars") are ignored because only the
  number token is read; the *last* number wins, as a final answer comes last. When the model
  wrote an answer span without a number in it (`\\boxed{x}`), there is no answer: the text's
  last number is used only when no answer span exists at all (e.g. a truncated generation).
  """
  text = extract.until_end_of_turn(completion)
  span = extract.final_answer_text(text)
  return extract.last_number(span if span is not None else text)


def numbers_match(predicted: float | None, gold: float) -> bool:
  return predicted is not None and math.isclose(
      predicted, gold, rel_tol=REL_TOLERANCE, abs_tol=REL_TOLERANCE
  )


def gold_number(example: base.Example) -> float:
  number = extract.parse_number(str(example["answer"]).replace("$", "").strip())
  if number is None:
    raise ValueError(f"GSM8K gold answer is not a number: {example['answer']!r}")
  return number


def is_correct(completion: str, example: base.Example) -> bool:
  return numbers_match(extract_answer(completion), gold_number(example))


def correctness(completion: str, example: base.Example) -> float:
  return 1.0 if is_correct(completion, example) else 0.0


def question(example: base.Example) -> str:
  return str(example["question"])


def compact_question(example: base.Example) -> str:
  return f"{example['question']}\n"


def reference_completion(example: base.Example) -> str:
  reasoning = example.get("reasoning", "")
  return f"<reasoning>{reasoning}</reasoning><answer>{example['answer']}</answer>"


def from_record(record: dict) -> dict:
  """A GSM8K jsonl record `{"question", "answer": "... #### 18"}` -> an example dict."""
  reasoning, final = parse_gold(str(record["answer"]))
  return {"question": str(record["question"]), "answer": final, "reasoning": reasoning}


TASK = base.Task.of_module("gsm8k", sys.modules[__name__])
