"""Tasks defined outside the package: by import path, and the generic JSONL task."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stabledrl_jax import config_lib
from stabledrl_jax.tasks import base, datasets, from_config, get_task

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"

# The smallest run of the whole path: SFT, RL and evaluation, a few steps each.
TINY = ("--config.model.n_layers=1", "--config.model.d_model=32", "--config.model.n_heads=2",
        "--config.model.n_kv_heads=2", "--config.model.mlp_dim=64", "--config.sft.steps=2",
        "--config.sft.batch_size=8", "--config.rl.steps=2", "--config.rl.prompts_per_step=2",
        "--config.rl.group_size=2", "--config.sampler.gen_length=8", "--config.sampler.steps=2",
        "--config.task.num_train=16", "--config.task.num_test=4", "--config.eval.num_examples=4",
        "--config.eval.every=2", "--config.eval.batch_size=4")


def run_main(workdir, *overrides, pythonpath=""):
  env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "stabledrl_jax.main", "--config=configs/sdar.py",
                         f"--workdir={workdir}", *TINY, *overrides], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_readme_example_task_trains(tmp_path):
  out = run_main(tmp_path, "--config.task.name=my_task:TASK", pythonpath=str(REPO / "examples"))
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [0, 1, 2, 3]  # 2 SFT steps, then 2 RL steps
  assert (tmp_path / "eval.jsonl").read_text().strip()
  assert "warning" not in out.stdout + out.stderr  # the tiny run's defaults are not warned about


@pytest.mark.parametrize("name, message", [
    ("no_such_module:TASK", "cannot import module 'no_such_module'"),
    ("json:TASK", "module 'json' defines no TASK"),
    ("json:dumps", "function is not a stabledrl_jax.tasks.Task"),
])
def test_bad_import_paths_fail_in_one_line(name, message):
  with pytest.raises(ValueError, match=message):
    get_task(name)


def test_main_reports_a_bad_task_path_in_one_line(tmp_path):
  out = run_main(tmp_path, "--config.task.name=json:TASK")
  assert out.returncode != 0
  assert out.stderr.strip().splitlines()[-1] == (
      "error: config.task.name='json:TASK': module 'json' defines no TASK")


def task_config(**kw):
  c = config_lib.base_config("sdar").task
  c.update(dict(name="jsonl", source="local", **kw))
  return c


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_jsonl_task_reads_the_fields_and_checks_numbers(tmp_path):
  write_jsonl(tmp_path / "train.jsonl", [{"q": "1+1?", "gold": "2"}, {"q": "2*3?", "gold": "6"}])
  write_jsonl(tmp_path / "test.jsonl", [{"q": "9-4?", "gold": "5", "extra": 1}])
  task = from_config(task_config(prompt_field="q", answer_field="gold"))
  train = datasets.load_source(task, "train", source="local", source_dir=tmp_path)
  assert train == [{"question": "1+1?", "answer": "2"}, {"question": "2*3?", "answer": "6"}]
  (ex,) = datasets.load_source(task, "test", source="local", source_dir=tmp_path)
  assert task.reward("so it is <answer>5</answer>", ex) == 1.0
  assert task.reward("<answer>4</answer>", ex) == 0.0
  assert task.prompt(ex, "compact") == "9-4?\n"


def test_jsonl_line_without_the_prompt_field_names_file_and_line(tmp_path):
  write_jsonl(tmp_path / "train.jsonl", [{"question": "a", "answer": "1"}, {"answer": "2"}])
  task = from_config(task_config())
  with pytest.raises(ValueError, match=r"train.jsonl, line 2: .*no field 'question' "
                                       r"\(config.task.prompt_field\)"):
    datasets.load_source(task, "train", source="local", source_dir=tmp_path)


def test_jsonl_checkers_math_and_import_path(tmp_path, monkeypatch):
  task = from_config(task_config(checker="math"))
  half = {"question": "", "answer": "1/2"}
  assert task.reward("<answer>\\boxed{\\frac{1}{2}}</answer>", half) == 1.0
  (tmp_path / "my_checker.py").write_text(
      "def exact(completion, example):\n  return float(completion.strip() == example['answer'])\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  task = from_config(task_config(checker="my_checker:exact"))
  assert task.reward(" 7 ", {"question": "", "answer": "7"}) == 1.0
  assert not task.is_correct("8", {"question": "", "answer": "7"})
  with pytest.raises(ValueError, match="config.task.checker='nope': expected one of"):
    from_config(task_config(checker="nope"))
  with pytest.raises(ValueError, match="'my_checker:missing': module 'my_checker' defines no"):
    from_config(task_config(checker="my_checker:missing"))


def test_number_checker_reads_the_gold_fields_last_number():
  task = from_config(task_config())
  gsm8k_style = {"question": "", "answer": "She pays 3 * 6 = 18.\n#### 1,018"}
  assert task.reward("<answer>$1,018</answer>", gsm8k_style) == 1.0
  assert task.reward("<answer>18</answer>", gsm8k_style) == 0.0


@pytest.mark.skipif(not GSM8K.is_dir(), reason="shared data absent")
def test_training_reads_a_jsonl_task_from_local_files(tmp_path):
  from stabledrl_jax import build
  from stabledrl_jax.tasks.tokenizer import CharTokenizer

  c = config_lib.base_config("sdar")
  c.task.update(dict(name="jsonl", source="local", source_dir=str(GSM8K), max_prompt_len=1000))
  c.rl.prompts_per_step, c.rl.group_size, c.eval.num_examples = 2, 2, 3
  c.sft.steps = 0  # GSM8K's worked answers are far longer than the tiny model's completions
  config_lib.validate(c)
  data = build.data(c, CharTokenizer(), str(tmp_path))
  first = json.loads((GSM8K / "test.jsonl").read_text().splitlines()[0])
  assert data.test[0] == {"question": first["question"], "answer": first["answer"]}
  batch = next(data.rl)
  assert batch["prompt_ids_BxP"].shape == (2, 1000)
  gold = first["answer"].split("####")[-1].strip()
  assert data.reward_fn(f"<answer>{gold}</answer>", data.test[0]) == 1.0


CHECKERS = """
import math
calls = [0]
def nan_every_third(completion, example):
  calls[0] += 1
  return math.nan if calls[0] % 3 == 0 else 0.0
