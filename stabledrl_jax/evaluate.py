r"""Held-out evaluation: the one function training and the `evaluate` command share (`evaluate`),
and the command:

  python -m stabledrl_jax.evaluate --config=configs/llada.py:8b \
      --config.model.checkpoint=/path/to/LLaDA-8B-Instruct --config.task.source_dir=/data/gsm8k
  python -m stabledrl_jax.evaluate --from_workdir=runs/llada_8b [--step=N] --num_samples=4

Decoding is exact (the config's sampler without its fast settings) unless `--config.eval.fast=True`;
greedy unless `--num_samples` > 1 (then at `sampler.temperature`, or `--temperature`). The
figures, named alike everywhere (training's eval.jsonl and console, this command's output):
`mean_reward` (the config's weighted reward, over every sample), `accuracy` (the fraction of
samples the task judges correct), `pass_at_k` (examples with any of their k samples correct),
and the sampler that produced them. The command also writes `eval_<name>.jsonl` (one row per
example: prompt, completions, extracted answers, rewards, correct).
"""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
from absl import flags

from stabledrl_jax import build, cli, distributed, samplers, sharding, storage
from stabledrl_jax.tasks import pipeline


def define_flags() -> None:
  cli.define_policy_flags()
  flags.DEFINE_integer("num_samples", 1, "Completions per example (pass@k).")
  flags.DEFINE_integer("max_examples", None, "Evaluate the first N test examples.")
  flags.DEFINE_float("temperature", None, "Sampling temperature (default: 0 for one sample, "
                     "else sampler.temperature).")
  flags.DEFINE_string("name", None, "eval_<name>.jsonl (default: from the checkpoint/step).")
  flags.DEFINE_string("output_dir", None, "Where eval_<name>.jsonl goes (default: the workdir, "
                      "or the current directory).")


def summarize(rewards_NxK: np.ndarray, correct_NxK: np.ndarray, lengths_NxK: np.ndarray,
              wall: float) -> dict:
  """Mean reward and accuracy over every sample, pass@k (any of an example's k correct), lengths,
  throughput."""
  return {"num_examples": int(correct_NxK.shape[0]), "num_samples": int(correct_NxK.shape[1]),
          "mean_reward": float(rewards_NxK.mean()), "accuracy": float(correct_NxK.mean()),
          "pass_at_k": float(correct_NxK.any(1).mean()),
          "mean_completion_length": float(lengths_NxK.mean()), "wall_s": wall,
          "tokens_per_s": float(lengths_NxK.sum()) / max(wall, 1e-9)}


