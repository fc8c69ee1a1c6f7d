"""How far can one RL update move a trained model before its reward falls? A line search along the
policy-gradient direction from a run's latest checkpoint.

  .venv/bin/python bench/rl_step_probe.py --config=configs/sdar.py --workdir=runs/sdar_tiny

It averages the configured objective's gradient over `--batches` fresh rollout batches of
`--prompts` held-out prompts x G, then, for each step length η in `--etas`, moves the parameters
by η along the unit gradient direction (η is an L2 distance in parameter space) and measures the
mean rollout reward on the same prompts (common random numbers: the same sampling keys for every
η). A second column does the same with the embedding table left out of the direction. An Adam
update moves about `lr · sqrt(#params)` in L2, so the table says which learning rates can work.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from stabledrl_jax import (build, checkpointing, config_lib, dynamic_sampling,  # noqa: E402
                           losses, objectives, optim, rl, rollouts, samplers)
from stabledrl_jax.tasks import pipeline  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/sdar.py", help="FILE[:PRESET], as for main")
  p.add_argument("--workdir", required=True, help="a run directory with checkpoints")
  p.add_argument("--prompts", type=int, default=64)
  p.add_argument("--batches", type=int, default=4)
  p.add_argument("--etas", default="0,0.03,0.1,0.2")
  args = p.parse_args()
  path, _, preset = config_lib.resolve_config_arg(args.config).partition(":")
  spec = importlib.util.spec_from_file_location("config_file", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(preset or "tiny")

  tok = build.tokenizer(c)
  data = build.data(c, tok, args.workdir)
  model = build.model(c, tok)
  ckpt = checkpointing.Checkpointer(os.path.join(args.workdir, "checkpoints"))
  step = ckpt.latest_step()
  if step is None:
    sys.exit(f"error: no checkpoint under {args.workdir}/checkpoints")
  optimizer = nnx.Optimizer(model, optim.make_optimizer(c.rl.lr, 0, 1, c.optim), wrt=nnx.Param)
  ckpt.restore(step, model, optimizer)

  g = c.rl.group_size
  exs = data.test[:args.prompts]
  enc = pipeline.encode_prompts(data.task, exs, tok, max_prompt_len=c.task.max_prompt_len,
                                style=c.task.prompt_style, chat=c.task.chat)
  ids = np.repeat(enc["prompt_ids_BxP"], g, 0)
  mask = np.repeat(enc["prompt_mask_BxP"], g, 0)
  examples = [e for e in exs for _ in range(g)]
  sampling = rollouts.sampling_from_config(c, c.sampler.temperature)
  obj = objectives.Objective.from_config(c)

  def mean_reward(m) -> float:
    return float(np.mean([dynamic_sampling.score(
        data.tokenizer, samplers.generate(m, ids, mask, jax.random.key(k), sampling),
                                      examples, data.reward_fn).mean() for k in (1, 2)]))

  grads = None
  for i in range(args.batches):
    rollout = samplers.generate(model, ids, mask, jax.random.key(100 + i), sampling)
    adv = losses.group_advantages(jnp.asarray(
        dynamic_sampling.score(data.tokenizer, rollout, examples, data.reward_fn)),
                                  group_size=g, mode=c.rl.advantage)
    seqs = rollouts.from_rollout(rollout)
    batch, _ = rl.behaviour_pass(model, None, seqs, adv, jax.random.key(7 + i), obj)
    gi = nnx.grad(lambda m: objectives.policy_loss(m, batch, jax.random.key(0), obj)[0])(model)
    grads = gi if grads is None else jax.tree.map(jnp.add, grads, gi)

  params = nnx.state(model, nnx.Param)
  no_embed = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if "embed" in jax.tree_util.keystr(path) else x, grads)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"checkpoint step {step}, {n_params} parameters, objective {obj.name}, scheme {obj.scheme}, "
        f"T={c.sampler.temperature}, {args.batches}x{args.prompts}x{g} rollouts for the gradient")
  print("| η (L2) | Adam lr with that step | reward, full gradient | reward, embeddings fixed |")
  print("|---|---|---|---|")
  for eta in (float(e) for e in args.etas.split(",")):
    row = []
    for direction in (grads, no_embed):
      norm = optax.tree.norm(direction)
      moved = nnx.clone(model)
      nnx.update(moved, jax.tree.map(lambda x, d: x - eta * d / norm, params, direction))
      row.append(mean_reward(moved))
    print(f"| {eta:g} | {eta / np.sqrt(n_params):.1e} | {row[0]:.3f} | {row[1]:.3f} |", flush=True)


if __name__ == "__main__":
  main()
