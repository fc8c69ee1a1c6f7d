"""The RL step's phases of a ~1B model in bfloat16 on one accelerator, both families: tokens/s and
MFU against the device's measured bfloat16 matmul peak. Prints markdown tables as it goes.

  python bench/gpu_rl_step.py                                  # sdar_1p7b shapes, both families
  python bench/gpu_rl_step.py --preset=tiny --prompt_len=8 --gen=8 --block=4 --llada_steps=4 \\
      --peak_n=256                                             # the CPU check

The peak is measured first in the same process: the best time of a square bfloat16 matmul
(`--peak_n`, float32 accumulation). Then, per family, on random weights of the preset's shapes
(LLaDA: a full-attention `family="llada"` copy), one rollout batch of `--prompts` x `--group`
prompts of `--prompt_len` random tokens is decoded to `--gen` tokens, and the step's phases are
timed on it (best of `--runs` after one untimed call that compiles):
- LLaDA rollouts (`--llada_steps` steps, blocks of `--block`): the exact sampler and the fast one
  (`sampler.cache=dual`, `sampler.threshold=--threshold`). On random weights no confidence reaches
  a high threshold, so the fast sampler saves by the cache alone; the forwards are its own count.
- SDAR rollouts: block decoding with the KV cache, `--sdar_steps` steps per block.
- The behaviour pass (the old policy's log-probabilities, `--samples` masks per rollout; SDAR's
  staircase runs on [x_t ; x_0]) and one RL update (`rl.update`: StableDRL, forward, backward and
  AdamW with fp32 master weights, whole-layer remat), with dense attention and, for SDAR, with the
  blockwise attention (`model.attention_impl=blockwise`).
FLOPs are analytic (`stabledrl_jax.flops`, matrix multiplies only); MFU = FLOPs / time / measured
peak. After each update the device's memory high-water mark (`peak_bytes_in_use`, where the
backend reports it) is printed; the blockwise update runs first so that its mark is its own.
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

from stabledrl_jax import config_lib, flops, models, objectives, optim, rl, rollouts, samplers


def mfu(fraction: float) -> str:
  """MFU in percent to 3 significant digits (a tiny model's 0.004% is not printed as 0.0%)."""
  return f"MFU {100 * fraction:.3g}%"


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


def model_config(family: str, args, **changes) -> models.ModelConfig:
  full = dict(family="llada", qk_norm=False, block_size=None) if family == "llada" else {}
  return models.preset(args.preset, compute_dtype="bfloat16", param_dtype="float32",
                       remat=args.remat, **full, **changes)


def samplings(family: str, cfg, args) -> list[tuple[str, object]]:
  if family == "llada":
    exact = rollouts.LLaDASampling(gen_length=args.gen, block_length=args.block,
                                   steps=args.llada_steps, temperature=1.0,
                                   remasking="low_confidence", cfg_scale=0.0, cache="none",
                                   threshold=0.0, order="confidence", chunk=0, stop_ids=(-1,))
    return [("exact", exact),
            (f"cache=dual threshold={args.threshold}",
             dataclasses.replace(exact, cache="dual", threshold=args.threshold))]
  return [(f"KV cache, {args.sdar_steps} steps/block",
           rollouts.SDARSampling(gen_length=args.gen, block_length=cfg.block_size,
                                 steps=args.sdar_steps, strategy="low_confidence_static",
                                 threshold=0.0, temperature=1.0, top_k=0, top_p=1.0,
                                 order="confidence", chunk=0, stop_ids=(-1,)))]


def objective(family: str, cfg, args) -> objectives.Objective:
  obj = objectives.Objective.from_config(config_lib.base_config(family))
  return dataclasses.replace(obj, group_size=args.group, num_samples=args.samples,
                             block_size=cfg.block_size if family == "sdar" else args.block)


def measure_family(family: str, args, peak: float, emit) -> None:
  cfg = model_config(family, args)
  model = models.create(cfg, seed=0)
  b = args.prompts * args.group
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(2, cfg.mask_token_id, size=(b, args.prompt_len)), jnp.int32)
  valid = jnp.ones((b, args.prompt_len), bool)
  generate = samplers.llada_generate if family == "llada" else samplers.sdar_generate
  emit((f"{family}: {cfg.num_params / 1e9:.2f}B params", f"{b} rollouts x ({args.prompt_len} + "
        f"{args.gen}) tokens", "", "", ""))
  rollout = None
  for name, sampling in samplings(family, cfg, args):
    t0 = time.perf_counter()
    rollout = jax.block_until_ready(generate(model, prompts, valid, jax.random.key(0), sampling))
    first = time.perf_counter() - t0
    seconds = best_seconds(lambda s=sampling: generate(model, prompts, valid, jax.random.key(0),
                                                       s).tokens_BxL, args.runs)
    total = rollout.tokens_BxL.shape[1]
    fwd = float(np.mean(np.asarray(rollout.forwards_B)))
    fwd_tokens = float(np.mean(np.asarray(rollout.forward_tokens_B)))
    work = flops.rl_step_flops(cfg, flops.StepShape(
        rows=b, prompt=args.prompt_len, gen=args.gen, total=total, samples=1, updates=1,
        sampler_steps=args.sdar_steps if family == "sdar" else args.llada_steps,
        block=cfg.block_size if family == "sdar" else args.block, staircase=family == "sdar",
        **({} if family == "sdar" else dict(forwards=fwd, forward_tokens=fwd_tokens))))["rollout"]
    emit((f"  rollout, {name}", f"{b * args.gen / seconds:,.0f} gen tok/s", f"{seconds:.3f} s",
          mfu(work / seconds / peak),
          f"{fwd:.0f} forwards, {fwd_tokens:,.0f} tokens/row; first call {first:.1f} s"))

  seqs = rollouts.from_rollout(rollout)
  adv = jnp.asarray(rng.normal(size=b), jnp.float32)
  obj = objective(family, cfg, args)
  total = seqs.tokens_BxL.shape[1]
  work = flops.rl_step_flops(cfg, flops.StepShape(
      rows=b, prompt=args.prompt_len, gen=args.gen, total=total, samples=args.samples, updates=1,
      sampler_steps=1, block=obj.block_size, staircase=family == "sdar"))
  t_behaviour = best_seconds(
      lambda: rl.behaviour_pass(model, None, seqs, adv, jax.random.key(1), obj)[0].logp_old_BxMxL,
      args.runs)
  emit(("  behaviour pass", f"{b * total / t_behaviour:,.0f} tok/s", f"{t_behaviour:.3f} s",
        mfu(work['likelihood'] / t_behaviour / peak), f"M={args.samples}"))
  batch, _ = rl.behaviour_pass(model, None, seqs, adv, jax.random.key(1), obj)
  optim_config = ml_collections.ConfigDict(dict(grad_clip=1.0, b1=0.9, b2=0.99, weight_decay=0.0,
                                                decay_steps=0))
  # Blockwise first, so that the device's high-water mark after it is its own (and the phases').
  impls = ("blockwise", "dense") if family == "sdar" and args.blockwise else ("dense",)
  for i, impl in enumerate(impls):
    if i or impl != cfg.attention_impl:  # the same weights under this attention
      model = models.create(model_config(family, args, attention_impl=impl), seed=0)
    opt = nnx.Optimizer(model, optim.make_optimizer(1e-6, 0, 1000, optim_config), wrt=nnx.Param)
    try:
      t_update = best_seconds(lambda: rl.update(model, opt, batch, jax.random.key(2), obj=obj,
                                                accumulation=args.accumulation)["loss"], args.runs)
    except Exception as e:  # noqa: BLE001  (report, go on to the next measurement)
      emit((f"  RL update, {impl} attention", "failed", "", "", f"{type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}"))
      continue
    stats = jax.devices()[0].memory_stats() or {}
    high = (f"; device memory high-water mark {stats['peak_bytes_in_use'] / 2**30:.1f} GiB"
            if "peak_bytes_in_use" in stats else "")
    emit((f"  RL update, {impl} attention", f"{b * total / t_update:,.0f} tok/s",
          f"{t_update:.3f} s", mfu(work['update'] / t_update / peak),
          f"fwd+bwd+AdamW, accumulation {args.accumulation}{high}"))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="sdar_1p7b")
  p.add_argument("--families", default="llada,sdar")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=256)
  p.add_argument("--gen", type=int, default=256)
  p.add_argument("--block", type=int, default=32, help="LLaDA sampler block length")
  p.add_argument("--llada_steps", type=int, default=128)
  p.add_argument("--threshold", type=float, default=0.9)
  p.add_argument("--sdar_steps", type=int, default=4)
  p.add_argument("--samples", type=int, default=2)
  p.add_argument("--accumulation", type=int, default=1)
  p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--blockwise", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--peak_n", type=int, default=8192)
  p.add_argument("--runs", type=int, default=2)
  args = p.parse_args()
  dev = jax.devices()[0]
  print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, jax {jax.__version__}, "
        f"{dev.device_kind} ({dev.platform})", flush=True)
  peak = matmul_peak(args.peak_n, 3)
  print(f"measured bf16 matmul peak {peak / 1e12:.1f} TFLOP/s (n={args.peak_n})\n")
  print("| phase | throughput | time (best of runs) | MFU | notes |\n|---|---|---|---|---|",
        flush=True)
  emit = lambda row: print("| " + " | ".join(row) + " |", flush=True)  # noqa: E731
  for family in args.families.split(","):
    measure_family(family, args, peak, emit)


if __name__ == "__main__":
  main()
