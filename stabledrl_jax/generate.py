r"""Generate from a checkpoint for one-off prompts:

  python -m stabledrl_jax.generate --config=configs/sdar.py:8b \
      --config.model.checkpoint=/path/to/SDAR-8B-Chat --prompt="What is 12 * 7?"
  echo "What is 12 * 7?" | python -m stabledrl_jax.generate --from_workdir=runs/sdar_8b
  python -m stabledrl_jax.generate --from_workdir=W --prompts_file=prompts.txt --show_order \
      --config.sampler.gen_length=128 --config.sampler.temperature=0

Prompts go through the tokenizer's chat template when it has one (`--raw` sends them as they
are). Sampling follows the config's `sampler.*` (`sampler.temperature` included), decoding
exactly unless `--config.eval.fast=True` (then with the rollouts' fast settings). `--show_order`
also prints, for each generated token, the decoding step that committed it.
"""
from __future__ import annotations

import sys

import jax
import numpy as np
from absl import flags

from stabledrl_jax import build, cli, distributed, samplers, sharding, storage


def define_flags() -> None:
  cli.define_policy_flags()
  flags.DEFINE_multi_string("prompt", [], "A prompt (repeat the flag for several).")
  flags.DEFINE_string("prompts_file", None, "A file with one prompt per line.")
  flags.DEFINE_bool("raw", False, "Do not apply the chat template.")
  flags.DEFINE_bool("show_order", False, "Print each token's commit step.")
  flags.DEFINE_bool("truncate_prompts", False, "Keep the last tokens of a prompt too long for the "
                    "model's positions (default: an error naming the prompt).")


def read_prompts(given: list[str], prompts_file: str | None) -> list[str]:
  """`given` (--prompt), then `prompts_file`'s lines (UTF-8; a line that is not names the file
  and line), else stdin's."""
  prompts = list(given)
  if prompts_file:
    with storage.path(prompts_file).open("rb") as f:
      for lineno, raw in enumerate(f, start=1):
        try:
          line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
          raise ValueError(f"{prompts_file}, line {lineno}: not UTF-8 text ({e})") from None
        if line.strip():
          prompts.append(line)
  if not prompts and not sys.stdin.isatty():
    prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
  return prompts


def fit(encoded: list[list[int]], positions: int, truncate: bool) -> list[list[int]]:
  """Each prompt's ids within `positions` (the model's, less the completion's): its last
  `positions` ids with `truncate`, else a `ValueError` naming the first prompt too long."""
  for b, ids in enumerate(encoded):
    if len(ids) > positions and not truncate:
      raise ValueError(f"prompt {b + 1} has {len(ids)} tokens; the model holds {positions} besides "
                       "the completion (sampler.gen_length): shorten it, or pass "
                       "--truncate_prompts to keep its last tokens")
  return [ids[-positions:] if positions > 0 else [] for ids in encoded]


def encode(tokenizer, prompts: list[str], chat: bool, positions: int | None = None,
           truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded ids and mask `[B, P]` (P: the longest prompt), each within `positions`
  (`fit`)."""
  encoded = []
  for text in prompts:
    if chat:
      ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    else:
      ids = ([tokenizer.bos_id] if tokenizer.bos_id >= 0 else []) + tokenizer.encode(text)
    encoded.append(ids)
  if positions is not None:
    encoded = fit(encoded, positions, truncate)
  length = max(len(ids) for ids in encoded)
  ids_BxP = np.full((len(prompts), length), tokenizer.pad_id, np.int32)
  mask_BxP = np.zeros((len(prompts), length), bool)
  for b, ids in enumerate(encoded):
    ids_BxP[b, length - len(ids):] = ids
    mask_BxP[b, length - len(ids):] = True
  return ids_BxP, mask_BxP


def commit_order(tokenizer, rollout, row: int) -> str:
  """`token@step` for each generated token of `row`, in position order."""
  tokens = sharding.to_host(rollout.tokens_BxL)[row]
  steps = sharding.to_host(rollout.commit_step_BxL)[row]
  mask = sharding.to_host(rollout.completion_mask_BxL)[row]
  return " ".join(f"{tokenizer.decode([t], skip_special=False)!r}@{s}"
                  for t, s, m in zip(tokens.tolist(), steps.tolist(), mask.tolist()) if m)


def main(argv):
  c, workdir = cli.setup(argv)
  try:
    prompts = read_prompts(flags.FLAGS.prompt, flags.FLAGS.prompts_file)
  except (OSError, ValueError) as e:
    cli.fail(f"--prompts_file: {cli.error_text(e)}")
  if not prompts:
    cli.fail("no prompts: give --prompt, --prompts_file or lines on stdin")
  try:
    model, tokenizer, _ = cli.load_policy(c, workdir, flags.FLAGS.step)
  except cli.PolicyError as e:
    cli.fail(str(e))
  chat = not flags.FLAGS.raw and bool(getattr(tokenizer, "chat_template", None))
  try:
    ids, mask = encode(tokenizer, prompts, chat, model.config.max_seq_len - c.sampler.gen_length,
                       flags.FLAGS.truncate_prompts)
  except ValueError as e:
    cli.fail(str(e))
  rollout = samplers.generate(model, ids, mask, jax.random.key(c.seed),
                              build.eval_sampling(c, c.sampler.temperature))
  completions = sharding.to_host(rollout.completion_BxC)
  if not distributed.is_main():
    return
  for b, prompt in enumerate(prompts):
    stops = set(model.config.stop_token_ids)
    row = completions[b].tolist()
    cut = next((i for i, t in enumerate(row) if t in stops), len(row))
    print(f"### prompt {b + 1}: {prompt}\n{tokenizer.decode(row[:cut])}", flush=True)
    if flags.FLAGS.show_order:
      print(f"### commit order {b + 1}: {commit_order(tokenizer, rollout, b)}", flush=True)


if __name__ == "__main__":
  define_flags()
  cli.start(main)
