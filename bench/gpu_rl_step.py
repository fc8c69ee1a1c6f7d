"""RL update step and sampler of a ~1B preset in bfloat16 on one accelerator: tokens/s and MFU
against the device's measured bfloat16 matmul peak. Prints a markdown table.

  .venv/bin/python bench/gpu_rl_step.py                       # sdar_1p7b, on the default device
  .venv/bin/python bench/gpu_rl_step.py --preset=tiny --prompt_len=8 --gen=8 --peak_n=256  # CPU check

The peak is measured first in the same process: the best time of a square bfloat16 matmul
(`--peak_n`, float32 accumulation). Then, on random weights (speed does not depend on them), it
times the SDAR sampler (KV cache, `--sampler_steps` denoising steps per block) on
`--prompts` x `--group` rollouts, and the RL update (`rl.update`: StableDRL with the staircase
likelihood, `--samples` masks per rollout, one optimiser step with fp32 master weights) on the
same batch. FLOPs are analytic (`stabledrl_jax.flops`); MFU = FLOPs / time / measured peak.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from stabledrl_jax import config_lib, flops, likelihood, models, optim, rl, samplers  # noqa: E402


def best_seconds(fn, runs: int) -> float:
  jax.block_until_ready(fn())  # compile and warm up
  best = float("inf")
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best


def matmul_peak(n: int, runs: int) -> float:
  """Measured bfloat16 matmul FLOP/s of this device."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  return 2.0 * n**3 / best_seconds(lambda: mm(a, b), runs)


def measure(args) -> list[tuple[str, ...]]:
  cfg = models.preset(args.preset, compute_dtype="bfloat16", param_dtype="float32",
                      remat=args.remat)
  peak = matmul_peak(args.peak_n, args.runs)
  model = models.create(cfg, seed=0)
  b = args.prompts * args.group
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(2, cfg.mask_token_id, size=(b, args.prompt_len)), jnp.int32)
  valid = jnp.ones((b, args.prompt_len), bool)
  sampling = samplers.SDARSampling(gen_length=args.gen, steps=args.sampler_steps,
                                   temperature=1.0, block_size=cfg.block_size)
  rollout = samplers.sdar_generate(model, prompts, valid, jax.random.key(0), sampling)
  t_sample = best_seconds(lambda: samplers.sdar_generate(model, prompts, valid, jax.random.key(0),
                                                          sampling).tokens_BxL, args.runs)

  optim_config = ml_collections.ConfigDict(dict(grad_clip=1.0, b1=0.9, b2=0.99, weight_decay=0.0,
                                                decay_steps=0))
  opt = nnx.Optimizer(model, optim.make_optimizer(1e-6, 0, 1000, optim_config), wrt=nnx.Param)
  obj = dataclasses.replace(config_lib.settings(config_lib.base_config("sdar")).objective,
                            group_size=args.group, scheme="block_t", num_samples=args.samples,
                            block_size=cfg.block_size, staircase=True)
  seqs = likelihood.from_rollout(rollout)
  adv = jnp.asarray(rng.normal(size=b), jnp.float32)
  batch, _ = rl.behaviour_pass(model, None, seqs, adv, jax.random.key(1), obj)
  t_update = best_seconds(lambda: rl.update(model, opt, batch, jax.random.key(2), obj=obj,
                                                accumulation=args.accumulation)["loss"], args.runs)
  t_behaviour = best_seconds(
      lambda: rl.behaviour_pass(model, None, seqs, adv, jax.random.key(1), obj)[0].logp_old_BxMxL,
      args.runs)

  total = seqs.tokens_BxL.shape[1]
  f = flops.rl_step_flops(cfg, flops.StepShape(
      rows=b, prompt=args.prompt_len, gen=args.gen, total=total, samples=args.samples, updates=1,
      sampler_steps=args.sampler_steps, block=cfg.block_size, staircase=True))
  gen_tokens, seq_tokens = b * args.gen, b * total
  dev = jax.devices()[0]
  rows = [("device", f"{dev.device_kind} ({dev.platform})", "", ""),
          ("measured bf16 matmul peak", f"{peak / 1e12:.1f} TFLOP/s", f"n={args.peak_n}", ""),
          ("model", f"{args.preset}: {cfg.num_params / 1e9:.2f}B params, bf16 compute",
           f"{b} rollouts x ({args.prompt_len} + {args.gen}) tokens", "")]
  for name, seconds, work, tokens in (
      (f"sampler ({args.sampler_steps} steps/block, KV cache)", t_sample, f["rollout"], gen_tokens),
      (f"behaviour likelihood (M={args.samples}, staircase)", t_behaviour, f["likelihood"], seq_tokens),
      ("RL update (fwd+bwd+AdamW)", t_update, f["update"], seq_tokens)):
    rows.append((name, f"{tokens / seconds:,.0f} tok/s", f"{seconds:.3f} s",
                 f"MFU {work / seconds / peak:.1%}"))
  return rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="sdar_1p7b")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=256)
  p.add_argument("--gen", type=int, default=256)
  p.add_argument("--sampler_steps", type=int, default=4)
  p.add_argument("--samples", type=int, default=2)
  p.add_argument("--accumulation", type=int, default=1)
  p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--peak_n", type=int, default=8192)
  p.add_argument("--runs", type=int, default=3)
  args = p.parse_args()
  rows = measure(args)
  print(f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
  print("| measurement | throughput | time | MFU |\n|---|---|---|---|")
  for row in rows:
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
  main()
