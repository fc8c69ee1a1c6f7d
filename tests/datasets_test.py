"""TFDS builders (array_record, no TensorFlow) and Grain pipelines over them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stabledrl_jax.tasks import datasets, get_task, pipeline, sudoku
from stabledrl_jax.tasks.tokenizer import CharTokenizer

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data absent at {DATA}")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


@needs_data
@pytest.mark.parametrize(
    "task, split, raw_file, count",
    [
        ("gsm8k", "test", "gsm8k/test.jsonl", 1319),
        ("math500", "test", "math500/test.jsonl", 500),
        ("countdown", "test", "countdown/test.jsonl", 256),
        ("sudoku", "test", "sudoku/test.csv", 500),
    ],
)
def test_local_builders_hold_every_record(data_dir, task, split, raw_file, count):
  source = datasets.load_source(
      task, split, data_dir=data_dir, source="local", source_dir=DATA / task
  )
  assert len(source) == count
  examples = [source[i] for i in range(len(source))]
  raw = (DATA / raw_file).read_text().splitlines()
  if task == "gsm8k":
    expected = {
        (r["question"], r["answer"].split("####")[-1].strip().replace(",", ""))
        for r in map(json.loads, raw)
    }
    assert {(e["question"], e["answer"]) for e in examples} == expected
  elif task == "math500":
    expected = {(r["problem"], r["answer"]) for r in map(json.loads, raw)}
    assert {(e["question"], e["answer"]) for e in examples} == expected
  elif task == "countdown":
    expected = sorted((r["input"], int(r["output"])) for r in map(json.loads, raw))
    assert sorted((",".join(map(str, e["numbers"])), e["target"]) for e in examples) == expected
  else:
    expected = sorted(tuple(line.split(",")) for line in raw[1:])
    assert sorted((e["puzzle"], e["solution"]) for e in examples) == expected


def test_malformed_lines_name_file_and_line(tmp_path, data_dir):
  bad = tmp_path / "gsm8k"
  bad.mkdir()
  good = json.dumps({"question": "q", "answer": "x #### 3"})
  (bad / "train.jsonl").write_text(good + "\n")
  (bad / "test.jsonl").write_text(good + "\n" + good + "\n{not json\n")
  with pytest.raises(ValueError, match=r"test\.jsonl, line 3"):
    list(datasets.read_jsonl(bad / "test.jsonl", lambda r: r))
  (bad / "test.jsonl").write_bytes(good.encode() + b"\n\xff\xfe not utf-8\n")
  with pytest.raises(ValueError, match=r"test\.jsonl, line 2: malformed record \('utf-8'"):
    list(datasets.read_jsonl(bad / "test.jsonl", lambda r: r))
  (bad / "test.jsonl").write_text(good + "\n" + json.dumps({"question": "q"}) + "\n")
  with pytest.raises(ValueError, match=r"test\.jsonl, line 2"):
    datasets.load_source("gsm8k", "test", data_dir=tmp_path / "out", source="local", source_dir=bad)
  csv_file = tmp_path / "sudoku.csv"
  csv_file.write_text("Puzzle,Solution\n3102200002100320,3142243142131324\n31,3142\n")
  with pytest.raises(ValueError, match=r"sudoku\.csv, line 3"):
    list(datasets.read_sudoku_csv(csv_file))
  csv_file.write_bytes(b"Puzzle,Solution\n3102200002100320,3142243142131324\n\xff,3142\n")
  with pytest.raises(ValueError, match=r"sudoku\.csv, line 3: malformed row \('utf-8'"):
    list(datasets.read_sudoku_csv(csv_file))


def test_one_cache_dir_serves_each_source_its_own_examples(tmp_path):
  def write(folder, questions):
    folder.mkdir()
    for split in ("train", "test"):
      (folder / f"{split}.jsonl").write_text("".join(
          json.dumps({"question": q, "answer": f"#### {i}"}) + "\n" for i, q in enumerate(questions)))

  write(tmp_path / "a", ["qa1", "qa2"])
  write(tmp_path / "b", ["qb1"])
  cache = tmp_path / "cache"

  def questions(folder):
    source = datasets.load_source("gsm8k", "test", data_dir=cache, source="local",
                                  source_dir=folder)
    return sorted(source[i]["question"] for i in range(len(source)))

  assert questions(tmp_path / "a") == ["qa1", "qa2"]
  assert questions(tmp_path / "b") == ["qb1"]
  assert questions(tmp_path / "a") == ["qa1", "qa2"]
  write(tmp_path / "a2", ["qa3"])
  (tmp_path / "a").rename(tmp_path / "old")
  (tmp_path / "a2").rename(tmp_path / "a")  # the same folder, edited files
  assert questions(tmp_path / "a") == ["qa3"]
  (tmp_path / "a" / "train.jsonl").write_text("\n")
  with pytest.raises(ValueError, match=r"a/train\.jsonl: no examples"):
    questions(tmp_path / "a")


def test_missing_file_and_offline_public_builder_fail_clearly(tmp_path):
  with pytest.raises(FileNotFoundError, match="test.jsonl"):
    datasets.load_source("math500", "test", data_dir=tmp_path, source="local", source_dir=tmp_path)
  # Offline (forced, so the test never waits on network retries): a clear error.
  code = (
      "from stabledrl_jax.tasks import datasets\n"
      f"datasets.make_builder('gsm8k', data_dir={str(tmp_path)!r}, source='public')"
  )
  env = {
      **os.environ,
      "HF_HUB_OFFLINE": "1",
      "HF_DATASETS_OFFLINE": "1",
      "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
  }
  result = subprocess.run(
      [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  assert result.returncode != 0
  assert "RuntimeError: the public GSM8K builder needs network access" in result.stderr


@pytest.fixture(scope="module")
def sudoku_train(data_dir):
  return datasets.load_source(
      "sudoku", "train", data_dir=data_dir, num_train=96, num_test=8, blanks=6
  )


def test_generated_builder_keeps_the_split(sudoku_train, data_dir):
  held_out = set(sudoku.split_solutions("test"))
  assert len(sudoku_train) == 96
  assert all(sudoku_train[i]["solution"] not in held_out for i in range(96))
  test = datasets.load_source(
      "sudoku", "test", data_dir=data_dir, num_train=96, num_test=8, blanks=6
  )
  assert all(test[i]["solution"] in held_out for i in range(8))


def _batches(source, n, **kwargs):
  task, tok = get_task("sudoku"), CharTokenizer()
  ds = pipeline.prompt_batches(
      task, source, tok, batch_size=8, seed=kwargs.pop("seed", 0), max_prompt_len=20, **kwargs
  )
  it = iter(ds)
  return [next(it) for _ in range(n)], it


def _puzzles(batch):
  return [e["puzzle"] for e in batch["examples"]]


def test_same_seed_same_batches(sudoku_train):
  a, _ = _batches(sudoku_train, 5)
  b, _ = _batches(sudoku_train, 5)
  c, _ = _batches(sudoku_train, 5, seed=1)
  assert [_puzzles(x) for x in a] == [_puzzles(x) for x in b]
  assert [_puzzles(x) for x in a] != [_puzzles(x) for x in c]
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["prompt_ids_BxP"], y["prompt_ids_BxP"])


def test_prompt_ids_decode_to_the_examples(sudoku_train):
  (batch,), _ = _batches(sudoku_train, 1)
  tok = CharTokenizer()
  ids, mask = batch["prompt_ids_BxP"], batch["prompt_mask_BxP"]
  assert ids.shape == mask.shape == (8, 20) and ids.dtype == np.int32
  for row, m, ex in zip(ids, mask, batch["examples"]):
    assert row[m][0] == tok.bos_id and not m[0]  # left-padded, bos first
    assert tok.decode(row[m]) == ex["puzzle"] + "\n"


def test_resume_from_checkpoint_continues_exactly(sudoku_train):
  # 96 examples / 8 = 12 batches an epoch: 20 batches cross an epoch boundary.
  full, _ = _batches(sudoku_train, 20)
  head, it = _batches(sudoku_train, 7)
  state = json.loads(json.dumps(it.get_state()))  # the state survives a JSON checkpoint
  _, fresh = _batches(sudoku_train, 0)
  fresh.set_state(state)
  resumed = [next(fresh) for _ in range(13)]
  assert [_puzzles(x) for x in head + resumed] == [_puzzles(x) for x in full]


def test_processes_read_disjoint_slices_of_the_same_global_batches(sudoku_train):
  whole, _ = _batches(sudoku_train, 14)  # 96 / 8 = 12 batches an epoch: crosses into the second
  parts = [_batches(sudoku_train, 14, rows=rows) for rows in ((0, 3), (3, 8))]
  for b, (x, y) in enumerate(zip(parts[0][0], parts[1][0])):
    assert len(x["examples"]) == 3 and len(y["examples"]) == 5
    assert _puzzles(x) + _puzzles(y) == _puzzles(whole[b])
    np.testing.assert_array_equal(np.concatenate([x["prompt_ids_BxP"], y["prompt_ids_BxP"]]),
                                  whole[b]["prompt_ids_BxP"])
  # Each process's iterator resumes from its own state.
  _, it = _batches(sudoku_train, 0, rows=(3, 8))
  it.set_state(json.loads(json.dumps(parts[1][1].get_state())))
  again, _ = _batches(sudoku_train, 15, rows=(3, 8))
  assert _puzzles(next(it)) == _puzzles(again[-1])


def test_rows_outside_the_batch_are_an_error(sudoku_train):
  with pytest.raises(ValueError, match=r"rows \(4, 9\)"):
    pipeline.make_dataset(sudoku_train, batch_size=8, seed=0, rows=(4, 9))


def test_completions_are_cut_at_eos():
  tok = CharTokenizer()
  ids = np.array(
      [
          tok.encode("<answer>12</answer>") + [tok.eos_id] + tok.encode("99"),
          tok.encode("7") + [tok.pad_id] * 6,
      ],
      dtype=np.int32,
  )
  assert pipeline.decode_completions(tok, ids[:1]) == ["<answer>12</answer>"]
  assert pipeline.decode_completions(tok, ids[1:]) == ["7"]


def test_built_without_tensorflow(sudoku_train):
  # Runs after the builders above: preparing and reading never imported TensorFlow.
  assert "tensorflow" not in sys.modules


def test_generated_tasks_are_in_memory_in_the_order_tfds_wrote(tmp_path, capfd):
  # The in-memory source keeps the examples and order of the TFDS builder it replaced: a builder
  # over the same generator, written here, is the reference.
  import tensorflow_datasets as tfds

  class ReferenceSudoku(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      text = tfds.features.Text()
      features = tfds.features.FeaturesDict({"puzzle": text, "solution": text})
      return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
      return {split: self._generate_examples(split) for split in ("train", "test")}

    def _generate_examples(self, split):
      n = 40 if split == "train" else 6
      yield from enumerate(
          sudoku.generate_many(n, 3, split=split, blanks=5, split_seed=0, num_test=88))

  tfds.disable_progress_bar()
  builder = ReferenceSudoku(data_dir=str(tmp_path / "ref"), file_format="array_record")
  builder.download_and_prepare()
  capfd.readouterr()
  for split in ("train", "test"):
    ref = builder.as_data_source(split=split)
    expected = [datasets.decode_example(ref[i]) for i in range(len(ref))]
    got = datasets.load_source("sudoku", split, data_dir=tmp_path / "ours", num_train=40,
                               num_test=6, blanks=5, seed=3)
    assert got == expected
  out = capfd.readouterr()
  assert "Downloading and preparing" not in out.out + out.err
  assert "custom data configuration" not in out.out + out.err
  assert not (tmp_path / "ours").exists()  # nothing written
