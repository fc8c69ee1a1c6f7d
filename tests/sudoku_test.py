"""Sudoku 4x4: the 288 grids, unique puzzles (checked by an independent solver), split by grid."""

import itertools

import numpy as np
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


def test_unfilled_demonstration_leaves_blanks_empty_at_the_given_rate():
  rng = np.random.default_rng(0)
  blanks = [i for i, ch in enumerate(EX["puzzle"]) if ch == "0"]
  empty = 0
  for _ in range(2000):
    text = sudoku.unfilled_demonstration(EX, rng, 0.3)
    assert text.startswith("<answer>") and text.endswith("</answer>")
    answer = text[len("<answer>"):-len("</answer>")]
    for i, (a, p, s) in enumerate(zip(answer, EX["puzzle"], EX["solution"])):
      # Given cells are always copied; a blank is either left "0" or filled correctly.
      assert a == s if p != "0" else a in ("0", s), (i, text)
    empty += sum(answer[i] == "0" for i in blanks)
  # 16000 Bernoulli(0.3) draws: the binomial standard deviation of the rate is 0.0036.
  assert abs(empty / (2000 * len(blanks)) - 0.3) < 0.015
  assert sudoku.unfilled_demonstration(EX, rng, 0.0) == sudoku.reference_completion(EX)
  assert sudoku.unfilled_demonstration(EX, rng, 1.0) == f"<answer>{EX['puzzle']}</answer>"
  assert sudoku.correctness(sudoku.unfilled_demonstration(EX, rng, 1.0), EX) == 0.0
  with pytest.raises(ValueError, match="1.5"):
    sudoku.unfilled_demonstration(EX, rng, 1.5)
