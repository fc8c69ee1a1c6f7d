"""Sampler throughput: generated tokens/s of LLaDA decoding and SDAR block decoding (with and
without the KV cache) on the model presets. Prints the machine and a markdown table.

  .venv/bin/python bench/samplers.py --presets tiny,bench_100m --gen-length 256

Settings (issue 4): LLaDA 128 steps with blocks of 32 (a full-attention `family="llada"` copy of
the preset); SDAR blocks of 4 with 4 static low-confidence steps per block, greedy, once reading
the KV cache and once recomputing the whole prefix every step (`use_cache=False`). Prompts are a
fixed length of random ids and the stop id is -1, which no model can emit, so every row
generates all `gen_length` tokens (checked on every run).

LLaDA fast decoding (`fast_decoding`, issue 19) adds `llada_prefix` and `llada_dual` (block-wise
KV reuse, scheduled commits), `llada_threshold` (full forwards, confidence-threshold commits) and
`llada_dual_threshold`, at `--llada-threshold` (0.9). Their speed-up column is the exact LLaDA
sampler's median over theirs. On randomly initialised weights no confidence reaches a useful
threshold, so the threshold modes run their whole step budget here: their gain is a property of
trained weights, not measured by this bench.

Dream (issue 30) runs a Dream-family copy of the preset (q/k/v biases, shifted logits) with
LLaDA's steps: `dream` is its released sampler (`entropy`, no blocks), `dream_prefix` and
`dream_dual` Fast-dLLM's Dream decoder with LLaDA's block, `dream_dual_threshold` the same with
`alg=maskgit_plus` and the threshold; their speed-up column is over `dream`.

`--lora-rank R` times each sampler on the model with LoRA adapters of rank R (the family's
default targets) and with the same adapters merged into the kernels, interleaved: whether
merging the adapters before the rollouts pays ("+merged" rows: speed-up over "+lora").

Timing. Each sampler is compiled ahead of time (trace + lower + compile, reported as "compile s");
the compiled program is then run `--runs` times, each to `jax.block_until_ready`, and the median
is reported. The samplers' runs are interleaved (cache, no cache, LLaDA, cache, ...) so that each
sees the same contention on a shared machine, and the cache speed-up is the ratio of the two
medians from the same process.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from stabledrl_jax import models  # noqa: E402
from stabledrl_jax import lora, rollouts, samplers  # noqa: E402

SAMPLERS = ("llada", "sdar_cache", "sdar_nocache", "llada_prefix", "llada_dual", "llada_threshold",
            "llada_dual_threshold", "dream", "dream_prefix", "dream_dual", "dream_dual_threshold")
# The fast modes of LLaDA and Dream: (cache, uses the threshold).
FAST = {"prefix": ("prefix", False), "dual": ("dual", False), "threshold": ("none", True),
        "dual_threshold": ("dual", True)}
LLADA_FAST = {f"llada_{mode}": v for mode, v in FAST.items()}
DREAM_FAST = {f"dream_{mode}": v for mode, v in FAST.items() if mode != "threshold"}
# A stop id no model can emit: `jnp.isin` never matches it, so no row stops early.
NEVER_STOP = (-1,)
DEFAULT_BATCH = {"tiny": 8}  # other presets: 1 (the ~100M model on a small CPU)
DEFAULT_RUNS = {"tiny": 5}   # other presets: 2


@dataclasses.dataclass(frozen=True)
class Row:
  """One measured sampler on one preset."""
  preset: str
  sampler: str
  batch: int
  gen_tokens: int        # batch x gen_length, per run
  forwards: str          # model forwards per run (what each one covers)
  model_forwards: int    # forwards per run, counted by the sampler
  forward_tokens: int    # tokens per row those forwards processed, counted by the sampler
  compile_s: float       # trace + lower + XLA compile
  run_s: float           # median over the timed runs
  runs: int
  tokens_per_s: float
  cache_speedup: float | None  # sdar_cache: median(no cache) / median(cache); LLaDA fast
                               # modes: median(llada) / median(mode); "+merged" rows:
                               # median(with adapters) / median(merged)


def _config(preset: str, sampler: str, compute_dtype: str) -> models.ModelConfig:
  # The LLaDA and Dream samplers run full attention: a copy of the preset's shapes in their family.
  for family in ("llada", "dream"):
    if sampler.startswith(family):
      return models.preset(preset, **models.family_options(family), compute_dtype=compute_dtype)
  return models.preset(preset, compute_dtype=compute_dtype)


def _sampling(sampler: str, gen_length: int, llada_steps: int, llada_block: int,
              sdar_steps: int, llada_threshold: float = 0.9, block_size: int = 4):
  if sampler.startswith("dream"):  # LLaDA's steps and block; the threshold needs maskgit_plus
    cache, threshold = DREAM_FAST.get(sampler, ("none", False))
    return rollouts.DreamSampling(gen_length=gen_length, steps=llada_steps,
                                  alg="maskgit_plus" if threshold else "entropy", alg_temp=0.0,
                                  eps=1e-3, temperature=0.0, top_k=0, top_p=1.0,
                                  block_length=llada_block, cache=cache,
                                  threshold=llada_threshold if threshold else 0.0,
                                  chunk=0, stop_ids=NEVER_STOP)
  if sampler.startswith("llada"):
    cache, threshold = LLADA_FAST.get(sampler, ("none", False))
    return rollouts.LLaDASampling(gen_length=gen_length, block_length=llada_block,
                                  steps=llada_steps, temperature=0.0, remasking="low_confidence",
                                  cfg_scale=0.0, cache=cache,
                                  threshold=llada_threshold if threshold else 0.0,
                                  order="confidence", chunk=0, stop_ids=NEVER_STOP)
  return rollouts.SDARSampling(gen_length=gen_length, block_length=block_size, steps=sdar_steps,
                               strategy="low_confidence_static", threshold=0.0, temperature=0.0,
                               top_k=0, top_p=1.0, order="confidence", chunk=0,
                               use_cache=sampler == "sdar_cache", stop_ids=NEVER_STOP)


def _compile(sampler: str, model, prompt_BxP, valid_BxP, key, sampling):
  """AOT-compiles the public sampler entry point; returns `(run(), compile seconds)`."""
  graphdef, state = nnx.split(model)
  def pure(state, prompt_BxP, valid_BxP, key):
    generate = samplers.sampler_of(sampling)
    return generate(nnx.merge(graphdef, state), prompt_BxP, valid_BxP, key, sampling)

  start = time.perf_counter()
  compiled = jax.jit(pure).lower(state, prompt_BxP, valid_BxP, key).compile()
  compile_s = time.perf_counter() - start
  return (lambda: jax.block_until_ready(compiled(state, prompt_BxP, valid_BxP, key))), compile_s


def _check_full(rollout: rollouts.Rollout, gen_length: int, mask_id: int, what: str) -> int:
  """Every row generated all its tokens; returns the number of decoding steps taken. (Dream's
  samplers may decode the mask token, which random weights do: not counted against them.)"""
  lengths = np.asarray(rollout.lengths_B)
  completion = np.asarray(rollout.completion_BxC)
  if not (lengths == gen_length).all() or (
      not what.split("/")[-1].startswith("dream") and (completion == mask_id).any()):
    raise RuntimeError(f"{what}: rows did not generate all {gen_length} tokens "
                       f"(lengths {lengths.tolist()})")
  return int(np.asarray(rollout.commit_step_BxL).max()) + 1


def measure(preset: str, *, batch: int, gen_length: int = 256, prompt_length: int = 64,
            runs: int = 2, llada_steps: int = 128, llada_block: int = 32, sdar_steps: int = 4,
            compute_dtype: str = "float32", which: tuple[str, ...] = SAMPLERS,
            llada_threshold: float = 0.9, lora_rank: int = 0,
            log: Callable[[str], None] = lambda s: None) -> list[Row]:
  """Compiles and times each sampler in `which` on `preset`; returns one `Row` per sampler.
  `lora_rank` > 0: each sampler twice, on the model with LoRA adapters of that rank on the
  family's default targets ("+lora") and with the same adapters merged into the kernels
  ("+merged"): whether merging before the rollouts pays."""
  unknown = set(which) - set(SAMPLERS)
  if unknown:
    raise ValueError(f"unknown samplers {sorted(unknown)}; expected some of {SAMPLERS}")
  if runs < 1:
    raise ValueError(f"runs must be >= 1, got {runs}")
  key = jax.random.PRNGKey(0)
  fns, compile_s, forwards, counts = {}, {}, {}, {}
  variants = {}  # timed name -> (sampler, model)
  for name in which:
    cfg = _config(preset, name, compute_dtype)
    model = models.create(cfg, seed=0)
    if lora_rank:
      targets = lora.DEFAULT_TARGETS[cfg.family]
      adapted = lora.apply(model, lora.LoraConfig(lora_rank, 2.0 * lora_rank, targets=targets))
      variants[f"{name}+lora"] = (name, adapted)
      variants[f"{name}+merged"] = (name, lora.merge(nnx.clone(adapted)))
    else:
      variants[name] = (name, model)
  for name, (sampler, model) in variants.items():
    cfg = model.config
    # Ids below the mask token and above the special ids; every prompt slot is real.
    prompt_BxP = jax.random.randint(jax.random.PRNGKey(1), (batch, prompt_length), 2,
                                    cfg.mask_token_id, dtype=jnp.int32)
    valid_BxP = jnp.ones((batch, prompt_length), bool)
    sampling = _sampling(sampler, gen_length, llada_steps, llada_block, sdar_steps, llada_threshold,
                         cfg.block_size or 4)
    log(f"{preset}/{name}: compiling")
    fns[name], compile_s[name] = _compile(sampler, model, prompt_BxP, valid_BxP, key, sampling)
    log(f"{preset}/{name}: compiled in {compile_s[name]:.1f} s")
    rollout = fns[name]()
    steps = _check_full(rollout, gen_length, cfg.mask_token_id, f"{preset}/{name}")
    counts[name] = (int(rollout.forwards_B[0]), int(rollout.forward_tokens_B[0]))
    if sampler in LLADA_FAST or sampler in DREAM_FAST:
      forwards[name] = f"{counts[name][0]} (variable length)"
    elif sampler in ("llada", "dream"):
      forwards[name] = f"{steps} x {prompt_length + gen_length} tok"
    else:
      bs = sampling.block_length
      layout = rollouts.sdar_layout(prompt_BxP, valid_BxP, gen_length, bs, cfg.mask_token_id)
      t, first_block, num_blocks = layout[0].shape[1], layout[5], layout[6]
      if sampler == "sdar_cache":
        # No row stops, so every block from the first generated one gets a commit forward.
        forwards[name] = (f"{steps} x {bs} + {num_blocks - first_block} x {bs} commit "
                          f"+ {first_block * bs} prefill tok")
      else:
        forwards[name] = f"{steps} x {t} tok"
  # The run above is a warm-up (first execution: allocation, page faults), not timed.
  times: dict[str, list[float]] = {name: [] for name in variants}
  for i in range(runs):
    for name in variants:
      start = time.perf_counter()
      fns[name]()
      times[name].append(time.perf_counter() - start)
      log(f"{preset}/{name}: run {i + 1}/{runs} {times[name][-1]:.3f} s")
  median = {name: statistics.median(ts) for name, ts in times.items()}
  speedup = {}
  if {"sdar_cache", "sdar_nocache"} <= set(variants):
    speedup["sdar_cache"] = median["sdar_nocache"] / median["sdar_cache"]
  for family, fast in (("llada", LLADA_FAST), ("dream", DREAM_FAST)):
    if family in variants:
      speedup.update({name: median[family] / median[name] for name in which if name in fast})
  speedup.update({f"{n}+merged": median[f"{n}+lora"] / median[f"{n}+merged"]
                  for n in which if lora_rank})
  return [Row(preset=preset, sampler=name, batch=batch, gen_tokens=batch * gen_length,
              forwards=forwards[name], model_forwards=counts[name][0],
              forward_tokens=counts[name][1], compile_s=compile_s[name], run_s=median[name],
              runs=runs, tokens_per_s=batch * gen_length / median[name],
              cache_speedup=speedup.get(name))
          for name in variants]


def machine() -> str:
  """One line describing where the numbers were taken."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
  except (OSError, StopIteration):
    pass
  load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
  return (f"{os.cpu_count()} CPUs ({cpu}), load average {load}; jax {jax.__version__}, "
          f"flax {flax.__version__}, backend {jax.default_backend()} "
          f"({len(jax.devices())} x {jax.devices()[0].device_kind}), python "
          f"{platform.python_version()}")


