"""Tokenizers with one interface: `encode`, `decode`, special ids, `apply_chat_template`.

`CharTokenizer` is the tiny models' vocabulary (characters, the format tags as single tokens,
and pad/bos/eos/mask/unk). `HFTokenizer` wraps a Hugging Face `tokenizers` `tokenizer.json`
and the chat template of the checkpoint's `tokenizer_config.json` (rendered in a sandboxed
Jinja environment: a checkpoint's template is data, not code we trust).
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<mask>", "<unk>")
TAG_TOKENS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
CHARS = string.digits + " +-*/()=,.:;?!'\"$%#<>[]{}\\_^\n" + string.ascii_letters


class Tokenizer(Protocol):
  pad_id: int
  bos_id: int
  eos_id: int
  mask_id: int
  vocab_size: int

  def encode(self, text: str) -> list[int]:
    ...

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    ...

  def apply_chat_template(
      self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
  ) -> str:
    ...


class CharTokenizer:
  """One token per character, per format tag and per special token; unknown chars -> unk."""

  def __init__(self, chars: str = CHARS, tags: Sequence[str] = TAG_TOKENS):
    self.tokens: tuple[str, ...] = (*SPECIAL_TOKENS, *tags, *dict.fromkeys(chars))
    self._ids = {tok: i for i, tok in enumerate(self.tokens)}
    # Tags, longest first, so "</answer>" wins over "<". Special tokens are never read
    # from text: a prompt or completion spelling "<mask>" must not become the mask id.
    self._multi = sorted(tags, key=len, reverse=True)
    self.pad_id, self.bos_id, self.eos_id, self.mask_id, self.unk_id = (
        self._ids[t] for t in SPECIAL_TOKENS
    )
    self.vocab_size = len(self.tokens)
    self._special_ids = {self._ids[t] for t in SPECIAL_TOKENS}

  def token_id(self, token: str) -> int:
    return self._ids[token]

  def encode(self, text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
      if text[i] == "<":
        match = next((t for t in self._multi if text.startswith(t, i)), None)
        if match is not None:
          ids.append(self._ids[match])
          i += len(match)
          continue
      ids.append(self._ids.get(text[i], self.unk_id))
      i += 1
    return ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    return "".join(
        self.tokens[i] for i in ids if not (skip_special and int(i) in self._special_ids)
    )

  def apply_chat_template(
      self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
  ) -> str:
    # Tiny models have no chat format: the conversation is its messages' text.
    del add_generation_prompt
    return "".join(m["content"] for m in messages)


class HFTokenizer:
  """A Hugging Face `tokenizer.json` plus the chat template and special tokens of a checkpoint.

  Special tokens come from `tokenizer_config.json` (`bos_token`, `eos_token`, `pad_token`,
  `mask_token`) unless given; LLaDA's mask token (id 126336, docs/method.md §6) is not named there, so
  `mask_token` / `mask_id` can be passed explicitly.
  """

  def __init__(
      self,
      directory: str | Path,
      *,
      mask_token: str | None = None,
      mask_id: int | None = None,
      eos_token: str | None = None,
  ):
    from tokenizers import Tokenizer as _HFTokenizer

    directory = Path(directory)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
      raise FileNotFoundError(f"no tokenizer.json in {directory}")
    self._tok = _HFTokenizer.from_file(str(tokenizer_file))
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    self.chat_template: str | None = config.get("chat_template")
    self.bos_token = _token_text(config.get("bos_token"))
    self.eos_token = eos_token or _token_text(config.get("eos_token"))
    pad_token = _token_text(config.get("pad_token")) or self.eos_token
    self.bos_id = self._id_of(self.bos_token)
    self.eos_id = self._id_of(self.eos_token)
    self.pad_id = self._id_of(pad_token)
    self.mask_id = (
        mask_id
        if mask_id is not None
        else self._id_of(mask_token or _token_text(config.get("mask_token")))
    )
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

  def _id_of(self, token: str | None) -> int:
    if token is None:
      return -1
    token_id = self._tok.token_to_id(token)
    if token_id is None:
      raise ValueError(f"special token {token!r} is not in the vocabulary")
    return token_id

  def encode(self, text: str) -> list[int]:
    # The chat template already writes bos/eos; the tokenizer must not add them again.
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def apply_chat_template(
      self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
  ) -> str:
    if not self.chat_template:
      raise ValueError("this tokenizer_config.json has no chat_template")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    return env.from_string(self.chat_template).render(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "",
        eos_token=self.eos_token or "",
    )


def _raise_template_error(message: str) -> None:
  # Chat templates call `raise_exception(...)` to reject a malformed conversation.
  raise ValueError(f"chat template: {message}")


def _token_text(entry: object) -> str | None:
  # tokenizer_config.json spells a special token as a string or as {"content": ...}.
  if isinstance(entry, dict):
    return entry.get("content")
  return entry if isinstance(entry, str) else None
