"""Data sources of the tasks: in memory for generated ones, TFDS builders over local files.

Generated tasks (Countdown, Sudoku) come from their seeded generators, in memory; GSM8K, MATH500
and d1's Countdown/Sudoku test files are TFDS builders (array_record files, no TensorFlow) over
local files (paths come from the config; nothing is downloaded). `load_source(...)` returns a
random-access source of example dicts for Grain (a file builder is prepared once under
`data_dir`, in a folder keyed by what it is built from: `cache_key`).
"""

from __future__ import annotations

import dataclasses
import csv
import hashlib
import io
import json
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import numpy as np
from etils import epath
from etils.epath import Path  # local paths and buckets (gs://) alike
import tensorflow_datasets as tfds
from tensorflow_datasets.core import hashing as tfds_hashing

from stabledrl_jax.tasks import TASKS as BUILT_IN
from stabledrl_jax.tasks import base, countdown, gsm8k, math500, sorting, sudoku

_TEXT = tfds.features.Text
_VERSION = tfds.core.Version("1.0.0")


def read_jsonl(path: Path, parse: Callable[[dict], dict]) -> Iterator[dict]:
  """Parsed records of a jsonl file; a bad line (not UTF-8, not JSON, not a record) fails naming
  the file and line number."""
  with epath.Path(path).open("rb") as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
        if not line.strip():
          continue
        yield parse(json.loads(line))
      except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path}, line {lineno}: malformed record ({e})") from None


def read_sudoku_csv(path: Path) -> Iterator[dict]:
  """d1's `Puzzle,Solution` csv; a bad row (or bytes that are not UTF-8) fails naming the file
  and line number."""
  data = epath.Path(path).read_bytes()
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b"\n") + 1
    raise ValueError(f"{path}, line {line}: malformed row ({e})") from None
  reader = csv.DictReader(io.StringIO(text, newline=""))
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


# Generated tasks live in memory (a few thousand small dicts): no files, no TFDS preparation.
# Their order is the one the TFDS builders they replace wrote (records sorted by TFDS's salted
# hash of their index), so the same seed gives the same examples in the same order as before.
GENERATOR_DEFAULTS = {
    "countdown": dict(num_train=10_000, num_test=256, seed=0, target_min=1, target_max=100),
    "sorting": dict(num_train=10_000, num_test=256, seed=0, length=8),
    "sudoku": dict(num_train=10_000, num_test=500, blanks=8, seed=0, split_seed=0,
                   num_test_grids=88),
}


def generated_examples(task: str, split: str, **config: Any) -> list[dict]:
  """`split` ("train" or "test") of a generated task; `config` overrides GENERATOR_DEFAULTS.

  Countdown's train and test streams use different seeds; Sudoku's test puzzles come only from
  held-out solution grids, and sorting's test instances only from held-out answers.
  """
  if task not in GENERATOR_DEFAULTS:
    raise ValueError(f"task {task!r} has no generator; use source='local'")
  unknown = sorted(set(config) - set(GENERATOR_DEFAULTS[task]))
  if unknown:
    raise ValueError(f"unknown generator setting(s) {unknown} for {task}")
  if split not in ("train", "test"):
    raise ValueError(f"unknown split {split!r} of generated {task}; expected 'train' or 'test'")
  c = {**GENERATOR_DEFAULTS[task], **config}
  n = c["num_train"] if split == "train" else c["num_test"]
  if task == "countdown":
    seed = 2 * c["seed"] + (split == "test")
    examples = list(countdown.generate_many(n, seed, (c["target_min"], c["target_max"])))
  elif task == "sorting":
    examples = [sorting.generate(c["seed"], i, split, c["length"]) for i in range(n)]
  else:
    examples = list(sudoku.generate_many(n, c["seed"], split=split, blanks=c["blanks"],
                                         split_seed=c["split_seed"], num_test=c["num_test_grids"]))
  hasher = tfds_hashing.Hasher(salt=split)
  order = sorted(range(n), key=hasher.hash_key)
  return [examples[i] for i in order]


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
    i = -1
    for i, ex in enumerate(self._read(path)):
      yield i, ex
    if i < 0:
      raise ValueError(f"{path}: no examples (an empty split)")

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
    source: str = "local",
    source_dir: str | Path | None = None,
    **config: Any,
) -> tfds.core.DatasetBuilder:
  """The file builder for `task` ("countdown", "sudoku", "gsm8k", "math500").

  `source` is "local" (the task's files in `source_dir`) or "public" (gsm8k only, needs the
  network); generated tasks have no builder (`generated_examples`).
  """
  kwargs = dict(data_dir=str(data_dir), file_format="array_record")
  if config:
    raise ValueError(f"generator settings {sorted(config)} given for source={source!r}")
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


