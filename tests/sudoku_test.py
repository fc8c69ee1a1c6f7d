"""Sudoku 4x4: the 288 grids, unique puzzles (checked by an independent solver), split by grid."""

import itertools

import pytest

from stabledrl_jax.tasks import get_task, sudoku


def _independent_grids():
  """All valid grids, enumerated here from row permutations (independent of the module)."""
  return [
      "".join("".join(r) for r in rows)
      for rows in itertools.product(itertools.permutations("1234"), repeat=4)
      if all(len({r[c] for r in rows}) == 4 for c in range(4))
      and all(
          len({rows[br + r][bc + c] for r in range(2) for c in range(2)}) == 4
          for br in (0, 2)
          for bc in (0, 2)
      )
  ]


GRIDS = _independent_grids()


def _independent_solutions(puzzle):
  """Every valid grid that agrees with the puzzle's givens."""
  return [g for g in GRIDS if all(p in ("0", c) for p, c in zip(puzzle, g))]


def test_there_are_exactly_288_grids():
  assert len(GRIDS) == 288
  assert sorted(sudoku.all_solutions()) == sorted(GRIDS)


@pytest.mark.parametrize("blanks", [4, 8])
def test_puzzles_have_exactly_one_solution(blanks):
  for ex in sudoku.generate_many(20, seed=1, blanks=blanks):
    assert ex["puzzle"].count("0") == blanks
    assert _independent_solutions(ex["puzzle"]) == [ex["solution"]]


def test_hard_puzzles_are_unique_too():
  for ex in sudoku.generate_many(10, seed=0, blanks=11):
    assert _independent_solutions(ex["puzzle"]) == [ex["solution"]]


def test_split_by_solution_grid():
  train = set(sudoku.split_solutions("train"))
  test = set(sudoku.split_solutions("test"))
  assert len(train) == 200 and len(test) == 88 and not train & test
  assert train | test == set(sudoku.all_solutions())
  for ex in sudoku.generate_many(100, seed=5, split="train"):
    assert ex["solution"] in train
  for ex in sudoku.generate_many(100, seed=5, split="test"):
    assert ex["solution"] in test
  assert list(sudoku.generate_many(10, seed=5)) == list(sudoku.generate_many(10, seed=5))


EX = {"puzzle": "3102200002100320", "solution": "3142243142131324"}  # 8 blanks


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("<answer>3142243142131324</answer>", 1.0),
        ("<answer>\n3142\n2431\n4213\n1324\n</answer>", 1.0),
        ("<answer>3102200002100320</answer>", 0.0),  # the puzzle back: no blank filled
        ("<answer>3142243142131321</answer>", 7 / 8),  # one blank wrong
        ("<answer>31422431</answer>", 4 / 8),  # short: only the first 8 cells are read
        ("3142243142131324", 0.0),  # no answer tag
    ],
)
def test_partial_credit(completion, reward):
  assert sudoku.correctness(completion, EX) == pytest.approx(reward)
  assert get_task("sudoku").is_correct(completion, EX) == (reward == 1.0)


def test_bad_csv_rows_are_rejected():
  assert sudoku.from_csv_row({"Puzzle": EX["puzzle"], "Solution": EX["solution"]}) == EX
  with pytest.raises(ValueError, match="contradicts"):
    sudoku.from_csv_row({"Puzzle": "4102200002100320", "Solution": EX["solution"]})
