"""4x4 Sudoku: 16-character grids, row-major, `0` = blank; digits 1-4; 2x2 boxes.

Example keys: `puzzle`, `solution` (16-character strings). Reward (docs/method.md §7): the fraction of
the puzzle's blank cells that the last `<answer>` fills correctly. Train and test are split by
*solution grid* (there are exactly 288), so test grids are never seen in training.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Iterator

import numpy as np

from stabledrl_jax.tasks import base, extract

SIZE = 4
CELLS = SIZE * SIZE
NUM_GRIDS = 288


def _units() -> list[tuple[int, ...]]:
  rows = [tuple(r * 4 + c for c in range(4)) for r in range(4)]
  cols = [tuple(r * 4 + c for r in range(4)) for c in range(4)]
  boxes = [
      tuple((br + r) * 4 + bc + c for r in range(2) for c in range(2))
      for br in (0, 2)
      for bc in (0, 2)
  ]
  return rows + cols + boxes


UNITS = _units()
PEERS = [sorted({j for unit in UNITS if i in unit for j in unit} - {i}) for i in range(CELLS)]


def is_valid_solution(grid: str) -> bool:
  return (
      len(grid) == CELLS
      and all(ch in "1234" for ch in grid)
      and all(len({grid[i] for i in unit}) == SIZE for unit in UNITS)
  )


@functools.cache
def all_solutions() -> tuple[str, ...]:
  """All 288 valid 4x4 grids in lexicographic order (from row permutations, then filtered)."""
  perms = ["".join(p) for p in itertools.permutations("1234")]
  grids = ("".join(rows) for rows in itertools.product(perms, repeat=4))
  return tuple(g for g in grids if is_valid_solution(g))


def count_solutions(puzzle: str, limit: int = 2) -> int:
  """Number of completions of `puzzle` (counting stops at `limit`), by backtracking."""
  cells = list(puzzle)
  count = 0

  def search() -> None:
    nonlocal count
    try:
      i = cells.index("0")
    except ValueError:
      count += 1
      return
    used = {cells[j] for j in PEERS[i]}
    for digit in "1234":
      if digit not in used:
        cells[i] = digit
        search()
        cells[i] = "0"
        if count >= limit:
          return

  search()
  return count


@functools.cache
def split_solutions(split: str, seed: int = 0, num_test: int = 88) -> tuple[str, ...]:
  """The solution grids of `split` ("train" or "test"): a seeded partition of all 288."""
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  order = np.random.default_rng(seed).permutation(NUM_GRIDS)
  grids = all_solutions()
  chosen = order[num_test:] if split == "train" else order[:num_test]
  return tuple(grids[i] for i in sorted(chosen))


def make_puzzle(solution: str, blanks: int, rng: np.random.Generator, max_tries: int = 64) -> str:
  """Blanks `blanks` cells of `solution` so that the puzzle keeps a unique solution."""
  if not 0 <= blanks <= CELLS - 4:
    # A 4x4 Sudoku needs at least 4 givens for a unique solution.
    raise ValueError(f"blanks must be in [0, {CELLS - 4}], got {blanks}")
  for _ in range(max_tries):
    cells = list(solution)
    removed = 0
    for i in rng.permutation(CELLS):
      if removed == blanks:
        break
      kept, cells[i] = cells[i], "0"
      if count_solutions("".join(cells)) == 1:
        removed += 1
      else:
        cells[i] = kept
    if removed == blanks:
      return "".join(cells)
  raise RuntimeError(f"could not blank {blanks} cells of {solution} uniquely")


def generate(
    seed: int,
    index: int,
    split: str = "train",
    blanks: int = 8,
    split_seed: int = 0,
    num_test: int = 88,
) -> dict:
  """The `index`-th puzzle of the stream for (`seed`, `split`): pure function of its args."""
  grids = split_solutions(split, split_seed, num_test)
  rng = np.random.default_rng([seed, index, 0 if split == "train" else 1])
  solution = grids[int(rng.integers(len(grids)))]
  return {"puzzle": make_puzzle(solution, blanks, rng), "solution": solution}


def generate_many(n: int, seed: int, **kwargs) -> Iterator[dict]:
  for i in range(n):
    yield generate(seed, i, **kwargs)


def extract_answer(completion: str) -> str | None:
  """The digits of the last `<answer>` tag (row separators and spaces dropped)."""
  tagged = extract.last_answer_tag(completion)
  if tagged is None:
    return None
  digits = "".join(ch for ch in tagged if ch.isdigit())
  return digits or None


def blank_accuracy(answer: str | None, puzzle: str, solution: str) -> tuple[int, int]:
  """(correctly filled blank cells, blank cells): answers are read cell by cell, in order."""
  blank_cells = [i for i, ch in enumerate(puzzle) if ch == "0"]
  if not answer:
    return 0, len(blank_cells)
  return sum(1 for i in blank_cells if i < len(answer) and answer[i] == solution[i]), len(
      blank_cells
  )


def correctness(completion: str, example: base.Example) -> float:
  correct, total = blank_accuracy(
      extract_answer(completion), example["puzzle"], example["solution"]
  )
  return correct / total if total else 0.0


def is_correct(completion: str, example: base.Example) -> bool:
  answer = extract_answer(completion)
  return answer is not None and answer[:CELLS] == example["solution"] and len(answer) == CELLS


def question(example: base.Example) -> str:
  return (
      "Solve this 4x4 Sudoku. The grid is given row by row as 16 digits, 0 for an empty "
      "cell; every row, column and 2x2 box must hold 1, 2, 3 and 4 once each. Answer with "
      f"the completed grid as 16 digits.\nPuzzle: {example['puzzle']}"
  )


def compact_question(example: base.Example) -> str:
  return f"{example['puzzle']}\n"


def reference_completion(example: base.Example) -> str:
  return f"<answer>{example['solution']}</answer>"


def unfilled_demonstration(example: base.Example, rng: np.random.Generator, unfilled: float) -> str:
  """A weaker demonstrator's answer: the solution with each blank cell of the puzzle left empty
  (`0`) with probability `unfilled`; the given cells are always copied."""
  if not 0 <= unfilled <= 1:
    raise ValueError(f"unfilled must lie in [0, 1], got {unfilled}")
  puzzle, solution = example["puzzle"], example["solution"]
  empty = rng.random(len(puzzle)) < unfilled
  answer = "".join("0" if p == "0" and e else s for p, s, e in zip(puzzle, solution, empty))
  return f"<answer>{answer}</answer>"


def from_csv_row(row: dict) -> dict:
  """d1's csv columns `Puzzle,Solution` -> an example dict, validated."""
  puzzle, solution = str(row["Puzzle"]).strip(), str(row["Solution"]).strip()
  if len(puzzle) != CELLS or not all(ch in "01234" for ch in puzzle):
    raise ValueError(f"bad puzzle {puzzle!r}")
  if not is_valid_solution(solution):
    raise ValueError(f"bad solution {solution!r}")
  if any(p != "0" and p != s for p, s in zip(puzzle, solution)):
    raise ValueError(f"solution {solution} contradicts puzzle {puzzle}")
  return {"puzzle": puzzle, "solution": solution}


TASK = base.Task.of_module("sudoku", sys.modules[__name__])
