"""A small safe arithmetic parser for model-written equations (never `eval`).

Grammar (recursive descent, exact rational arithmetic with `fractions.Fraction`):

    expr    := term (("+" | "-") term)*
    term    := unary (("*" | "/") unary)*
    unary   := ("+" | "-") unary | primary
    primary := NUMBER | "(" expr ")"

Accepted spellings: `*`, `x`, `X`, `×`, `·`, `\\times`, `\\cdot` for multiplication; `/`, `÷`,
`\\div` for division; `−`, `–` for minus; `[]`/`{}` as brackets; `\\left`, `\\right`, `$`, `\\(`
and `\\)` are dropped. Powers (`**`, `^`), names and calls are rejected. Input length, nesting
depth, number length and the magnitude of every intermediate value are bounded, so a
pathological expression fails fast instead of exhausting time or memory.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

MAX_CHARS = 256
MAX_DEPTH = 32
MAX_NUMBER_DIGITS = 12
MAX_MAGNITUDE = Fraction(10) ** 15

_LATEX_REPLACEMENTS = (
    ("\\left", ""),
    ("\\right", ""),
    ("\\(", ""),
    ("\\)", ""),
    ("\\[", ""),
    ("\\]", ""),
    ("\\times", "*"),
    ("\\cdot", "*"),
    ("\\div", "/"),
    ("$", ""),
)
_CHAR_OPS = {
    "+": "+",
    "-": "-",
    "\u2212": "-",
    "\u2013": "-",
    "*": "*",
    "x": "*",
    "X": "*",
    "\u00d7": "*",
    "\u00b7": "*",
    "\u22c5": "*",
    "/": "/",
    "\u00f7": "/",
    "(": "(",
    "[": "(",
    "{": "(",
    ")": ")",
    "]": ")",
    "}": ")",
}


class ExpressionError(ValueError):
  """The text is not a bounded arithmetic expression in the accepted grammar."""


@dataclasses.dataclass(frozen=True)
class Expression:
  value: Fraction
  numbers: tuple[Fraction, ...]  # every number literal, in order of appearance


def normalize(text: str) -> str:
  for old, new in _LATEX_REPLACEMENTS:
    text = text.replace(old, new)
  return text.strip()


def tokenize(text: str) -> list[str]:
  """Splits into number literals and the operators `+ - * / ( )`; raises on anything else."""
  tokens: list[str] = []
  i, n = 0, len(text)
  while i < n:
    ch = text[i]
    if ch.isspace():
      i += 1
    elif ch.isdigit() or ch == ".":
      j = i
      while j < n and (text[j].isdigit() or text[j] == "."):
        j += 1
      literal = text[i:j]
      if literal.count(".") > 1 or literal == "." or len(literal) > MAX_NUMBER_DIGITS + 1:
        raise ExpressionError(f"bad number {literal[:20]!r}")
      tokens.append(literal)
      i = j
    elif ch in _CHAR_OPS:
      op = _CHAR_OPS[ch]
      if op == "*" and i + 1 < n and text[i + 1] == "*":
        raise ExpressionError("powers are not allowed")
      tokens.append(op)
      i += 1
    else:
      raise ExpressionError(f"unexpected character {ch!r}")
  return tokens


class _Parser:

  def __init__(self, tokens: list[str]):
    self.tokens = tokens
    self.pos = 0
    self.numbers: list[Fraction] = []

  def peek(self) -> str | None:
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def take(self) -> str:
    token = self.peek()
    if token is None:
      raise ExpressionError("unexpected end of expression")
    self.pos += 1
    return token

  def expr(self, depth: int) -> Fraction:
    value = self.term(depth)
    while self.peek() in ("+", "-"):
      op = self.take()
      rhs = self.term(depth)
      value = _bounded(value + rhs if op == "+" else value - rhs)
    return value

  def term(self, depth: int) -> Fraction:
    value = self.unary(depth)
    while self.peek() in ("*", "/"):
      op = self.take()
      rhs = self.unary(depth)
      if op == "*":
        value = _bounded(value * rhs)
      elif rhs == 0:
        raise ExpressionError("division by zero")
      else:
        value = _bounded(value / rhs)
    return value

  def unary(self, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
      raise ExpressionError("expression nested too deeply")
    if self.peek() in ("+", "-"):
      sign = -1 if self.take() == "-" else 1
      return sign * self.unary(depth + 1)
    return self.primary(depth)

  def primary(self, depth: int) -> Fraction:
    token = self.take()
    if token == "(":
      value = self.expr(depth + 1)
      if self.take() != ")":
        raise ExpressionError("expected ')'")
      return value
    if token[0].isdigit() or token[0] == ".":
      number = Fraction(token)
      self.numbers.append(number)
      return _bounded(number)
    raise ExpressionError(f"unexpected token {token!r}")


def _bounded(value: Fraction) -> Fraction:
  # Bounding the denominator too keeps Fraction arithmetic cheap on adversarial chains.
  if abs(value) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
    raise ExpressionError("intermediate value out of range")
  return value


def parse_expression(text: str) -> Expression:
  """Parses and evaluates `text` exactly; raises `ExpressionError` when it is not valid."""
  if len(text) > 4 * MAX_CHARS:
    raise ExpressionError("expression too long")
  text = normalize(text)
  if len(text) > MAX_CHARS:
    raise ExpressionError("expression too long")
  tokens = tokenize(text)
  if not tokens:
    raise ExpressionError("empty expression")
  parser = _Parser(tokens)
  value = parser.expr(0)
  if parser.peek() is not None:
    raise ExpressionError(f"trailing token {parser.peek()!r}")
  return Expression(value=value, numbers=tuple(parser.numbers))


def try_parse_expression(text: str) -> Expression | None:
  try:
    return parse_expression(text)
  except ExpressionError:
    return None
