"""Tokenizers: the tiny character vocabulary and a Hugging Face tokenizer.json, same interface."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from stabledrl_jax.tasks import get_task
from stabledrl_jax.tasks.tokenizer import CharTokenizer, HFTokenizer


def test_char_tokenizer_round_trips_task_prompts():
  tok = CharTokenizer()
  for name, ex in [
      ("countdown", {"numbers": [3, 5, 7], "target": 22}),
      ("sudoku", {"puzzle": "3102200002100320", "solution": "3142243142131324"}),
  ]:
    task = get_task(name)
    for text in (
        task.prompt(ex, "compact"),
        task.prompt(ex, "plain"),
        task.reference_completion(ex),
    ):
      ids = tok.encode(text)
      assert tok.unk_id not in ids and tok.decode(ids) == text
  ids = tok.encode("<answer>12</answer>")
  assert len(ids) == 4 and ids[0] == tok.token_id("<answer>")
  assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id}) == 4
  assert tok.decode([tok.bos_id, *tok.encode("1+2"), tok.eos_id, tok.pad_id]) == "1+2"
  assert tok.encode("é") == [tok.unk_id]
  assert tok.mask_id not in tok.encode("<mask><pad>")  # text never yields special ids


@pytest.fixture
def hf_dir(tmp_path):
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|mask|>": 3, "<|user|>": 4, "<|assistant|>": 5}
  for word in "what is 2 + 3 ? <answer> </answer> 5".split():
    vocab.setdefault(word, len(vocab))
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<s>", "</s>", "<|mask|>", "<|user|>", "<|assistant|>"])
  tok.save(str(tmp_path / "tokenizer.json"))
  template = (
      "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
      "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
  )
  (tmp_path / "tokenizer_config.json").write_text(
      json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template})
  )
  return tmp_path


def test_hf_tokenizer_chat_template_and_special_ids(hf_dir):
  tok = HFTokenizer(hf_dir, mask_token="<|mask|>")
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id) == (1, 2, 2, 3)
  text = tok.apply_chat_template([{"role": "user", "content": "what is 2 + 3 ?"}])
  assert text == "<s><|user|> what is 2 + 3 ? <|assistant|>"
  ids = tok.encode(text)
  assert ids[0] == 1 and ids[1] == 4 and ids[-1] == 5 and 0 not in ids
  assert tok.decode(tok.encode("<answer> 5 </answer>")) == "<answer> 5 </answer>"


def test_hf_tokenizer_sandboxes_the_template(hf_dir):
  config = json.loads((hf_dir / "tokenizer_config.json").read_text())
  config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
  (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
  from jinja2.exceptions import SecurityError

  with pytest.raises(SecurityError):
    HFTokenizer(hf_dir).apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_tokenizer_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    HFTokenizer(tmp_path)


def test_chat_prompts_for_instruct_models(hf_dir):
  from stabledrl_jax.tasks import pipeline

  tok = HFTokenizer(hf_dir, mask_token="<|mask|>")
  task = get_task("gsm8k")
  ex = {"question": "what is 2 + 3 ?", "answer": "5"}
  assert task.chat_prompt(ex, tok).startswith("<s><|user|> what is 2 + 3 ?")
  batch = pipeline.encode_prompts(task, [ex], tok, max_prompt_len=64, chat=True)
  row = batch["prompt_ids_BxP"][0][batch["prompt_mask_BxP"][0]]
  assert row[0] == tok.bos_id and row[1] == 4 and row[-1] == 5  # one bos, ends on assistant
