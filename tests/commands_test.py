"""Pieces of evaluate / generate / export: stop ids from the checkpoint's tokenizer, atomic
export that refuses a non-empty target, pass@k, the curves' panels."""
import json
import os

import numpy as np
import pytest

from stabledrl_jax import evaluate, metrics, models
from stabledrl_jax.models import checkpoint

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _tokenizer_dir(path, special, template, generation_eos=None):
  from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
  vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz \n?")}
  vocab["[UNK]"] = len(vocab)
  tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
  tok.add_special_tokens(special)
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  json.dump({"eos_token": special[0], "chat_template": template},
            open(os.path.join(path, "tokenizer_config.json"), "w"))
  if generation_eos is not None:
    json.dump({"eos_token_id": generation_eos},
              open(os.path.join(path, "generation_config.json"), "w"))
  return {t: len(vocab) + i for i, t in enumerate(special)}


def test_stop_ids_come_from_the_template_and_generation_config(tmp_path):
  ids = _tokenizer_dir(str(tmp_path), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], CHATML,
                       generation_eos=[7, 3])
  assert checkpoint.end_of_turn_token(str(tmp_path)) == "<|im_end|>"
  got = checkpoint.stop_token_ids(str(tmp_path), {"eos_token_id": ids["<|endoftext|>"]})
  assert got == (ids["<|endoftext|>"], 7, 3, ids["<|im_end|>"])


def test_llada_end_of_turn_is_found_after_the_assistant_message(tmp_path):
  template = ("{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>"
              "\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
              "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}")
  ids = _tokenizer_dir(str(tmp_path), ["<|endoftext|>", "<|start_header_id|>",
                                       "<|end_header_id|>", "<|eot_id|>"], template)
  assert checkpoint.stop_token_ids(str(tmp_path), {"eos_token_id": 5}) == (5, ids["<|eot_id|>"])


def test_export_refuses_a_non_empty_target_and_is_atomic(tmp_path):
  model = models.create(models.tiny(), seed=0)
  target = tmp_path / "out"
  target.mkdir()
  (target / "keep.txt").write_text("mine")
  with pytest.raises(checkpoint.ExportError, match="exists and is not empty"):
    models.export_pretrained(model, str(target))
  assert os.listdir(target) == ["keep.txt"]
  models.export_pretrained(model, str(tmp_path / "new"), max_shard_bytes=20_000)
  assert not os.path.exists(tmp_path / "new.partial")
  names = set(os.listdir(tmp_path / "new"))
  assert "model.safetensors.index.json" in names and "config.json" in names
  models.export_pretrained(model, str(target), replace=True)  # the end of a run: swapped whole
  assert "keep.txt" not in os.listdir(target) and not os.path.exists(str(target) + ".old")


def test_summary_accuracy_and_pass_at_k():
  correct = np.array([[1, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 1]], bool)
  lengths = np.full((4, 3), 10)
  s = evaluate.summarize(correct, lengths, wall=2.0)
  assert s["accuracy"] == 5 / 12 and s["pass_at_k"] == 3 / 4 and s["tokens_per_s"] == 60.0


def test_curve_panels_split_the_stages():
  from stabledrl_jax import metrics
  rows = [{"step": 0, "stage": "sft", "loss": 4.5, "grad_norm": 1.0},
          {"step": 1, "stage": "rl", "loss": 0.01, "reward_mean": 0.5, "grad_norm": 0.2}]
  panels = dict(metrics.curve_panels(rows, [{"step": 1, "accuracy": 0.25}]))
  assert panels["SFT loss"] == [(0, 4.5)] and panels["RL loss"] == [(1, 0.01)]
  assert panels["gradient norm"] == [(0, 1.0), (1, 0.2)]
  assert "SFT loss" not in dict(metrics.curve_panels(rows[1:], []))
