"""A task of your own, outside the package: add two numbers. Train on it (from the repo root):

  PYTHONPATH=examples python -m stabledrl_jax.main --config=configs/sdar.py \
      --config.task.name=my_task:TASK --workdir=runs/my_task
"""
import random

from stabledrl_jax.tasks import Task, extract


def generate(split, n, seed):  # n examples of "train" or "test"
  rng = random.Random(f"{split}/{seed}")
  return [{"a": rng.randint(0, 49), "b": rng.randint(0, 49)} for _ in range(n)]


def is_correct(completion, example):
  return extract.last_answer_tag(completion) == str(example["a"] + example["b"])


TASK = Task(
    name="addition",
    question=lambda ex: f"What is {ex['a']} + {ex['b']}?",  # prompt for pretrained models
    compact_question=lambda ex: f"{ex['a']}+{ex['b']}=\n",  # prompt for the tiny char models
    extract_answer=extract.last_answer_tag,
    correctness=lambda completion, ex: float(is_correct(completion, ex)),  # reward in [0, 1]
    is_correct=is_correct,
    reference_completion=lambda ex: f"<answer>{ex['a'] + ex['b']}</answer>",  # SFT target
    generate=generate,
)
