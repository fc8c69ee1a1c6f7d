"""The likelihood estimators side by side on the main job's models: noise, gradient quality and cost
at equal forward budget.

  .venv/bin/python bench/estimators.py --workdir_llada=runs/est_llada --workdir_sdar=runs/est_sdar
  .venv/bin/python bench/estimators.py --smoke       # random tiny models, a few draws (the test)

The workdirs are training runs of `python -m stabledrl_jax.main --config=configs/{llada,sdar}.py
--workdir=DIR --config.checkpoint.every=10 --config.checkpoint.keep=30`: the checkpoint flags
keep the SFT stage's last step (the defaults keep only the last two saves). For each family and
checkpoint (that SFT step, and the run's last step), the policy samples `--prompts` held-out
prompts x G rollouts at the rollout temperature; their rewards give group-centred advantages
`A_b` (`rl.advantage`). Then, for every estimator that applies to the family (`ESTIMATORS`) and
every budget M in `--budgets` (M forwards per sequence):

- **estimate**: the mean per-token estimate of `log p(x)` (nats per counted token), which tells
  the schemes that estimate the ELBO from those that estimate something else;
- **Var[L̂]**: the variance of the sequence log-likelihood estimate over `--draws` independent
  draws, per sequence, averaged over the sequences (per-token scale: a per-sequence estimate is
  divided by the sequence's counted tokens n);
- **Var[log ratio]**: θ' is θ after one Adam step (fresh moments, lr = `rl.lr`) on the StableDRL
  loss with the reference gradient below (at θ = θ_old the StableDRL gradient is exactly
  `∇ Σ_b A_b L_b / B`); the log ratio `L̂_θ'(x) - L̂_θ(x)` over the draws, with coupled masks (the
  same draw for both) and with independent ones (different draws), per token, its variance per
  sequence averaged over the sequences;
- **cos**: the cosine between the M-sample policy gradient `∇ Σ_b A_b L̂_b / B` (the objective's
  own scale) and the reference, mean ± standard error over `--grad_draws` gradient draws;
- **cost**: forwards and token-forwards per sequence (SDAR's staircase forward reads `[x_t ; x_0]`,
  twice the slots), and the wall time of one estimate and of one gradient for the whole batch
  (median over repeats, compiled).

The reference gradient is one common estimator per family, not each scheme's own: the ELBO
estimator the family's SFT stage trains with (`REFERENCE`: random_t for LLaDA, block_t for SDAR)
with `--reference_samples` samples. A per-scheme reference would measure only how fast a scheme
converges to its own limit; against a common unbiased ELBO gradient, a scheme that estimates
another quantity (mean_field, block_random, stratified_l's length weighting) pays for its bias
as well as its noise, which is what the training update feels. The reference is noisy too: from
the spread of the `--reference_samples / 8` independent gradients it averages, the header
estimates the cosine two independent references would have (`ρ = 1 - T/‖ḡ‖²`, `T` the variance
of their mean summed over the coordinates); the cos column's ceiling is about `√ρ`. mean_field's
M samples differ only by the prompt noise (LLaDA's `rl.p_mask_prompt`), or not at all (SDAR).

One row is not an ELBO estimator: `trajectory` (rl.scheme=trajectory) scores the likelihood of
the decoding steps the sampler took, deterministic, with the shrink `s = ceil(sampler.steps / M)`
so that its forwards fit the budget; it is measured beside the others, marked as another quantity,
and never recommended.

Writes ROOT/estimators.md (the date, the exact command, the settings, the table and one
recommendation per family drawn from it) and prints it.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import shlex
import statistics
import sys
import time
from typing import Callable, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

from stabledrl_jax import (build, checkpointing, cli, config_lib, dynamic_sampling,  # noqa: E402
                           estimators, likelihood, losses, metrics, rollouts, samplers,
                           workdir_config)
from stabledrl_jax.tasks import pipeline  # noqa: E402

FAMILIES = ("llada", "sdar")
LABELS = {"llada": "LLaDA", "sdar": "SDAR"}
REFERENCE = {"llada": "random_t", "sdar": "block_t"}  # the family's SFT estimator (config_lib)
REFERENCE_CHUNK = 8  # reference samples per gradient call: the reference is their mean
TRAIN_HINT = ("train with `python -m stabledrl_jax.main --config=configs/{family}.py --workdir=DIR "
              "--config.checkpoint.every=10 --config.checkpoint.keep=30`, which keeps the SFT "
              "stage's last step (always checkpointed) and every 10th")


# ----------------------------------------------------------------------------- estimators


class Family(NamedTuple):
  """What an estimator needs of the family's config (static: part of the compiled calls)."""
  name: str
  staircase: bool       # SDAR: the block-causal likelihood of one `[x_t ; x_0]` forward
  block_size: int       # sampler.block_length
  p_mask_prompt: float  # rl.p_mask_prompt
  steps: int            # sampler.steps (SDAR: per block): the trajectory's decoding steps


