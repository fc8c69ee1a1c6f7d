"""What the checkpoint's tokenizer files say about special tokens: the added tokens, the chat
template's end-of-turn token, the stop tokens and the mask token (tokenizer.json,
tokenizer_config.json, generation_config.json), read without loading a tokenizer.
"""
import json

from jinja2.sandbox import ImmutableSandboxedEnvironment

from stabledrl_jax import storage

def added_tokens(hf_dir: str) -> list[dict]:
  """The added tokens of the checkpoint's tokenizer, each `{"id", "content", "special", ...}`:
  tokenizer.json's `added_tokens`, or, for a tokenizer shipped as vocab.json + merges.txt
  (Dream's), tokenizer_config.json's `added_tokens_decoder` (id -> token)."""
  added = _read_json(storage.path(hf_dir) / "tokenizer.json").get("added_tokens")
  if added:
    return added
  decoder = _read_json(storage.path(hf_dir) / "tokenizer_config.json").get("added_tokens_decoder")
  return [{**entry, "id": int(i)} for i, entry in (decoder or {}).items()]


def _token_text(entry) -> str | None:
  # tokenizer_config.json spells a special token as a string or as {"content": ...}.
  return entry.get("content") if isinstance(entry, dict) else entry


def _raise_template_error(message: str) -> None:
  raise ValueError(f"chat template: {message}")


def _render_chat_template(tokenizer_config: dict, messages: list[dict]) -> str:
  """The conversation as the checkpoint's chat template writes it, rendered in a sandbox (the
  template is data, not trusted code) as `tasks.tokenizer.HFTokenizer` renders it."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals["raise_exception"] = _raise_template_error
  return env.from_string(tokenizer_config["chat_template"]).render(
      messages=messages, add_generation_prompt=False,
      bos_token=_token_text(tokenizer_config.get("bos_token")) or "",
      eos_token=_token_text(tokenizer_config.get("eos_token")) or "")


def end_of_turn_token(hf_dir: str) -> str | None:
  """The special token the chat template writes right after an assistant message, if any."""
  tokenizer_config = _read_json(storage.path(hf_dir) / "tokenizer_config.json")
  special = [t["content"] for t in added_tokens(hf_dir) if t.get("special")]
  if not isinstance(tokenizer_config.get("chat_template"), str) or not special:
    return None
  marker = "\u2063end of the answer\u2063"
  text = _render_chat_template(
      tokenizer_config,
      [{"role": "user", "content": "question"}, {"role": "assistant", "content": marker}])
  rest = text.rpartition(marker)[2].lstrip()
  found = [t for t in special if rest.startswith(t)]
  return max(found, key=len) if found else None


# A diffusion padding token that ends the answer: DiffuCoder's tokenizer has it, and its released
# examples cut each generation at the first one.
DIFFUSION_PAD = "<|dlm_pad|>"


def stop_token_ids(hf_dir: str, hf: dict) -> tuple[int, ...]:
  """Generation stops at: config.json's eos, generation_config.json's eos list, the chat
  template's end-of-turn token and `DIFFUSION_PAD` (both looked up in the checkpoint's tokenizer,
  where it has them)."""
  ids = []
  for entry in (hf.get("eos_token_id"), _read_json(
      storage.path(hf_dir) / "generation_config.json").get("eos_token_id")):
    ids += list(entry) if isinstance(entry, (list, tuple)) else [entry]
  eot = end_of_turn_token(hf_dir)
  if eot is not None:
    ids += [added_token_id(hf_dir, eot)]
  ids += [added_token_id(hf_dir, DIFFUSION_PAD)]
  return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def added_token_id(hf_dir: str, content: str) -> int | None:
  """The id of an added token of the checkpoint's tokenizer (None when absent)."""
  return next((t["id"] for t in added_tokens(hf_dir) if t["content"] == content), None)


def mask_token_id(hf_dir: str) -> int | None:
  """The mask token named by tokenizer_config.json (SDAR's `<|MASK|>`, Dream's `<|mask|>`), for
  a config.json that does not give `mask_token_id`."""
  entry = _token_text(_read_json(storage.path(hf_dir) / "tokenizer_config.json").get("mask_token"))
  return added_token_id(hf_dir, entry) if entry else None


def _read_json(path: storage.Path) -> dict:
  if not path.exists():
    return {}
  return json.loads(path.read_text())
