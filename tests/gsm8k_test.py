"""GSM8K final-number grading and answer extraction."""

import pytest

from stabledrl_jax.tasks import extract, gsm8k

EX = {"question": "q", "answer": "1234"}


@pytest.mark.parametrize(
    "completion, correct",
    [
        ("<answer>1234</answer>", True),
        ("<answer>\\boxed{1,234}</answer>", True),
        ("<answer>$1,234.00</answer>", True),
        ("<answer>1234 dollars</answer>", True),
        ("The total is 12 + 1222 = 1234", True),  # no answer span: the text's final number
        ("<answer>\\boxed{x}</answer> so 1234", False),  # an answer without a number is no answer
        ("<answer>1234</answer><answer>1235</answer>", False),  # the last answer counts
        ("<answer>1235</answer><|eot_id|>1234", False),  # text after the turn is ignored
        ("<answer>\\boxed{}1234</answer>", True),  # an empty box falls back to the tag
        ("<answer>12.34</answer>", False),
    ],
)
def test_final_number(completion, correct):
  assert gsm8k.is_correct(completion, EX) == correct


def test_gold_after_hashes():
  record = {"question": "q", "answer": "So 2+1=<<2+1=3>>3 bolts\n#### 1,000"}
  assert gsm8k.from_record(record) == {
      "question": "q",
      "answer": "1000",
      "reasoning": "So 2+1=3 bolts",
  }
  with pytest.raises(ValueError, match="####"):
    gsm8k.from_record({"question": "q", "answer": "no marker"})


@pytest.mark.parametrize(
    "text, number",
    [
        ("a 3 b -4.5", -4.5),
        ("10-4", 4.0),
        ("(-3)", -3.0),
        ("is -10 degrees", -10.0),
        ("\\frac{2}{3}", 2 / 3),
        ("1,234,567", 1234567.0),
        ("none", None),
    ],
)
def test_last_number(text, number):
  assert extract.last_number(text) == (pytest.approx(number) if number else None)


def test_last_boxed_balances_braces_and_rejects_unclosed():
  assert extract.last_boxed("\\boxed{1} and \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
  assert extract.last_boxed("\\boxed{1") is None
  assert extract.last_answer_tag("x <answer> 5 ") == "5"
  assert extract.last_answer_tag("no tag") is None
