"""Held-out quality of fast decoding (`fast_decoding`: LLaDA's, and Dream's Fast-dLLM variant) on
trained models: accuracy, mean reward, forwards and tokens forwarded per puzzle with the exact
sampler and each cache / threshold setting (greedy), at the end of SFT and after RL. Prints a
markdown table.

  .venv/bin/python bench/rl_seeds.py --config=configs/llada.py --seeds=0,1,2 --root=runs/seeds
  .venv/bin/python bench/cache_quality.py runs/seeds/llada_seed0 runs/seeds/llada_seed1 \\
      runs/seeds/llada_seed2

Each WORKDIR is a finished `configs/llada.py` or `configs/dream.py` run: its recorded config, its
held-out examples (`eval.num_examples` of them, as the run's own evaluations) and its checkpoints
at the last SFT step (`metrics.sft_end`) and the last step. Evaluation is `evaluate.evaluate` with
`sampler.cache` and `sampler.threshold` set for each row. Dream's threshold rows decode with
`sampler.alg=maskgit_plus` (the threshold is on its confidence), so Dream also gets an exact
`maskgit_plus` row; its other rows keep the run's `sampler.alg`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stabledrl_jax import build, cli, evaluate, metrics, workdir_config  # noqa: E402

# (label, sampler.cache, sampler.threshold); threshold 0 = off.
SETTINGS = (("exact", "none", 0.0), ("prefix", "prefix", 0.0), ("dual", "dual", 0.0),
            ("threshold 0.9", "none", 0.9), ("prefix + threshold 0.9", "prefix", 0.9),
            ("dual + threshold 0.9", "dual", 0.9), ("dual + threshold 0.7", "dual", 0.7))
DREAM_THRESHOLD_ALG = "maskgit_plus"


def evaluate_settings(workdir: str, step: int, settings=SETTINGS,
                      batch_size: int = 0) -> list[dict]:
  """One row per setting: label, mean_reward, accuracy, forwards, forward_tokens, seconds.
  `batch_size`: puzzles decoded together (0: the run's `eval.batch_size`)."""
  c = workdir_config.get_config(workdir)
  if batch_size:
    c.eval.batch_size = batch_size
  model, tokenizer, _ = cli.load_policy(c, workdir, step)
  data = build.data(c, tokenizer, workdir)
  c.eval.fast = True
  if c.family == "dream":
    settings = (*settings[:1], (f"exact {DREAM_THRESHOLD_ALG}", "none", 0.0), *settings[1:])
  run_alg = c.sampler.alg
  rows = []
  for label, cache, threshold in settings:
    c.sampler.cache, c.sampler.threshold = cache, threshold
    if c.family == "dream":
      c.sampler.alg = DREAM_THRESHOLD_ALG if threshold or DREAM_THRESHOLD_ALG in label else run_alg
      label = f"{label} ({c.sampler.alg})" if threshold or cache != "none" else label
    t0 = time.perf_counter()
    result, _ = evaluate.evaluate(c, model, data.tokenizer, data.task, data.test)
    rows.append({"label": label, "seconds": time.perf_counter() - t0, **result})
  return rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("workdirs", nargs="+")
  p.add_argument("--batch_size", type=int, default=0,
                 help="puzzles decoded together (default: the run's eval.batch_size). A block ends "
                 "when no row of the batch has a mask left in it, so a threshold saves forwards "
                 "per puzzle only where the whole batch is confident: at batch 1, per puzzle.")
  args = p.parse_args()
  print("| run | checkpoint | decoding | mean reward | accuracy | forwards | token-forwards | "
        "seconds (incl. compile) |")
  print("|---|---|---|---:|---:|---:|---:|---:|")
  for workdir in args.workdirs:
    c = workdir_config.get_config(workdir)
    sft_end = metrics.sft_end(workdir) or c.sft.steps
    for tag, step in (("end of SFT", sft_end - 1), ("after RL", sft_end + c.rl.steps - 1)):
      try:
        results = evaluate_settings(workdir, step, batch_size=args.batch_size)
      except cli.PolicyError as e:  # e.g. the SFT checkpoint, past checkpoint.keep
        print(f"| {os.path.basename(os.path.normpath(workdir))} | {tag} (step {step}) | not "
              f"measured: {e} |||||", flush=True)
        continue
      for r in results:
        print(f"| {os.path.basename(os.path.normpath(workdir))} | {tag} (step {step}) | "
              f"{r['label']} | {r['mean_reward']:.3f} | {r['accuracy']:.3f} | {r['forwards']:.1f} "
              f"| {r['forward_tokens']:.0f} | {r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
  main()