class Estimator(NamedTuple):
  """One scheme of the table: how a sequence's log-likelihood is estimated from M forwards.

  `estimate(model, seqs, key, m, fam)` returns `[B]` float32, differentiable in the model, on the
  objective's own scale, from a budget of `m` forwards per sequence (`seqs`: the rollouts as
  `rollouts.from_rollout` gives them); `per_sequence` says that scale is `log p(x)` rather than
  `log p(x)/n` (the table divides such estimates by n). `cost(m, fam, seqs)` gives (forwards,
  token-forwards) per sequence. `applies(family)` says whether the scheme is offered for the
  family, `budget_ok(m)` whether it can spend a budget of `m`. `elbo=False` marks an estimator
  of another quantity than the ELBO (`trajectory`): measured, but never recommended.
  """
  name: str
  estimate: Callable
  cost: Callable
  per_sequence: bool = False
  applies: Callable[[str], bool] = lambda family: True
  budget_ok: Callable[[int], bool] = lambda m: True
  elbo: bool = True


def mask_elbo(scheme: str, model, seqs, key, m: int, fam: Family):
  """The Monte Carlo ELBO of `estimators.sample_masks(scheme)`, `m` masks per sequence: `[B]`."""
  masks = estimators.sample_masks(key, seqs.completion_BxL, scheme=scheme, num_samples=m,
                                  counted_BxL=seqs.counted_BxL, prompt_BxL=seqs.prompt_BxL,
                                  p_mask_prompt=fam.p_mask_prompt, block_size=fam.block_size)
  logp_BxMxL = likelihood.masked_logp(model, seqs, masks.noised_BxMxL, staircase=fam.staircase,
                                      block_size=fam.block_size)
  return losses.mc_elbo(logp_BxMxL, masks.weight_BxMxL)


def mask_cost(m: int, fam: Family, seqs) -> tuple[int, int]:
  """M forwards per sequence, each of every slot (twice the slots through the staircase)."""
  slots = seqs.tokens_BxL.shape[1]
  return m, m * slots * (2 if fam.staircase else 1)


def mask_estimator(scheme: str) -> Estimator:
  """A mask scheme as a table entry. config_lib accepts every scheme for both families, and each
  is a valid estimator under SDAR's staircase (each block is scored given its clean prefix)."""
  budget_ok = (lambda m: m % 2 == 0) if scheme == "complementary" else (lambda m: True)
  return Estimator(scheme, functools.partial(mask_elbo, scheme), mask_cost,
                   per_sequence=scheme == "stratified_l", budget_ok=budget_ok)


