"""Model throughput on this machine: JAX forward+backward vs transformers/torch Qwen3, and the
staircase one-pass likelihood vs one forward per block. Prints a markdown table.

  .venv/bin/python bench/model_throughput.py --batch 2 --seq 256 --steps 3

Both frameworks run float32 on the same batch, length and thread count, in the same process,
steps interleaved so both see the same load: `--threads N` pins the process to N cores
(sched_setaffinity, which XLA's CPU thread pool follows) and sets torch.set_num_threads(N).
"""
import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from stabledrl_jax import models  # noqa: E402


def _time_interleaved(fns, steps: int) -> list[float]:
  """Best step time of each fn, alternating them so that both see the same CPU contention."""
  for fn in fns:
    fn()
  best = [float("inf")] * len(fns)
  for _ in range(steps):
    for i, fn in enumerate(fns):
      start = time.perf_counter()
      fn()
      best[i] = min(best[i], time.perf_counter() - start)
  return best  # the fastest step: the CPU is shared, slower steps measure the neighbours


def jax_train_step(cfg, ids):
  model = models.create(cfg)

  @nnx.jit
  def step(model, ids):
    def loss(m):
      logits = m.logits(ids[:, :-1], attention="block_causal", block_size=1)
      return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    return nnx.value_and_grad(loss)(model)

  return lambda: jax.block_until_ready(step(model, ids))


def torch_train_step(cfg, ids, threads):
  import torch
  from transformers import Qwen3Config, Qwen3ForCausalLM
  torch.set_num_threads(threads)
  hf = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                   intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.n_layers,
                   num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                   head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
                   tie_word_embeddings=False)
  model = Qwen3ForCausalLM(hf).train()
  ids_t = torch.tensor(np.asarray(ids), dtype=torch.long)

  def step():
    model.zero_grad(set_to_none=True)
    out = model(ids_t[:, :-1], use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                             ids_t[:, 1:].reshape(-1))
    loss.backward()

  return step


def staircase_seconds(cfg, batch, n_blocks, block, steps):
  model = models.create(cfg)
  n = n_blocks * block
  clean = jax.random.randint(jax.random.PRNGKey(0), (batch, n), 0, cfg.vocab_size)
  noisy = jnp.where(jax.random.bernoulli(jax.random.PRNGKey(1), 0.5, clean.shape),
                    cfg.mask_token_id, clean)

  @functools.partial(nnx.jit, static_argnames="block")
  def one_pass(model, noisy, clean, block):
    return model.staircase_logits(noisy, clean, block_size=block)

  @functools.partial(nnx.jit, static_argnames="block")
  def forward(model, seq, block):
    return model.logits(seq, attention="block_causal", block_size=block)[:, -block:]

  def per_block():
    outs = [forward(model, jnp.concatenate([clean[:, :b * block], noisy[:, b * block:(b + 1) * block]], 1), block)
            for b in range(n_blocks)]
    jax.block_until_ready(outs)

  return _time_interleaved(
      [lambda: jax.block_until_ready(one_pass(model, noisy, clean, block)), per_block], steps)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--blocks", type=int, default=8)
  parser.add_argument("--block", type=int, default=32)
  parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
  parser.add_argument("--skip-torch", action="store_true")
  args = parser.parse_args()
  os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])
  cfg = models.bench_100m(compute_dtype="float32")
  ids = jax.random.randint(jax.random.PRNGKey(0), (args.batch, args.seq + 1), 0, cfg.vocab_size)
  tokens = args.batch * args.seq
  print(f"bench_100m: {cfg.num_params / 1e6:.1f}M params, batch {args.batch} x seq {args.seq}, "
        f"{args.threads} CPU threads, jax {jax.__version__} on {jax.devices()[0].platform}")
  rows = []
  fns = [jax_train_step(cfg, ids)]
  if not args.skip_torch:
    fns.append(torch_train_step(cfg, ids, args.threads))
  times = _time_interleaved(fns, args.steps)
  t_jax = times[0]
  rows.append(("fwd+bwd, JAX/NNX (f32)", f"{tokens / t_jax:,.0f} tok/s", f"{t_jax:.2f} s/step"))
  if not args.skip_torch:
    import torch
    t_torch = times[1]
    rows.append((f"fwd+bwd, transformers Qwen3 / torch {torch.__version__} (f32)",
                 f"{tokens / t_torch:,.0f} tok/s", f"{t_torch:.2f} s/step"))
    rows.append(("ratio JAX / torch", f"{t_torch / t_jax:.2f}x", ""))
  t_one, t_per = staircase_seconds(cfg, args.batch, args.blocks, args.block, args.steps)
  n = args.blocks * args.block
  rows.append((f"staircase one pass, {args.blocks} blocks x {args.block} (len {2 * n})",
               f"{args.batch * n / t_one:,.0f} tok/s", f"{t_one:.2f} s"))
  rows.append((f"per-block forwards, {args.blocks} passes ([clean prefix ; noisy block])",
               f"{args.batch * n / t_per:,.0f} tok/s", f"{t_per:.2f} s"))
  rows.append(("staircase speed-up", f"{t_per / t_one:.2f}x", ""))
  print("| measurement | throughput | time |\n|---|---|---|")
  for row in rows:
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
  main()
