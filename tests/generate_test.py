"""Tests for stabledrl_jax.generate's input: the prompts file and prompts too long for the model."""
import pytest

from stabledrl_jax import generate
from stabledrl_jax.tasks.tokenizer import CharTokenizer


def test_a_prompts_file_that_is_not_text_names_its_line(tmp_path):
  path = tmp_path / "prompts.txt"
  path.write_bytes(b"2+2?\n\n3+3?\r\n")
  assert generate.read_prompts(["1+1?"], str(path)) == ["1+1?", "2+2?", "3+3?"]
  path.write_bytes(b"2+2?\n\x89PNG\x00\xff\n")
  with pytest.raises(ValueError, match=rf"^{path}, line 2: not UTF-8 text"):
    generate.read_prompts([], str(path))


def test_a_prompt_longer_than_the_model_holds_fails_or_keeps_its_end():
  tok = CharTokenizer()
  prompts = ["12", "1" * 10 + "234"]
  with pytest.raises(ValueError, match=r"^prompt 2 has 1[34] tokens; the model holds 5 besides the "
                     "completion"):
    generate.encode(tok, prompts, chat=False, positions=5)
  ids, mask = generate.encode(tok, prompts, chat=False, positions=5, truncate=True)
  assert ids.shape == (2, 5) and mask.sum(1).tolist() == [len(tok.encode("12")) + (tok.bos_id >= 0), 5]
  assert tok.decode(ids[1].tolist()) == "11234"
