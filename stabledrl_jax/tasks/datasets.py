"""TFDS dataset builders (array_record files, no TensorFlow) for the four tasks.

Generated tasks (Countdown, Sudoku) are built from their seeded generators; GSM8K, MATH500 and
d1's Countdown/Sudoku test files are built from local files (paths come from the config; nothing
is downloaded). `load_source(...)` prepares a builder once under `data_dir` and returns a
random-access data source of decoded example dicts for Grain.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from stabledrl_jax.tasks import countdown, gsm8k, math500, sudoku

_TEXT = tfds.features.Text
_VERSION = tfds.core.Version("1.0.0")


def read_jsonl(path: Path, parse: Callable[[dict], dict]) -> Iterator[dict]:
  """Parsed records of a jsonl file; a bad line fails naming the file and line number."""
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        yield parse(json.loads(line))
      except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}, line {lineno}: malformed record ({e})") from None


def read_sudoku_csv(path: Path) -> Iterator[dict]:
  """d1's `Puzzle,Solution` csv; a bad row fails naming the file and line number."""
  with open(path, encoding="utf-8", newline="") as f:
    reader = csv.DictReader(f)
    for row in reader:
      try:
        yield sudoku.from_csv_row(row)
      except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}, line {reader.line_num}: malformed row ({e})") from None


def _countdown_features() -> tfds.features.FeaturesDict:
  return tfds.features.FeaturesDict(
      {
          "numbers": tfds.features.Tensor(shape=(3,), dtype=np.int32),
          "target": np.int32,
          "solution": _TEXT(),
      }
  )


@dataclasses.dataclass
class CountdownConfig(tfds.core.BuilderConfig):
  num_train: int = 10_000
  num_test: int = 256
  seed: int = 0
  target_min: int = 1
  target_max: int = 100


class GeneratedCountdown(tfds.core.GeneratorBasedBuilder):
  """Countdown from the seeded generator; train and test streams use different seeds."""

  VERSION = _VERSION
  BUILDER_CONFIGS = [CountdownConfig(name="default")]

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(builder=self, features=_countdown_features())

  def _split_generators(self, dl_manager):
    c = self.builder_config
    return {
        "train": self._generate_examples(c.num_train, 2 * c.seed),
        "test": self._generate_examples(c.num_test, 2 * c.seed + 1),
    }

  def _generate_examples(self, n: int, seed: int):
    c = self.builder_config
    for i, ex in enumerate(countdown.generate_many(n, seed, (c.target_min, c.target_max))):
      yield i, ex


@dataclasses.dataclass
class SudokuConfig(tfds.core.BuilderConfig):
  num_train: int = 10_000
  num_test: int = 500
  blanks: int = 8
  seed: int = 0
  split_seed: int = 0  # which grids are held out
  num_test_grids: int = 88


class GeneratedSudoku(tfds.core.GeneratorBasedBuilder):
  """4x4 Sudoku from the generator; test puzzles come only from held-out solution grids."""

  VERSION = _VERSION
  BUILDER_CONFIGS = [SudokuConfig(name="default")]

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, features=tfds.features.FeaturesDict({"puzzle": _TEXT(), "solution": _TEXT()})
    )

  def _split_generators(self, dl_manager):
    c = self.builder_config
    return {
        "train": self._generate_examples("train", c.num_train),
        "test": self._generate_examples("test", c.num_test),
    }

  def _generate_examples(self, split: str, n: int):
    c = self.builder_config
    for i, ex in enumerate(
        sudoku.generate_many(
            n,
            c.seed,
            split=split,
            blanks=c.blanks,
            split_seed=c.split_seed,
            num_test=c.num_test_grids,
        )
    ):
      yield i, ex


class _LocalFileBuilder(tfds.core.GeneratorBasedBuilder):
  """A builder over files in `source_dir` (one split per file); nothing is downloaded."""

  VERSION = _VERSION
  SPLIT_FILES: dict[str, str] = {}

  def __init__(self, *, source_dir: str | Path, **kwargs: Any):
    self.source_dir = Path(source_dir)
    super().__init__(**kwargs)

  def _split_generators(self, dl_manager):
    splits = {}
    for split, name in self.SPLIT_FILES.items():
      path = self.source_dir / name
      if not path.is_file():
        raise FileNotFoundError(f"{self.name}: missing data file {path}")
      splits[split] = self._generate_examples(path)
    return splits

  def _generate_examples(self, path: Path):
    for i, ex in enumerate(self._read(path)):
      yield i, ex

  def _read(self, path: Path) -> Iterator[dict]:
    raise NotImplementedError


class LocalGsm8k(_LocalFileBuilder):
  """GSM8K from `gsm8k/{train,test}.jsonl` (`question`, `answer` with `#### final`)."""

  SPLIT_FILES = {"train": "train.jsonl", "test": "test.jsonl"}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
            {"question": _TEXT(), "answer": _TEXT(), "reasoning": _TEXT()}
        ),
    )

  def _read(self, path: Path) -> Iterator[dict]:
    return read_jsonl(path, gsm8k.from_record)