def progress(done: int, total: int, tokens: int, t0: float) -> None:
  if not distributed.is_main():
    return
  wall = time.time() - t0
  eta = wall / max(done, 1) * (total - done)
  bar = "#" * (30 * done // max(total, 1))
  print(f"\r[{bar:<30}] {done}/{total} examples, {tokens / max(wall, 1e-9):.1f} tok/s, "
        f"ETA {eta:.0f}s", end="" if done < total else "\n", file=sys.stderr, flush=True)


def evaluate(c, model, tokenizer, task, examples: list, *, k: int = 1, temperature: float = 0.0,
             rollout_mesh=None, show_progress: bool = False) -> tuple[dict, list[dict]]:
  """`k` completions of each example with the config's evaluation sampler at `temperature`
  (`build.eval_sampling`), graded: `(figures, rows)`. Every process decodes its share of each
  batch and grades all of it, so all get the same figures."""
  reward_fn = build.reward_fn(c, task)
  invalid = reward_fn.invalid
  sampling = build.eval_sampling(c, temperature)
  stops = model.config.stop_token_ids
  per_batch = max(1, c.eval.batch_size // k)
  rows, rewards, correct, lengths, forwards, forward_tokens = [], [], [], [], [], []
  t0 = time.time()
  for lo in range(0, len(examples), per_batch):
    exs = examples[lo:lo + per_batch]
    enc = pipeline.encode_prompts(task, exs, tokenizer, max_prompt_len=c.task.max_prompt_len,
                                  style=c.task.prompt_style, chat=c.task.chat)
    ids = np.repeat(enc["prompt_ids_BxP"], k, axis=0)
    mask = np.repeat(enc["prompt_mask_BxP"], k, axis=0)
    rollout = samplers.generate(model, ids, mask, jax.random.fold_in(jax.random.key(c.seed), lo),
                                sampling, rollout_mesh=rollout_mesh)
    texts = pipeline.decode_completions(tokenizer, sharding.to_host(rollout.completion_BxC), stops)
    n = len(exs) * k
    lens = sharding.to_host(rollout.lengths_B)[:n].reshape(len(exs), k)
    forwards += list(sharding.to_host(rollout.forwards_B)[:n])
    forward_tokens += list(sharding.to_host(rollout.forward_tokens_B)[:n])
    for i, ex in enumerate(exs):
      outs = texts[i * k:(i + 1) * k]
      scores = [float(reward_fn(t, ex)) for t in outs]
      ok = [bool(task.is_correct(t, ex)) for t in outs]
      rewards.append(scores)
      correct.append(ok)
      lengths.append(lens[i].tolist())
      rows.append({"prompt": pipeline.prompt_text(task, ex, style=c.task.prompt_style,
                                                  chat_tokenizer=tokenizer if c.task.chat else None),
                   "completions": outs, "answers": [_jsonable(task.extract_answer(t)) for t in outs],
                   "rewards": scores, "correct": ok})
    if show_progress:
      progress(lo + len(exs), len(examples), int(np.sum(lengths)), t0)
  figures = summarize(np.array(rewards), np.array(correct), np.array(lengths), time.time() - t0)
  figures.update(sampler=sampling.label, forwards=float(np.mean(forwards)),
                 forward_tokens=float(np.mean(forward_tokens)))
  if reward_fn.invalid > invalid:  # task.invalid_reward=clip
    figures["invalid_rewards"] = reward_fn.invalid - invalid
  return figures, rows


def _jsonable(value):
  try:
    json.dumps(value)
    return value
  except TypeError:
    return str(value)


def main(argv):
  c, workdir = cli.setup(argv)
  f = flags.FLAGS
  if f.num_samples < 1:
    cli.fail(f"--num_samples={f.num_samples}: must be >= 1")
  if f.max_examples is not None and f.max_examples < 1:
    cli.fail(f"--max_examples={f.max_examples}: must be >= 1 (leave it out to evaluate all)")
  out_dir = f.output_dir or workdir or "."
  try:
    model, tokenizer, step = cli.load_policy(c, workdir, f.step)
    build.check_positions(c, model)
    task = build.task(c)
    examples = build.held_out(c, task, build.data_dir(c, out_dir))[:f.max_examples]
    if not examples:
      raise ValueError(f"task {c.task.name!r}: the test split is empty")
    build.check_reward(task, build.reward_fn(c, task), examples[:3])
  except (cli.PolicyError, ValueError, KeyError, OSError) as e:
    cli.fail(cli.error_text(e))
  k = f.num_samples
  temperature = f.temperature
  if temperature is None:
    temperature = 0.0 if k == 1 else c.sampler.temperature
  name = f.name or (f"step{step}" if step is not None else
                    os.path.basename(os.path.normpath(c.model.checkpoint or "init")))
  out_path = storage.path(out_dir) / f"eval_{name}.jsonl"
  storage.makedirs(out_path.parent)
  try:
    s, rows = evaluate(c, model, tokenizer, task, examples, k=k, temperature=temperature,
                       show_progress=distributed.is_main())
  except (ValueError, KeyError) as e:  # e.g. a prompt longer than task.max_prompt_len
    cli.fail(str(e))
  if distributed.is_main():
    out_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  distributed.log(
      f"{task.name} test, {s['num_examples']} examples x {k} ({s['sampler']}): mean reward "
      f"{s['mean_reward']:.4f}, accuracy {s['accuracy']:.4f}, pass@{k} {s['pass_at_k']:.4f}, "
      f"mean completion length {s['mean_completion_length']:.1f} tokens, {s['wall_s']:.1f}s, "
      f"{s['tokens_per_s']:.1f} generated tokens/s -> {out_path}")


if __name__ == "__main__":
  define_flags()
  cli.start(main)