def trajectory_forwards(m: int, fam: Family) -> tuple[int, int]:
  """`(J, s)` for a budget of `m` forwards: the shrink `s = ceil(steps / m)`, so the
  `J = ceil(steps / s) <= m` forwards cover every decoding step (fewer than `m` where `m` does not
  divide the steps)."""
  s = -(-fam.steps // m)
  return -(-fam.steps // s), s


def trajectory_logp(model, seqs, key, m: int, fam: Family):
  """TraceRL's (shrunk) trajectory log-likelihood of the rollouts' own decoding steps, `[B]`
  (`likelihood.trajectory`): deterministic, `key` unused. Another quantity than the ELBO."""
  j, s = trajectory_forwards(m, fam)
  masks = likelihood.trajectory(seqs, num_forwards=j, shrink=s,
                                block_size=fam.block_size if fam.staircase else None)
  logp_BxMxL = likelihood.masked_logp(model, seqs, masks.noised_BxMxL, staircase=fam.staircase,
                                      block_size=fam.block_size)
  return losses.mc_elbo(logp_BxMxL, masks.weight_BxMxL)


def trajectory_cost(m: int, fam: Family, seqs) -> tuple[int, int]:
  """`J` forwards per sequence, each of every slot (twice the slots through the staircase)."""
  return mask_cost(trajectory_forwards(m, fam)[0], fam, seqs)


# The table's schemes, one entry each, then the estimators that are not mask draws.
ESTIMATORS: tuple[Estimator, ...] = (
    *(mask_estimator(s) for s in estimators.SCHEMES),
    Estimator(estimators.TRAJECTORY, trajectory_logp, trajectory_cost, per_sequence=True,
              elbo=False),
)


# ----------------------------------------------------------------------------- compiled pieces


@functools.partial(jax.jit, static_argnames=("graphdef", "est", "m", "fam"))
def estimate_once(graphdef, params, rest, seqs, key, *, est, m, fam):
  """One estimate per sequence `[B]` (timed: a behaviour pass's likelihood)."""
  return est.estimate(nnx.merge(graphdef, params, rest), seqs, key, m, fam)


@functools.partial(jax.jit, static_argnames=("graphdef", "est", "m", "fam"))
def estimates_old_new(graphdef, params_old, params_new, rest, seqs, keys_R, *, est, m, fam):
  """`[R, B]` estimates under θ and θ', draw r the same for both (coupled)."""
  def one(key):
    return (est.estimate(nnx.merge(graphdef, params_old, rest), seqs, key, m, fam),
            est.estimate(nnx.merge(graphdef, params_new, rest), seqs, key, m, fam))
  return jax.lax.map(one, keys_R)


@functools.partial(jax.jit, static_argnames=("graphdef", "est", "m", "fam"))
def policy_gradient(graphdef, params, rest, seqs, adv_B, key, *, est, m, fam):
  """`∇_θ Σ_b A_b L̂_b / B` for one draw of `m` samples (the parameters' pytree)."""
  def objective(p):
    return jnp.mean(adv_B * est.estimate(nnx.merge(graphdef, p, rest), seqs, key, m, fam))
  return jax.grad(objective)(params)


def flat(tree) -> np.ndarray:
  return np.asarray(ravel_pytree(tree)[0], np.float64)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
  """cos(a, b); nan when either is zero (e.g. every advantage 0)."""
  na, nb = np.linalg.norm(a), np.linalg.norm(b)
  return float(a @ b / (na * nb)) if na > 0 and nb > 0 else math.nan


def timed(fn, repeats: int) -> tuple[object, float]:
  """(the last result, median wall seconds of `repeats` calls after a first, compiling, one)."""
  out = jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return out, statistics.median(times)


# ----------------------------------------------------------------------------- statistics


def per_token(values_RxB: np.ndarray, n_B: np.ndarray, per_sequence: bool) -> np.ndarray:
  """Estimates on the per-token scale: a per-sequence estimate divided by the counted tokens."""
  return values_RxB / np.maximum(n_B, 1) if per_sequence else values_RxB


def mean_variance(values_RxB: np.ndarray) -> float:
  """The variance over draws (axis 0, unbiased) per sequence, averaged over the sequences."""
  return float(np.mean(np.var(values_RxB, axis=0, ddof=1)))


def ratio_variances(old_RxB: np.ndarray, new_RxB: np.ndarray) -> tuple[float, float]:
  """(coupled, independent) mean variance of the log ratio: draw r under θ' against draw r under
  θ (the same masks), and against draw r+1 (other masks, as `rl.coupling=independent`)."""
  coupled = new_RxB - old_RxB
  independent = new_RxB - np.roll(old_RxB, -1, axis=0)
  return mean_variance(coupled), mean_variance(independent)


def mean_stderr(values: list[float]) -> tuple[float, float]:
  v = [x for x in values if math.isfinite(x)]
  if not v:
    return math.nan, math.nan
  return statistics.fmean(v), (statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else math.nan)


# ----------------------------------------------------------------------------- the package's API


class Policy(NamedTuple):
  """A family's config and the models of the table: (label, model) per checkpoint."""
  config: object
  family: Family
  checkpoints: list
  data: object


def family_settings(c) -> Family:
  return Family(c.family, c.family == "sdar", c.sampler.block_length, float(c.rl.p_mask_prompt),
                c.sampler.steps)


def load_run(workdir: str) -> Policy:
  """The run's config, its SFT stage's last step and its last step (`cli.load_policy`)."""
  c = workdir_config.get_config(workdir)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    steps = sorted(ckpt.all_steps())
  finally:
    ckpt.close()
  sft_step = (metrics.sft_end(workdir) or c.sft.steps) - 1
  if sft_step not in steps:
    raise cli.PolicyError(f"{workdir} keeps steps {steps}, not the SFT stage's last step "
                          f"{sft_step}: {TRAIN_HINT.format(family=c.family)}")
  checkpoints = []
  for label, step in (("SFT", sft_step), ("after RL", steps[-1])):
    model, _, _ = cli.load_policy(c, workdir, step)
    checkpoints.append((f"{label} (step {step})", model))
  tok = build.tokenizer(c)
  return Policy(c, family_settings(c), checkpoints, build.data(c, tok, workdir))


SMOKE = {"model.n_layers": 1, "model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2,
         "model.mlp_dim": 64, "task.num_train": 64, "task.num_test": 16, "eval.num_examples": 16}


def smoke_run(family: str, root: str) -> Policy:
  """A random tiny model of the family (no training), its data under ROOT/smoke_<family>."""
  c = config_lib.base_config(family)
  for key, value in SMOKE.items():
    section, name = key.split(".")
    c[section][name] = value
  config_lib.validate(c)
  model, tok, _ = cli.load_policy(c)
  return Policy(c, family_settings(c), [("random init", model)],
                build.data(c, tok, os.path.join(root, f"smoke_{family}")))


def policy_rollouts(policy: Policy, model, prompts: int, key, smoke: bool):
  """The policy's rollouts on the first `prompts` held-out prompts x G: (Sequences, advantages
  `[B]`, mean reward). Smoke: a random model earns no reward, so the advantages are random numbers
  centred per group."""
  c, data = policy.config, policy.data
  g = c.rl.group_size
  exs = data.test[:prompts]
  enc = pipeline.encode_prompts(data.task, exs, data.tokenizer,
                                max_prompt_len=c.task.max_prompt_len, style=c.task.prompt_style,
                                chat=c.task.chat)
  ids = np.repeat(enc["prompt_ids_BxP"], g, 0)
  mask = np.repeat(enc["prompt_mask_BxP"], g, 0)
  rollout = samplers.generate(model, ids, mask, key,
                              rollouts.sampling_from_config(c, c.sampler.temperature))
  rewards = dynamic_sampling.score(data.tokenizer, rollout, [e for e in exs for _ in range(g)],
                                   data.reward_fn)
  mean_reward = float(np.mean(rewards))
  if smoke:
    rewards, mean_reward = np.random.default_rng(0).normal(size=rewards.shape), math.nan
  adv = losses.group_advantages(jnp.asarray(rewards, jnp.float32), group_size=g,
                                mode=c.rl.advantage)
  return rollouts.from_rollout(rollout), adv, mean_reward


# ----------------------------------------------------------------------------- measurement


class Row(NamedTuple):
  family: str
  checkpoint: str
  scheme: str
  m: int
  estimate: float       # mean per-token estimate
  var_elbo: float       # per token
  var_coupled: float    # log ratio, per token
  var_independent: float
  cos: float
  cos_stderr: float
  forwards: int
  token_forwards: int
  ms_estimate: float
  ms_gradient: float


class Context(NamedTuple):
  """A checkpoint's measurement: its header figures next to the rows."""
  family: str
  checkpoint: str
  rollouts: int
  reward: float
  mean_length: float
  reference_cos: float     # estimated between two independent references (`reference_gradient`)
  reference_ratio: float   # mean |per-token log ratio| of θ' against θ, reference estimator


def reference_gradient(graphdef, params, rest, seqs, adv, key, fam: Family, samples: int):
  """The reference estimator's policy gradient with `samples` samples, `(pytree, flat, ρ)`: the
  mean of `K = samples / REFERENCE_CHUNK` independent draws of `REFERENCE_CHUNK` (its samples are
  i.i.d., so that is a `samples`-sample draw), and `ρ = reference_agreement(...)`."""
  est = next(e for e in ESTIMATORS if e.name == REFERENCE[fam.name])
  chunk = min(REFERENCE_CHUNK, samples)
  k = samples // chunk
  total, flats = None, []
  for i in range(k):
    g = policy_gradient(graphdef, params, rest, seqs, adv, jax.random.fold_in(key, i), est=est,
                        m=chunk, fam=fam)
    total = g if total is None else jax.tree.map(jnp.add, total, g)
    flats.append(flat(g))
  return jax.tree.map(lambda x: x / k, total), np.mean(flats, axis=0), reference_agreement(flats)


def reference_agreement(flats: list[np.ndarray]) -> float:
  """The cosine two independent means of `K` draws like `flats` would have: `(‖ḡ‖² - T) / ‖ḡ‖²`,
  `T = Σ_k ‖g_k - ḡ‖² / (K (K-1))` the estimated noise of the mean `ḡ` (nan for K < 2)."""
  k = len(flats)
  if k < 2:
    return math.nan
  mean = np.mean(flats, axis=0)
  noise = sum(float(np.sum((f - mean) ** 2)) for f in flats) / (k * (k - 1))
  size = float(mean @ mean)
  return (size - noise) / size if size > 0 else math.nan


def measure_scheme(est: Estimator, m: int, fam: Family, label: str, split, seqs, adv, n_B,
                   ref_flat: np.ndarray, key, args) -> tuple[Row, float]:
  """One row of the table, and the mean |log ratio| per token of θ' against θ under `est`.
  `split` is `(graphdef, params θ, params θ', rest)`."""
  graphdef, params, params_new, rest = split
  kw = dict(est=est, m=m, fam=fam)
  old, new = jax.device_get(estimates_old_new(graphdef, params, params_new, rest, seqs,
                                              jax.random.split(key, args.draws), **kw))
  old = per_token(np.asarray(old, np.float64), n_B, est.per_sequence)
  new = per_token(np.asarray(new, np.float64), n_B, est.per_sequence)
  coupled, independent = ratio_variances(old, new)
  _, t_est = timed(lambda: estimate_once(graphdef, params, rest, seqs, key, **kw), args.repeats)
  cos, t_grad = [], []
  for i in range(args.grad_draws):  # the first compiles: left out of the times
    t0 = time.perf_counter()
    g = jax.block_until_ready(policy_gradient(graphdef, params, rest, seqs, adv,
                                              jax.random.fold_in(key, 1000 + i), **kw))
    if i:
      t_grad.append(time.perf_counter() - t0)
    cos.append(cosine(flat(g), ref_flat))
  cos_mean, cos_err = mean_stderr(cos)
  forwards, token_forwards = est.cost(m, fam, seqs)
  row = Row(fam.name, label, est.name, m, float(np.mean(old)), mean_variance(old), coupled,
            independent, cos_mean, cos_err, forwards, token_forwards, 1e3 * t_est,
            1e3 * statistics.median(t_grad) if t_grad else math.nan)
  return row, float(np.mean(np.abs(np.mean(new - old, axis=0))))


def measure(policy: Policy, label: str, model, args, key) -> tuple[Context, list[Row]]:
  """Every estimator and budget on one checkpoint's rollouts."""
  fam = policy.family
  k_roll, k_ref, k_draw = jax.random.split(key, 3)
  seqs, adv, reward = policy_rollouts(policy, model, args.prompts, k_roll, args.smoke)
  n_B = np.asarray(jnp.sum(seqs.counted_BxL, -1), np.float64)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  g_ref, ref_flat, ref_cos = reference_gradient(graphdef, params, rest, seqs, adv, k_ref, fam,
                                                args.reference_samples)
  # One Adam step on the StableDRL loss (-J: its gradient at θ_old is -g_ref).
  c = policy.config
  opt = optax.adam(c.rl.lr, b1=c.optim.b1, b2=c.optim.b2)
  updates, _ = opt.update(jax.tree.map(jnp.negative, g_ref), opt.init(params), params)
  params_new = optax.apply_updates(params, updates)

  rows, reference_ratio = [], math.nan
  for index, est in enumerate(ESTIMATORS):
    if not est.applies(fam.name):
      continue
    for m in args.budgets:
      if not est.budget_ok(m):
        continue
      key_est = jax.random.fold_in(jax.random.fold_in(k_draw, index), m)
      row, ratio = measure_scheme(est, m, fam, label, (graphdef, params, params_new, rest),
                                  seqs, adv, n_B, ref_flat, key_est, args)
      rows.append(row)
      if est.name == REFERENCE[fam.name] and m == max(args.budgets):
        reference_ratio = ratio
      print(f"  {LABELS[fam.name]}, {label}, {est.name}, M={m}: cos {row.cos:.3f}", flush=True)
  ctx = Context(fam.name, label, int(n_B.size), reward, float(np.mean(n_B)), ref_cos,
                reference_ratio)
  return ctx, rows


# ----------------------------------------------------------------------------- output


def fmt(x: float, spec: str = ".3g") -> str:
  return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{spec}}"


HEADER = ("family", "checkpoint", "scheme", "M", "estimate (nats/token)", "Var[L̂] (per token)",
          "Var[log ratio], coupled", "Var[log ratio], independent", "cos(ĝ, g_ref)",
          "forwards / seq", "token-forwards / seq", "ms / estimate", "ms / gradient")


def table(rows: list[Row]) -> str:
  lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
  for r in rows:
    cells = [LABELS[r.family], r.checkpoint, r.scheme, str(r.m), fmt(r.estimate, ".4f"),
             fmt(r.var_elbo), fmt(r.var_coupled), fmt(r.var_independent),
             f"{fmt(r.cos, '.3f')} ± {fmt(r.cos_stderr, '.3f')}", str(r.forwards),
             str(r.token_forwards), fmt(r.ms_estimate, ".1f"), fmt(r.ms_gradient, ".1f")]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def recommendation(rows: list[Row], family: str, default: str) -> str:
  """The family's line. Per budget M, each scheme's cosine to the reference averaged over the
  checkpoints (standard error from the draws); the best is the highest, or among those within two
  standard errors of it, the one with the lowest coupled log-ratio variance. A scheme is
  recommended over the family's default `rl.scheme` only where it beats the default's cosine by
  more than two standard errors of the difference, at every budget. Estimators of another
  quantity than the ELBO (`Estimator.elbo`) are left out."""
  other = {e.name for e in ESTIMATORS if not e.elbo}
  mine = [r for r in rows if r.family == family and r.scheme not in other]
  if not mine:
    return ""
  parts, verdicts = [], []
  for m in sorted({r.m for r in mine}):
    by_scheme: dict[str, list[Row]] = {}
    for r in mine:
      if r.m == m and math.isfinite(r.cos):
        by_scheme.setdefault(r.scheme, []).append(r)
    summary = {s: (statistics.fmean(r.cos for r in rs),
                   math.sqrt(sum(r.cos_stderr**2 for r in rs if math.isfinite(r.cos_stderr)))
                   / len(rs),
                   statistics.fmean(r.var_coupled for r in rs),
                   all(r.var_elbo == 0 for r in rs)) for s, rs in by_scheme.items()}
    if not summary:
      continue
    top_cos, top_err = max((v[0], v[1]) for v in summary.values())
    close = [s for s, v in summary.items() if v[0] >= top_cos - 2 * math.hypot(v[1], top_err)]
    best = min(close, key=lambda s: summary[s][2])
    cos, err, var, fixed = summary[best]
    text = f"M={m}: {best} cos {cos:.3f} ± {err:.3f}, Var[log ratio] {var:.3g}"
    text += " (deterministic: its cosine is its bias alone)" if fixed else ""
    beats = False
    if default in summary and default != best:
      d_cos, d_err, d_var, _ = summary[default]
      beats = cos - d_cos > 2 * math.hypot(err, d_err)
      text += f"; the default {default} {d_cos:.3f} ± {d_err:.3f}, {d_var:.3g}"
    parts.append(text)
    verdicts.append((m, best, beats))
  if not verdicts:
    return f"- **{LABELS[family]}**: no finite cosine (every advantage zero?)"
  winners = {b for _, b, beats in verdicts if beats}
  if len(winners) == 1 and all(beats for _, _, beats in verdicts):
    head = (f"use `rl.scheme={winners.pop()}`: its gradient agrees with the reference better than "
            f"the default's by more than two standard errors at every budget")
  elif not winners:
    head = (f"keep `rl.scheme={default}`: no scheme's gradient agrees with the reference better "
            "than the default's by more than two standard errors")
  else:
    head = (f"no single scheme beats `rl.scheme={default}` at every budget; "
            + ", ".join(f"{b} beats it at M={m}" for m, b, beats in verdicts if beats))
  return (f"- **{LABELS[family]}**: {head}. Best per budget, cosine averaged over the checkpoints: "
          + "; ".join(parts) + ".")


def report(contexts: list[Context], rows: list[Row], defaults: dict[str, str], args) -> str:
  lines = ["# Likelihood estimators at equal forward budget", "",
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `{shlex.join(sys.orig_argv)}`", "",
           f"Per checkpoint: {args.prompts} held-out prompts x G rollouts from the policy; "
           f"{args.draws} draws per estimator for the variances; {args.grad_draws} gradient draws for "
           f"the cosine; reference: {args.reference_samples} samples of "
           + ", ".join(f"{REFERENCE[f]} ({LABELS[f]})" for f in FAMILIES) + "; θ' = one Adam step "
           "along the reference gradient of the StableDRL loss at lr = rl.lr; seed "
           f"{args.seed}. Variances on the per-token scale (stratified_l's per-sequence estimate "
           "divided by n; in the objective its log ratio is n times as large). The coupled log "
           "ratio uses the same draw under θ and θ', the independent one another draw. "
           "trajectory scores another quantity: the likelihood of the decoding steps the sampler "
           "took (TraceRL, rl.scheme=trajectory), per sequence, deterministic, with the shrink "
           "s = ceil(sampler.steps / M) (its forwards column: ceil(steps / s) <= M); it is not an "
           "ELBO estimate, its cos says how far its gradient is from the ELBO's, and it is left "
           "out of the recommendation. Wall times: "
           f"median of {args.repeats} compiled calls for the batch, on {jax.devices()[0].platform} "
           f"({os.cpu_count()} cores, shared with whatever else ran).", ""]
  for ctx in contexts:
    lines.append(f"- {LABELS[ctx.family]}, {ctx.checkpoint}: {ctx.rollouts} rollouts, mean reward "
                 f"{fmt(ctx.reward, '.3f')}, {ctx.mean_length:.1f} counted tokens each; two "
                 f"independent references would agree to cos {fmt(ctx.reference_cos, '.3f')} (so the cos "
                 f"column's ceiling is about {fmt(math.sqrt(max(ctx.reference_cos, 0.0)), '.3f')}, "
                 "its square root); θ' moves the reference "
                 f"estimate by |log ratio| {fmt(ctx.reference_ratio)} per token on average")
  lines += ["", table(rows), "", "Recommendation (drawn from the table):", ""]
  lines += [recommendation(rows, f, defaults[f]) for f in FAMILIES if f in defaults]
  return "\n".join(line for line in lines if line is not None) + "\n"


def parse_budgets(text: str) -> list[int]:
  budgets = [int(b) for b in text.split(",") if b]
  if not budgets or min(budgets) < 1:
    raise ValueError(f"--budgets={text!r}: expected positive integers, e.g. 2,4")
  return budgets


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir_llada", default=None, help="a LLaDA training run (see the docstring)")
  p.add_argument("--workdir_sdar", default=None, help="an SDAR training run")
  p.add_argument("--smoke", action="store_true", help="random tiny models instead of the runs")
  p.add_argument("--root", default="runs/estimators", help="where estimators.md goes")
  p.add_argument("--prompts", type=int, default=8, help="held-out prompts (x G rollouts)")
  p.add_argument("--budgets", default="2,4", help="forwards per sequence M, comma-separated")
  p.add_argument("--draws", type=int, default=16, help="estimate draws for the variances")
  p.add_argument("--grad_draws", type=int, default=4, help="gradient draws for the cosine")
  p.add_argument("--reference_samples", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3, help="timed calls per wall-time figure")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  try:
    args.budgets = parse_budgets(args.budgets)
  except ValueError as e:
    sys.exit(f"error: {e}")
  if args.reference_samples % min(REFERENCE_CHUNK, args.reference_samples):
    sys.exit(f"error: --reference_samples={args.reference_samples}: expected a multiple of "
             f"{REFERENCE_CHUNK}")
  workdirs = {"llada": args.workdir_llada, "sdar": args.workdir_sdar}
  if not args.smoke and not any(workdirs.values()):
    sys.exit("error: give --workdir_llada and/or --workdir_sdar (training runs), or --smoke")
  root = os.path.abspath(args.root)
  os.makedirs(root, exist_ok=True)

  contexts, rows, defaults = [], [], {}
  for i, family in enumerate(FAMILIES):
    if not args.smoke and not workdirs[family]:
      continue
    try:
      policy = smoke_run(family, root) if args.smoke else load_run(workdirs[family])
    except (cli.PolicyError, FileNotFoundError) as e:
      sys.exit(f"error: {e}")
    defaults[family] = policy.config.rl.scheme
    for j, (label, model) in enumerate(policy.checkpoints):
      t0 = time.time()
      ctx, found = measure(policy, label, model, args, jax.random.key(args.seed * 100 + 10 * i + j))
      contexts.append(ctx)
      rows += found
      print(f"{LABELS[family]}, {label}: {len(found)} rows in {time.time() - t0:.0f} s", flush=True)
  text = report(contexts, rows, defaults, args)
  print("\n" + text)
  with open(os.path.join(root, "estimators.md"), "w") as f:
    f.write(text)
  print(f"table: {os.path.join(root, 'estimators.md')}")


if __name__ == "__main__":
  main()
