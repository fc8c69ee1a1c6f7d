"""Tokenizers with one interface: `encode`, `decode`, special ids, `apply_chat_template`.

`CharTokenizer` is the tiny models' vocabulary (characters, the format tags as single tokens,
and pad/bos/eos/mask/unk). `HFTokenizer` wraps a checkpoint's Hugging Face tokenizer, its
`tokenizer.json` or, for a checkpoint that ships `vocab.json` + `merges.txt` instead (Dream's,
Qwen2's byte-level BPE), one built from those files (`byte_level_bpe`), and the chat template of
its `tokenizer_config.json` (rendered in a sandboxed Jinja environment: a checkpoint's template is
data, not code we trust).
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from typing import Protocol

import tokenizers
from etils.epath import Path
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


# The pre-tokenization of Qwen2's byte-level BPE (Qwen2Tokenizer, and Dream's DreamTokenizer, a
# copy of it): contractions, letters with one leading non-letter, single digits, punctuation runs,
# newlines, spaces.
QWEN2_PRETOKENIZE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                     r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# tokenizer_config.json's tokenizer_class values that `byte_level_bpe` reproduces.
BYTE_LEVEL_BPE_CLASSES = ("DreamTokenizer", "Qwen2Tokenizer", "Qwen2TokenizerFast")


def byte_level_bpe(vocab_file: Path, merges_file: Path,
                   added_tokens: Sequence[Mapping]) -> tokenizers.Tokenizer:
  """Qwen2's byte-level BPE (what Dream's `vocab.json` + `merges.txt` are) as a `tokenizers`
  tokenizer: NFC normalisation, `QWEN2_PRETOKENIZE` splits, the bytes of each piece mapped to
  printable characters and merged by rank, no unknown token; then `added_tokens` (entries of
  tokenizer_config.json's `added_tokens_decoder`, each with its `id`), matched in the raw text
  before anything else, each checked to get its own id."""
  vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
  merges = [tuple(line.split()) for i, line in enumerate(merges_file.read_text(encoding="utf-8")
                                                        .splitlines())
            if line.strip() and not (i == 0 and line.startswith("#version:"))]
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                                   byte_fallback=False))
  tok.normalizer = tokenizers.normalizers.NFC()
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN2_PRETOKENIZE), behavior="isolated"),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = tokenizers.decoders.ByteLevel()
  for entry in sorted(added_tokens, key=lambda e: int(e["id"])):
    token = tokenizers.AddedToken(
        entry["content"], single_word=entry.get("single_word", False),
        lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
        normalized=entry.get("normalized", False), special=entry.get("special", False))
    (tok.add_special_tokens if token.special else tok.add_tokens)([token])
    if tok.token_to_id(entry["content"]) != int(entry["id"]):
      raise ValueError(f"added token {entry['content']!r} has id {entry['id']} in "
                       f"tokenizer_config.json but {tok.token_to_id(entry['content'])} after "
                       f"{vocab_file.name}'s {len(vocab)} entries")
  return tok


def load_hf_tokenizer(directory: Path, config: Mapping) -> tokenizers.Tokenizer:
  """The checkpoint's `tokenizer.json`, else its `vocab.json` + `merges.txt` (`byte_level_bpe`,
  with `config`'s — tokenizer_config.json's — added tokens)."""
  if (directory / "tokenizer.json").is_file():
    return tokenizers.Tokenizer.from_str((directory / "tokenizer.json").read_text(encoding="utf-8"))
  vocab_file, merges_file = directory / "vocab.json", directory / "merges.txt"
  if not (vocab_file.is_file() and merges_file.is_file()):
    raise FileNotFoundError(f"no tokenizer.json (nor vocab.json + merges.txt) in {directory}")
  cls = config.get("tokenizer_class")
  if cls is not None and cls not in BYTE_LEVEL_BPE_CLASSES:
    raise ValueError(f"tokenizer_class {cls!r} in {directory}: vocab.json + merges.txt are read "
                     f"as Qwen2's byte-level BPE ({', '.join(BYTE_LEVEL_BPE_CLASSES)})")
  added = [{**entry, "id": int(i)} for i, entry in config.get("added_tokens_decoder", {}).items()]
  return byte_level_bpe(vocab_file, merges_file, added)


class HFTokenizer:
  """A checkpoint's Hugging Face tokenizer (`load_hf_tokenizer`) plus its chat template and
  special tokens.

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
    directory = Path(directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    self._tok = load_hf_tokenizer(directory, config)
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
