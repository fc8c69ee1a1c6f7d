r"""LLaDA2.0 against the released PyTorch code itself (issue 41): one model exported in the
released format and loaded by both, its logits, the greedy `generate` tokens prompt by prompt,
and the two samplers' speed.

  pip install --target /tmp/tf4 --no-deps transformers==4.57.1 tokenizers==0.22.1 \
      huggingface-hub==0.36.0        # the released code imports what transformers 5 removed
  PYTHONPATH=/tmp/tf4 taskset -c 0 .venv/bin/python bench/llada2_released.py --remote_code=DIR

DIR holds the released `modeling_llada2_moe.py` and `configuration_llada2_moe.py` (an LLaDA2.0
checkpoint's own, e.g. from the hub's inclusionAI/LLaDA2.0-mini). The model is
`models.llada2_tiny` (flags change its size), its norms and expert bias drawn at random and its
head scaled so that some tokens pass the threshold; it is exported in float32
(`models.export_pretrained`: config.json with `auto_map`, safetensors) and loaded by
`AutoModelForCausalLM.from_pretrained(trust_remote_code=True)`. Measured:
- logits of random ids, the plain forward (ours: full attention) and under `generate`'s
  block-causal mask (ours: `attention="block_causal"`), max |difference|;
- per prompt, the released `generate(prompt, temperature=0, ...)` against ours
  (`rollouts.LLaDA2Sampling`, the same settings and stop token) with and without our KV cache,
  token for token; the stop token is one the first prompt generates in its second block, so
  that the stopping rule (after the block that holds it, cut after it) is exercised;
- wall time of the released routine over the prompts one at a time, and of ours one at a time
  and batched (left-padded): the median of 3 calls after a warm-up; generated tokens per second.
Writes `--out` (docs/results/ format: `bench/report.py` renders it into docs/llada2.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from scarce_demos import commit  # noqa: E402  (bench/scarce_demos.py: the commit, marked if dirty)
from stabledrl_jax import models, rollouts, samplers  # noqa: E402

FILES = ("modeling_llada2_moe.py", "configuration_llada2_moe.py")


def tiny_model(args):
  cfg = models.llada2_tiny(d_model=args.d_model, n_layers=args.n_layers,
                           num_experts=args.num_experts, head_dim=args.d_model // 4,
                           moe_intermediate_size=args.d_model, mlp_dim=2 * args.d_model,
                           max_seq_len=args.prompt_len + args.gen_length + args.block)
  model = models.create(cfg, seed=args.seed)
  rng = np.random.default_rng(args.seed)
  for path, var in nnx.iter_graph(model):  # the released init leaves norms 1 and the bias 0
    if isinstance(var, nnx.Variable) and path[-1] in ("scale", "expert_bias"):
      shape = var.get_value().shape
      value = (1 + 0.3 * rng.standard_normal(shape) if path[-1] == "scale"
               else 0.05 * rng.standard_normal(shape))
      var.set_value(jnp.asarray(value, jnp.float32))
  model.head.kernel.set_value(model.head.kernel[...] * args.head_scale)
  return model


def released(model, remote_code: str, workdir: str):
  import torch
  from transformers import AutoModelForCausalLM
  out = os.path.join(workdir, "released")
  models.export_pretrained(model, out, dtype="float32")
  for name in FILES:
    shutil.copy(os.path.join(remote_code, name), out)
  torch.manual_seed(0)
  theirs = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                dtype=torch.float32).eval()
  # `generate` builds its additive block mask (0 / -inf) in bfloat16, the dtype its checkpoints
  # run in; torch's attention refuses it beside float32 queries, so it is cast (exactly).
  forward = theirs.forward

  def float32_mask(*a, attention_mask=None, **kw):
    if attention_mask is not None and attention_mask.dtype == torch.bfloat16:
      attention_mask = attention_mask.float()
    return forward(*a, attention_mask=attention_mask, **kw)

  theirs.forward = float32_mask
  return theirs


def block_mask(length: int, block: int):
  """`generate`'s additive mask: blocks counted from position 0, each sees itself and before."""
  import torch
  b = np.arange(length) // block
  allowed = b[None, :] <= b[:, None]
  return torch.tensor(np.where(allowed, 0.0, -np.inf), dtype=torch.float32)[None, None]


def logits_gap(model, theirs, ids, block):
  import torch
  with torch.no_grad():
    plain = theirs(torch.tensor(ids)).logits.numpy()
    causal = theirs(torch.tensor(ids), attention_mask=block_mask(ids.shape[1], block)).logits.numpy()
  ours_plain = np.asarray(model.logits(jnp.asarray(ids)))
  ours_causal = np.asarray(model.logits(jnp.asarray(ids), attention="block_causal",
                                        block_size=block))
  return (float(np.abs(plain - ours_plain).max()), float(np.abs(causal - ours_causal).max()),
          float(np.abs(ours_plain).max()))


def ours(model, prompts, sampling):
  width = max(len(p) for p in prompts)
  ids = np.zeros((len(prompts), width), np.int32)
  valid = np.zeros((len(prompts), width), bool)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):], valid[i, width - len(p):] = p, True
  r = samplers.generate(model, jnp.asarray(ids), jnp.asarray(valid), jax.random.key(0), sampling)
  lengths = np.asarray(r.lengths_B)
  return [np.asarray(r.completion_BxC[i][:lengths[i]]) for i in range(len(prompts))]


REPEATS = 3


