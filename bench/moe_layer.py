"""The mixture-of-experts layer (`models.moe.MoE`: routing + dropless experts + shared experts),
with each grouped-matmul formulation (`moe_impl`), against a dense SwiGLU of the same active
width: forward+backward tokens/s on this machine, in one run, timed interleaved. Prints a
markdown table with the ratios.

  .venv/bin/python bench/moe_layer.py --tokens 4096 --d-model 512 --experts 64 --active 4 \
      --expert-dim 256 --steps 5

The dense layer's width is (active + shared) x expert-dim: the same multiply-adds per token as
the chosen and shared experts (the router adds d_model x experts).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from bench.model_throughput import _time_interleaved  # noqa: E402
from stabledrl_jax import models  # noqa: E402
from stabledrl_jax.models import transformer  # noqa: E402


def _step(layer, x_MxD, moe: bool):
  @nnx.jit
  def step(layer, x):
    def loss(m):
      y = m(x)[0] if moe else m(x)
      return jnp.mean(y * y)
    return nnx.value_and_grad(loss)(layer)

  return lambda: jax.block_until_ready(step(layer, x_MxD))


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", type=int, default=4096)
  p.add_argument("--d-model", type=int, default=512)
  p.add_argument("--experts", type=int, default=64)
  p.add_argument("--active", type=int, default=4)
  p.add_argument("--shared", type=int, default=1)
  p.add_argument("--expert-dim", type=int, default=256)
  p.add_argument("--groups", type=int, default=8)
  p.add_argument("--steps", type=int, default=5)
  a = p.parse_args(argv)
  cfg = models.llada2_tiny(d_model=a.d_model, num_experts=a.experts, num_experts_per_tok=a.active,
                           num_shared_experts=a.shared, moe_intermediate_size=a.expert_dim,
                           n_group=a.groups, topk_group=max(1, a.groups // 2),
                           compute_dtype="float32")
  x = jax.random.normal(jax.random.key(1), (a.tokens, a.d_model), jnp.float32)
  steps, names = [], []
  for impl in models.moe.IMPLS:
    rngs = nnx.Rngs(0)
    shared = transformer.SwiGLU(cfg, a.expert_dim * a.shared, rngs=rngs) if a.shared else None
    layer = models.moe.MoE(models.replace(cfg, moe_impl=impl), rngs=rngs, shared_mlp=shared)
    steps.append(_step(layer, x, True))
    names.append(f"MoE ({impl}): {a.experts} experts, {a.active} active + {a.shared} shared of "
                 f"{a.expert_dim}")
  dense = transformer.SwiGLU(cfg, a.expert_dim * (a.active + a.shared), rngs=nnx.Rngs(0))
  steps.append(_step(dense, x, False))
  names.append(f"dense SwiGLU of {a.expert_dim * (a.active + a.shared)}")
  times = _time_interleaved(steps, a.steps)
  print(f"| layer (d={a.d_model}, {a.tokens} tokens, fwd+bwd, {jax.devices()[0].device_kind}) "
        "| tokens/s | dense / this (time) |\n|---|---|---|")
  for name, t in zip(names, times):
    print(f"| {name} | {a.tokens / t:,.0f} | {times[-1] / t:.2f} |")


if __name__ == "__main__":
  main()