def task_examples(task: base.Task, split: str, *, source: str, source_dir: str | Path = "",
                  num_train: int = 0, num_test: int = 0, seed: int = 0) -> list[dict]:
  """`split` of a task defined outside the package (or `jsonl`), in memory: its `generate`
  (source 'generated') or `source_dir/{split}.jsonl` through its `from_record` (source 'local')."""
  if source == "generated":
    if task.generate is None:
      raise ValueError(f"config.task.source='generated': task {task.name!r} has no generate(); "
                       "set task.source=local and task.source_dir to its JSONL files")
    n = num_train if split == "train" else num_test
    return [dict(ex) for ex in task.generate(split, n, seed)]
  if source != "local":
    raise ValueError(f"config.task.source={source!r}: task {task.name!r} reads 'generated' or "
                     "'local'")
  path = Path(source_dir) / f"{split}.jsonl"
  if not path.is_file():
    raise FileNotFoundError(f"{task.name}: missing data file {path} (config.task.source_dir)")
  examples = list(read_jsonl(path, task.from_record or dict))
  if not examples:
    raise ValueError(f"{path}: no examples (an empty split)")
  return examples


def cache_key(task: str, source: str, source_dir: str | Path | None) -> dict[str, Any]:
  """What a task's prepared files are built from: the task, its source, the source folder and
  the content hash of each of its files (so edited or other files make another key)."""
  key: dict[str, Any] = {"task": task, "source": source, "version": str(_VERSION)}
  if source == "local" and source_dir is not None:
    folder = epath.Path(source_dir)
    folder = folder if "://" in str(folder) else folder.resolve()  # a bucket's path is absolute
    key["source_dir"] = str(folder)
    key["files"] = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
                    for path in sorted(folder.iterdir()) if path.is_file()}
  return key


def keyed_data_dir(data_dir: str | Path, key: dict[str, Any]) -> epath.Path:
  """`data_dir/<task>-<source>-<hash of key>`, holding `source.json` (the key): two sources never
  share prepared files, whatever `data_dir` they are given."""
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
  folder = epath.Path(data_dir) / f"{key['task']}-{key['source']}-{digest}"
  folder.mkdir(parents=True, exist_ok=True)
  record = folder / "source.json"
  if not record.exists():
    record.write_text(json.dumps(key, indent=2, sort_keys=True))
  return folder


def load_source(task: str | base.Task, split: str, *, source: str = "generated",
                data_dir: str | Path = "", **kwargs: Any) -> Any:
  """`split` of `task` (a built-in's name, or a `Task`) as a random-access source for Grain.

  Generated tasks (`source="generated"`, `kwargs` overriding the generator settings) are built in
  memory, as are tasks defined outside the package (`task_examples`); the built-in tasks' files
  are TFDS builders, prepared once under `data_dir` in a folder of their own (`keyed_data_dir`).
  """
  if not isinstance(task, str):
    built_in = BUILT_IN.get(task.name)  # the same task, its SFT demonstrator aside
    if built_in is None or dataclasses.replace(task, demonstrate=built_in.demonstrate) != built_in:
      return task_examples(task, split, source=source, **kwargs)
    task = task.name
  if source == "generated":
    return generated_examples(task, split, **kwargs)
  tfds.disable_progress_bar()
  data_dir = keyed_data_dir(data_dir, cache_key(task, source, kwargs.get("source_dir")))
  builder = make_builder(task, data_dir=data_dir, source=source, **kwargs)
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return DecodedSource(builder.as_data_source(split=split))