def timed(fn, *args):
  """`fn(*args)` and its median wall time over REPEATS calls after a warm-up (compilation)."""
  fn(*args)
  times = []
  for _ in range(REPEATS):
    t0 = time.perf_counter()
    out = fn(*args)
    times.append(time.perf_counter() - t0)
  return out, float(np.median(times))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--remote_code", required=True, help="directory with the released " + ", ".join(FILES))
  p.add_argument("--d_model", type=int, default=64)
  p.add_argument("--n_layers", type=int, default=2)
  p.add_argument("--num_experts", type=int, default=8)
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=12, help="the longest prompt")
  p.add_argument("--gen_length", type=int, default=32)
  p.add_argument("--block", type=int, default=8)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--threshold", type=float, default=0.9)
  p.add_argument("--head_scale", type=float, default=40.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="")
  args = p.parse_args()
  for name in FILES:
    if not os.path.isfile(os.path.join(args.remote_code, name)):
      sys.exit(f"error: --remote_code={args.remote_code} has no {name}")
  import torch

  model = tiny_model(args)
  cfg = model.config
  rng = np.random.default_rng(args.seed + 1)
  draw = lambda n: rng.integers(2, cfg.vocab_size - 1, size=n)  # noqa: E731  (not the mask)
  prompts = [draw(int(rng.integers(args.prompt_len // 2, args.prompt_len + 1)))
             for _ in range(args.prompts)]
  with tempfile.TemporaryDirectory() as tmp:
    theirs = released(model, args.remote_code, tmp)
    plain_gap, causal_gap, scale = logits_gap(model, theirs, draw((1, 3 * args.block)), args.block)
    kw = dict(temperature=0.0, block_length=args.block, steps=args.steps,
              gen_length=args.gen_length, threshold=args.threshold, mask_id=cfg.mask_token_id)
    # The stop token: the one the first prompt's free run generates first in its second block,
    # so that some prompts stop early (after the block holding it, cut after it) and some not.
    with torch.no_grad():
      free = theirs.generate(torch.tensor(prompts[0])[None], eos_id=-1, **kw)[0].numpy()
    eos = int(free[min(args.block + 1, len(free) - 1)])
    kw["eos_id"] = eos

    def released_all(prompts):
      with torch.no_grad():
        return [theirs.generate(torch.tensor(p)[None], **kw)[0].numpy() for p in prompts]

    want, t_released = timed(released_all, prompts)

  sampling = rollouts.LLaDA2Sampling(
      gen_length=args.gen_length, block_length=args.block, steps=args.steps, minimal_topk=1,
      threshold=args.threshold, temperature=0.0, top_k=0, top_p=1.0, chunk=0, stop_ids=(eos,),
      pad_id=cfg.pad_token_id)
  rows, same = [], {}
  for cache in (True, False):
    s = rollouts.LLaDA2Sampling(**{**sampling.__dict__, "use_cache": cache})
    one = lambda ps, s=s: [ours(model, [p], s)[0] for p in ps]  # noqa: E731
    got, t_one = timed(one, prompts)
    batched, t_batch = timed(lambda ps, s=s: ours(model, ps, s), prompts)
    same[cache] = (sum(np.array_equal(a, b) for a, b in zip(got, want)),
                   sum(np.array_equal(a, b) for a, b in zip(batched, want)))
    label = "ours, KV cache" if cache else "ours, prefix recomputed (as released)"
    tokens = sum(len(g) for g in got)
    rows += [[f"{label}, one prompt at a time", f"{same[cache][0]}/{len(prompts)}",
              f"{t_one:.3f}", f"{tokens / t_one:.0f}", f"{t_released / t_one:.2f}"],
             [f"{label}, batched ({len(prompts)} rows, left-padded)",
              f"{same[cache][1]}/{len(prompts)}", f"{t_batch:.3f}",
              f"{sum(len(g) for g in batched) / t_batch:.0f}", f"{t_released / t_batch:.2f}"]]
  tokens = sum(len(w) for w in want)
  rows.insert(0, ["released `generate` (torch), one prompt at a time", "—", f"{t_released:.3f}",
                  f"{tokens / t_released:.0f}", "1.00"])
  import transformers
  record = {
      "title": "LLaDA2.0's sampler and logits against the released PyTorch code, same model",
      "columns": ["sampler", "prompts token-identical to the released", "wall s (median of 3)",
                  "generated tokens/s", "speed vs released"],
      "align": "lrrrr", "rows": rows,
      "command": "PYTHONPATH=/tmp/tf4 .venv/bin/python bench/llada2_released.py " + " ".join(
          sys.argv[1:]),
      "commit": commit(),
      "machine": (f"{platform.machine()} CPU, {len(os.sched_getaffinity(0))} core(s) "
                  f"(torch {torch.__version__}, {torch.get_num_threads()} threads; transformers "
                  f"{transformers.__version__}; jax {jax.__version__})"),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "notes": (f"{cfg.n_layers} layers, d={cfg.d_model}, {cfg.num_experts} experts "
                f"({cfg.num_experts_per_tok} active, 1 shared), vocab {cfg.vocab_size}, float32; "
                f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
                f"tokens, gen_length {args.gen_length}, blocks of {args.block}, {args.steps} "
                f"steps, threshold {args.threshold}, greedy; logits max |ours - released|: "
                f"{plain_gap:.2e} plain forward, {causal_gap:.2e} block-causal (logits up to "
                f"{scale:.0f}); {tokens} tokens generated by the released routine, "
                f"{sum(eos in w for w in want)} of its completions stopped by token {eos}"),
  }
  print(json.dumps(record, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)
      f.write("\n")
  if plain_gap > 1e-3 * max(scale, 1) or not all(a == b == len(prompts) for a, b in same.values()):
    sys.exit("error: ours and the released code differ (above)")


if __name__ == "__main__":
  main()
