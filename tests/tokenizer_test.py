"""Tokenizers: the tiny character vocabulary and a Hugging Face tokenizer.json, same interface."""

import json
import unicodedata

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from stabledrl_jax.tasks import get_task
from stabledrl_jax.tasks.tokenizer import QWEN2_PRETOKENIZE, CharTokenizer, HFTokenizer


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


# ----------------------------------------------------------------------------- vocab.json + merges.txt

CORPUS = [
    "What is 12 * 7? Let's think step by step.", "The answer is 84.\n\nNatalia sold 48 clips.",
    "She's here, they're there, we've gone; I'm sure you'll see it'd work.",
    "def f(x):\n    return x + 1  # comment\n", "naïve café résumé 中文 数学 😀 👍🏽",
    "  leading spaces and\ttabs\r\nwindows lines", "<answer>42</answer> <reasoning>ok</reasoning>",
]
ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
         ("<tool_call>", False), ("<|mask|>", True)]
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = CORPUS + [
    "Unseen wörds: Zürich, ﬁne, e\u0301 (decomposed é), 0123456789, $3.50!!!",
    "chat <|im_start|>user\nhi<|im_end|>\n<tool_call>x<|mask|><|mask|><|endoftext|>tail",
    "   ", "\n\n\n", "a  b   c", "x's X'S 'll",
]


@pytest.fixture
def bpe_dir(tmp_path):
  """A small byte-level BPE in Dream's released layout: vocab.json + merges.txt (Qwen2's
  pre-tokenization), its added tokens only in tokenizer_config.json's `added_tokens_decoder`."""
  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
      vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tok.model.save(str(tmp_path))
  n = tok.get_vocab_size()
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "added_tokens_decoder": {str(n + i): {"content": t, "lstrip": False, "normalized": False,
                                            "rstrip": False, "single_word": False, "special": s}
                               for i, (t, s) in enumerate(ADDED)},
      "bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
      "mask_token": "<|mask|>", "unk_token": None, "chat_template": TEMPLATE,
      "clean_up_tokenization_spaces": False, "tokenizer_class": "Qwen2Tokenizer"}))
  return tmp_path


def byte_level_bpe_reference(directory, text):
  """Qwen2's slow tokenizer, restated: NFC, added tokens split out first, the pre-tokenization
  regex, each piece's UTF-8 bytes as printable characters, merges applied lowest rank first."""
  regex = pytest.importorskip("regex")
  vocab = json.loads((directory / "vocab.json").read_text())
  lines = (directory / "merges.txt").read_text().splitlines()
  ranks = {tuple(line.split()): i for i, line in enumerate(l for l in lines[1:] if l.strip())}
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
  byte_char, extra = {}, 0
  for b in range(256):
    if b in printable:
      byte_char[b] = chr(b)
    else:
      byte_char[b], extra = chr(256 + extra), extra + 1
  added = {t: len(vocab) + i for i, (t, _) in enumerate(ADDED)}
  ids = []
  for part in regex.split("(" + "|".join(regex.escape(t) for t in added) + ")", text):
    if part in added:
      ids.append(added[part])
      continue
    for piece in regex.findall(QWEN2_PRETOKENIZE, unicodedata.normalize("NFC", part)):
      word = [byte_char[b] for b in piece.encode("utf-8")]
      while len(word) > 1:
        pairs = [(ranks.get(pair, float("inf")), i) for i, pair in enumerate(zip(word, word[1:]))]
        rank, i = min(pairs)
        if rank == float("inf"):
          break
        merged, j = [], 0
        first, second = word[i], word[i + 1]
        while j < len(word):  # every occurrence of the pair, left to right
          if j + 1 < len(word) and word[j] == first and word[j + 1] == second:
            merged.append(first + second)
            j += 2
          else:
            merged.append(word[j])
            j += 1
        word = merged
      ids += [vocab[w] for w in word]
  return ids


def test_vocab_and_merges_tokenize_as_the_byte_level_bpe_definition(bpe_dir):
  tok = HFTokenizer(bpe_dir)
  n = len(json.loads((bpe_dir / "vocab.json").read_text()))
  assert (tok.eos_id, tok.pad_id, tok.mask_id, tok.bos_id) == (n, n, n + 4, -1)
  assert tok.vocab_size == n + len(ADDED)
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids == byte_level_bpe_reference(bpe_dir, text), text
    assert tok.decode(ids, skip_special=False) == unicodedata.normalize("NFC", text)
  assert tok.decode(tok.encode("a<|im_end|>b<tool_call>c")) == "ab<tool_call>c"  # not special


def test_vocab_and_merges_encode_and_decode_as_transformers(bpe_dir):
  transformers = pytest.importorskip("transformers")
  ours = HFTokenizer(bpe_dir)
  theirs = transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
  for text in TEXTS:
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False), text
    for skip in (True, False):
      assert ours.decode(ids, skip_special=skip) == theirs.decode(ids, skip_special_tokens=skip)
  messages = [{"role": "user", "content": "What is 12 * 7?"}]
  assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True)


def test_vocab_and_merges_errors_name_the_file(bpe_dir, tmp_path_factory):
  config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
  config["tokenizer_class"] = "LlamaTokenizer"
  (bpe_dir / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="tokenizer_class 'LlamaTokenizer'"):
    HFTokenizer(bpe_dir)
  config["tokenizer_class"] = "DreamTokenizer"
  first = min(config["added_tokens_decoder"])
  config["added_tokens_decoder"][str(int(first) + 100)] = config["added_tokens_decoder"].pop(first)
  (bpe_dir / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"added token '.+' has id \d+ in tokenizer_config\.json"):
    HFTokenizer(bpe_dir)
  (bpe_dir / "merges.txt").unlink()
  with pytest.raises(FileNotFoundError,
                     match=r"tokenizer\.json \(nor vocab\.json \+ merges\.txt\)"):
    HFTokenizer(bpe_dir)