class LocalMath500(_LocalFileBuilder):
  """MATH500 from `math500/test.jsonl` (`problem`, `answer`)."""

  SPLIT_FILES = {"test": "test.jsonl"}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, features=tfds.features.FeaturesDict({"question": _TEXT(), "answer": _TEXT()})
    )

  def _read(self, path: Path) -> Iterator[dict]:
    return read_jsonl(path, math500.from_record)


class LocalCountdown(_LocalFileBuilder):
  """d1's Countdown test set, `countdown/test.jsonl` (`input` "a,b,c", `output` target)."""

  SPLIT_FILES = {"test": "test.jsonl"}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(builder=self, features=_countdown_features())

  def _read(self, path: Path) -> Iterator[dict]:
    def parse(record: dict) -> dict:
      ex = countdown.from_record(record)
      # "" where no expression using all three numbers reaches the target.
      ex["solution"] = countdown.reachable(ex["numbers"]).get(Fraction(ex["target"]), "")
      return ex

    return read_jsonl(path, parse)


class LocalSudoku(_LocalFileBuilder):
  """d1's Sudoku test set, `sudoku/test.csv` (`Puzzle,Solution`)."""

  SPLIT_FILES = {"test": "test.csv"}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, features=tfds.features.FeaturesDict({"puzzle": _TEXT(), "solution": _TEXT()})
    )

  def _read(self, path: Path) -> Iterator[dict]:
    return read_sudoku_csv(path)


def public_gsm8k_builder(data_dir: str | Path) -> tfds.core.DatasetBuilder:
  """The public GSM8K (through TFDS's Hugging Face bridge); needs the network to prepare."""
  try:
    builder = tfds.builder(
        "huggingface:gsm8k/main", data_dir=str(data_dir), file_format="array_record"
    )
    builder.download_and_prepare()
  except Exception as e:  # offline, or the bridge's extra dependencies are absent
    raise RuntimeError(
        "the public GSM8K builder needs network access (and the `datasets` package); "
        f"use source='local' with gsm8k/{{train,test}}.jsonl instead. Cause: {e!r}"
    ) from e
  return builder


class DecodedSource:
  """A random-access source of example dicts with `str` text and Python ints/lists."""

  def __init__(self, source: Any):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> dict:
    return decode_example(self._source[index])


def decode_example(raw: dict) -> dict:
  out = {}
  for key, value in raw.items():
    if isinstance(value, bytes):
      out[key] = value.decode("utf-8")
    elif isinstance(value, np.ndarray):
      out[key] = value.tolist()
    elif isinstance(value, np.generic):
      out[key] = value.item()
    else:
      out[key] = value
  return out


def make_builder(
    task: str,
    *,
    data_dir: str | Path,
    source: str = "generated",
    source_dir: str | Path | None = None,
    **config: Any,
) -> tfds.core.DatasetBuilder:
  """The builder for `task` ("countdown", "sudoku", "gsm8k", "math500").

  `source` is "generated" (countdown/sudoku, with `config` overriding the generator settings),
  "local" (files in `source_dir`: the task's folder under `../shared/data`), or "public"
  (gsm8k only, needs the network).
  """
  kwargs = dict(data_dir=str(data_dir), file_format="array_record")
  if config and source != "generated":
    raise ValueError(f"generator settings {sorted(config)} given for source={source!r}")
  if source == "generated":
    if task == "countdown":
      cfg = CountdownConfig(name=_config_name(config), **config)
      return GeneratedCountdown(config=cfg, **kwargs)
    if task == "sudoku":
      return GeneratedSudoku(config=SudokuConfig(name=_config_name(config), **config), **kwargs)
    raise ValueError(f"task {task!r} has no generator; use source='local'")
  if source == "local":
    if source_dir is None:
      raise ValueError("source='local' needs source_dir")
    local = {
        "gsm8k": LocalGsm8k,
        "math500": LocalMath500,
        "countdown": LocalCountdown,
        "sudoku": LocalSudoku,
    }
    if task not in local:
      raise ValueError(f"unknown task {task!r}")
    return local[task](source_dir=source_dir, **kwargs)
  if source == "public" and task == "gsm8k":
    return public_gsm8k_builder(data_dir)
  raise ValueError(f"unknown source {source!r} for task {task!r}")


def _config_name(config: dict) -> str:
  # Each distinct generator setting gets its own directory, so a cache is never stale.
  return "_".join(f"{k}{v}" for k, v in sorted(config.items())) or "default"


def load_source(task: str, split: str, **kwargs: Any) -> DecodedSource:
  """Prepares (once) and opens `split` of `task` as a random-access source for Grain."""
  tfds.disable_progress_bar()
  builder = make_builder(task, **kwargs)
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return DecodedSource(builder.as_data_source(split=split))