def seven_and_a_half(completion, example):
  return 7.5
def none(completion, example):
  return None
def strict(completion, example):
  return float(int(completion.split("<answer>")[1].split("</answer>")[0]) == int(example["answer"]))
"""


@pytest.fixture
def checkers(tmp_path, monkeypatch):
  (tmp_path / "checkers.py").write_text(CHECKERS)
  monkeypatch.syspath_prepend(str(tmp_path))
  return tmp_path


def test_invalid_rewards_fail_naming_task_example_and_completion(checkers):
  ex = {"question": "9-4?", "answer": "5"}
  seven = from_config(task_config(checker="checkers:seven_and_a_half"))
  with pytest.raises(base.RewardError, match=r"task 'jsonl', reward 'correctness', example "
                     r"\{'question': '9-4\?', 'answer': '5'\}, completion 'out': returned 7\.5, "
                     r"outside \[0, 1\]"):
    seven.reward("out", ex)
  clipped = seven.reward_fn(on_invalid="clip")
  assert clipped("out", ex) == 1.0 and clipped("out", ex) == 1.0 and clipped.invalid == 2
  nan = from_config(task_config(checker="checkers:nan_every_third")).reward_fn(on_invalid="clip")
  assert [nan("x", ex) for _ in range(3)] == [0.0, 0.0, 0.0] and nan.invalid == 1
  none = from_config(task_config(checker="checkers:none")).reward_fn(on_invalid="clip")
  with pytest.raises(base.RewardError, match="completion 'x': returned None, not a number"):
    none("x", ex)  # a non-number is never clipped


def test_a_bad_checker_is_found_by_grading_references_and_malformed_completions(checkers):
  examples = [{"question": f"{i}+0?", "answer": str(i)} for i in range(3)]
  task = from_config(task_config(checker="checkers:nan_every_third"))
  with pytest.raises(base.RewardError, match="returned nan"):
    base.check_reward(task, task.reward_fn(), examples)
  task = from_config(task_config(checker="checkers:strict"))  # raises on a completion without tags
  with pytest.raises(base.RewardError, match=r"completion '': raised IndexError"):
    base.check_reward(task, task.reward_fn(), examples)
  task = from_config(task_config())
  assert base.check_reward(task, task.reward_fn(), examples) == (3, 3)  # references correct


def test_main_stops_on_a_nan_checker_before_training(tmp_path, checkers):
  data = tmp_path / "data"
  data.mkdir()
  for split in ("train", "test"):
    write_jsonl(data / f"{split}.jsonl", [{"question": f"{i}", "answer": str(i)} for i in range(8)])
  out = run_main(tmp_path / "run", "--config.task.name=jsonl", "--config.task.source=local",
                 f"--config.task.source_dir={data}", "--config.task.checker=checkers:nan_every_third",
                 pythonpath=str(checkers))
  assert out.returncode == 1
  assert re.fullmatch(r"error: task 'jsonl', reward 'correctness', example \{'question': '\d', "
                      r"'answer': '\d'\}, completion .*: returned nan, outside \[0, 1\] .*",
                      out.stderr.strip().splitlines()[-1])
  assert not (tmp_path / "run" / "metrics.jsonl").exists()