def table(rows: list[Row]) -> str:
  """Markdown table of the rows."""
  lines = ["| preset | sampler | batch | gen tokens | forwards / run | forwards | token-forwards "
           "/ row | compile s | run s (median of n) | tokens/s | speed-up |",
           "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    speedup = f"{r.cache_speedup:.2f}x" if r.cache_speedup is not None else ""
    lines.append(f"| {r.preset} | {r.sampler} | {r.batch} | {r.gen_tokens} | {r.forwards} | "
                 f"{r.model_forwards} | {r.forward_tokens} | "
                 f"{r.compile_s:.1f} | {r.run_s:.3f} (n={r.runs}) | {r.tokens_per_s:,.1f} | "
                 f"{speedup} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", default="tiny,bench_100m")
  parser.add_argument("--samplers", default=",".join(SAMPLERS))
  parser.add_argument("--batch", type=int, default=None,
                      help="rows per call (default: tiny 8, others 1)")
  parser.add_argument("--runs", type=int, default=None,
                      help="timed runs per sampler (default: tiny 5, others 2)")
  parser.add_argument("--gen-length", type=int, default=256)
  parser.add_argument("--prompt-length", type=int, default=64)
  parser.add_argument("--llada-steps", type=int, default=128)
  parser.add_argument("--llada-block", type=int, default=32)
  parser.add_argument("--sdar-steps", type=int, default=4)
  parser.add_argument("--llada-threshold", type=float, default=0.9)
  parser.add_argument("--lora-rank", type=int, default=0,
                      help="> 0: each sampler with LoRA adapters of this rank and with them merged")
  parser.add_argument("--compute-dtype", default="float32",
                      help="float32 (default: faster than bfloat16 on CPU) or bfloat16")
  args = parser.parse_args()
  print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}")
  print(f"# gen {args.gen_length}, prompt {args.prompt_length}, compute {args.compute_dtype}; "
        f"LLaDA {args.llada_steps} steps / block {args.llada_block}; SDAR {args.sdar_steps} "
        "static steps / block, greedy", flush=True)
  start = time.perf_counter()
  rows = []
  for preset in args.presets.split(","):
    rows += measure(preset, batch=args.batch or DEFAULT_BATCH.get(preset, 1),
                    gen_length=args.gen_length, prompt_length=args.prompt_length,
                    runs=args.runs or DEFAULT_RUNS.get(preset, 2), llada_steps=args.llada_steps,
                    llada_block=args.llada_block, sdar_steps=args.sdar_steps,
                    compute_dtype=args.compute_dtype, which=tuple(args.samplers.split(",")),
                    llada_threshold=args.llada_threshold, lora_rank=args.lora_rank,
                    log=lambda s: print(f"  {s}", file=sys.stderr, flush=True))
  print(table(rows))
  print(f"# total {time.perf_counter() - start:.0f} s; load average at the end "
        f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
  main()
