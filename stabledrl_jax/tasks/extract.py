"""Answer extraction from model completions: `<answer>` tags, `\\boxed{}`, the final number.

Completions are untrusted text of any size; every function here is linear-time string work
(`str.rfind`, bounded regexes), so megabytes of output cannot stall a training step.
"""

from __future__ import annotations

import re

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
# Cap on the text an extractor keeps: answers are short; anything longer is not an answer.
MAX_ANSWER_CHARS = 4096

# Chat/special tokens that leak into decoded generations (LLaDA, Qwen, generic).
_SPECIAL_TOKEN_RE = re.compile(r"<\|[a-z_]{1,32}\|>|<(?:pad|eos|bos|mask)>")
# End-of-turn markers: text after the first one was never part of the model's answer.
END_OF_TURN = ("<|eot_id|>", "<|endoftext|>", "<|im_end|>", "<|end|>", "<eos>")
# `\frac{3}{4}` / `\dfrac{3}{4}` with plain numbers inside, read as one value.
_FRAC_RE = re.compile(r"\\[dt]?frac\{\s*(-?[\d,]*\.?\d+)\s*\}\{\s*(-?[\d,]*\.?\d+)\s*\}")
# A number: digits with optional thousands commas and decimals; a `-` is a sign only where it
# cannot be subtraction (not right after a digit, letter or closing bracket: "10-4" ends in 4).
_NUMBER_RE = re.compile(r"(?:(?<![\w)\]}])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")


def strip_special_tokens(text: str) -> str:
  """Removes `<|eot_id|>`-style markers so they never count as answer content."""
  return _SPECIAL_TOKEN_RE.sub("", text)


def until_end_of_turn(text: str) -> str:
  """The completion up to its first end-of-turn marker, other special tokens removed."""
  cut = len(text)
  for marker in END_OF_TURN:
    i = text.find(marker, 0, cut)
    if i >= 0:
      cut = i
  return strip_special_tokens(text[:cut])


def last_answer_tag(text: str) -> str | None:
  """Content of the last `<answer>...</answer>`; an unclosed final tag runs to the end.

  None when there is no `<answer>` tag at all. An unclosed tag is accepted because
  generation often stops (length limit, eos) right after the answer, before the close tag.
  """
  start = text.rfind(ANSWER_OPEN)
  if start < 0:
    return None
  body = text[start + len(ANSWER_OPEN) :]
  end = body.find(ANSWER_CLOSE)
  if end >= 0:
    body = body[:end]
  return strip_special_tokens(body[:MAX_ANSWER_CHARS]).strip()


def has_answer_format(text: str) -> bool:
  """True when the completion closes its reasoning and then gives a closed answer tag."""
  reasoning_end = text.rfind("</reasoning>")
  answer_start = text.rfind(ANSWER_OPEN)
  return 0 <= reasoning_end < answer_start and text.find(ANSWER_CLOSE, answer_start) > 0


def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent.

  An unbalanced last box (generation cut off inside it) yields None rather than a guess.
  """
  start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if start < 0:
    return None
  brace = text.find("{", start)
  # Only whitespace may sit between `\boxed` and its brace.
  if brace < 0 or text[start:brace].rstrip() not in ("\\boxed", "\\fbox"):
    return None
  depth = 0
  limit = min(len(text), brace + MAX_ANSWER_CHARS)
  for i in range(brace, limit):
    ch = text[i]
    if ch == "{":
      depth += 1
    elif ch == "}":
      depth -= 1
      if depth == 0:
        return text[brace + 1 : i].strip()
  return None


def final_answer_text(text: str) -> str | None:
  """The answer span: a non-empty `\\boxed{}` inside the last answer tag, else the tag's text,
  else (no tag, or an empty one) the last `\\boxed{}` of the text; None when there is none."""
  tagged = last_answer_tag(text)
  if tagged:
    boxed = last_boxed(tagged)
    return boxed if boxed else tagged
  return last_boxed(text)


def parse_number(token: str) -> float | None:
  """`"1,234.50"` -> 1234.5; None when the token is not a number."""
  try:
    return float(token.replace(",", ""))
  except ValueError:
    return None


def last_number(text: str) -> float | None:
  """The last number written in `text` (thousands commas, `$`, `%` and trailing units ignored)."""
  text = text[-MAX_ANSWER_CHARS:]
  text = text.replace("\\!", "").replace("{,}", ",")
  matches = [(m.end(), parse_number(m.group())) for m in _NUMBER_RE.finditer(text)]
  for m in _FRAC_RE.finditer(text):
    num, den = parse_number(m.group(1)), parse_number(m.group(2))
    if num is not None and den:
      # A trailing fraction is one value, not its denominator.
      matches.append((m.end() + 1, num / den))
  if not matches:
    return None
  return max(matches, key=lambda pair: pair[0])[1]
