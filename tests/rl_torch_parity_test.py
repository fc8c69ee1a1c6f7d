"""One update end to end against torch autograd: masks -> forward -> per-token log-probs -> ELBO ->
ratio -> weights -> loss -> gradient -> clipped AdamW step.

The torch side is written from the definitions, in float64: its own forward of the same
architecture (full attention for LLaDA; Dream's full attention with q/k/v biases and its
logits shifted one slot right; the dual-stream staircase for SDAR, its attention rule written out;
LLaDA2.0's fused q/k/v, partial rotary and mixture of experts on the same staircase), its own ELBO, clip, self-normalisation, EUBO, GRPO clip and AdamW. It is handed
only what the project drew: the rollout tokens, the masks and, where they cannot be read off a
mask (`block_t` and `random_t` draw a hidden rate per sample), the estimator weights.
"""
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from stabledrl_jax import (config_lib, likelihood, losses, models, objectives, optim, rollouts,
                           sft, train)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

P, C, BS, G, GROUPS = 4, 12, 4, 4, 2   # prompt, completion, block, group size, groups
B, T = G * GROUPS, P + C
LR, B1, B2, WD = 1e-2, 0.9, 0.99, 0.1


# ----------------------------------------------------------------------------- the project side


def _model(family, seed):
  if family == "llada":
    cfg = models.tiny(**models.family_options("llada"), n_kv_heads=4, rope_theta=500000.0,
                      norm_eps=1e-5)
  elif family == "dream":
    cfg = models.tiny(**models.family_options("dream"), n_kv_heads=2)
  elif family == "llada2":
    cfg = models.llada2_tiny(moe_intermediate_size=16)
  else:
    cfg = models.tiny()
  return models.create(cfg, seed=seed)


def _old_model(model, seed):
  """The behaviour policy: the same weights moved by noise, so ratios differ from 1."""
  old = train.copy_module(model)
  graphdef, params, rest = nnx.split(old, nnx.Param, ...)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [x + 0.01 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), rest)


def _seqs(seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, 120, size=(B, T))
  lengths = rng.integers(3, C + 1, size=B)
  pos = np.arange(T)[None, :]
  completion = np.broadcast_to(pos >= P, (B, T))
  counted = completion & (pos < P + lengths[:, None])
  tokens = np.where(completion & ~counted, 1, tokens)  # end-of-sequence padding after the answer
  tokens[np.arange(B), P + lengths - 1] = 1            # the first EOS, counted
  as_j = lambda x: jnp.asarray(np.ascontiguousarray(x))
  return rollouts.Sequences(as_j(tokens), as_j(np.broadcast_to(pos, (B, T))),
                              as_j(np.ones((B, T), bool)), as_j(~completion), as_j(completion),
                              as_j(counted))


_behaviour = nnx.jit(objectives.behaviour_logp, static_argnames="obj")  # jitted: eager is slower
_draw = jax.jit(objectives._draw_masks, static_argnames="obj")


def _named(m):
  """Every parameter of the model by a flat name, float64 NumPy."""
  out = {"embed": m.embed.embedding, "final_norm": m.final_norm.scale, "head": m.head.kernel}
  for i, blk in enumerate(m.blocks):
    a = blk.attn
    out.update({f"{i}.attn_norm": blk.attn_norm.scale, f"{i}.mlp_norm": blk.mlp_norm.scale,
                f"{i}.o": a.o_proj.kernel})
    if hasattr(a, "qkv_proj"):  # LLaDA2.0
      out[f"{i}.qkv"] = a.qkv_proj.kernel
    else:
      out.update({f"{i}.q": a.q_proj.kernel, f"{i}.k": a.k_proj.kernel, f"{i}.v": a.v_proj.kernel})
    if hasattr(blk, "moe"):
      e, sh = blk.moe, blk.moe.shared_experts
      out.update({f"{i}.router": e.router, f"{i}.expert_bias": e.expert_bias,
                  f"{i}.experts_gate": e.gate_kernel, f"{i}.experts_up": e.up_kernel,
                  f"{i}.experts_down": e.down_kernel, f"{i}.shared_gate": sh.gate_proj.kernel,
                  f"{i}.shared_up": sh.up_proj.kernel, f"{i}.shared_down": sh.down_proj.kernel})
    else:
      out.update({f"{i}.gate": blk.gate_proj.kernel, f"{i}.up": blk.up_proj.kernel,
                  f"{i}.down": blk.down_proj.kernel})
    if a.q_norm is not None:
      out.update({f"{i}.q_norm": a.q_norm.scale, f"{i}.k_norm": a.k_norm.scale})
    if getattr(a, "q_proj", None) is not None and a.q_proj.bias is not None:  # Dream
      out.update({f"{i}.{n}_bias": p.bias for n, p in
                  (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj))})
  assert len(out) == len(jax.tree.leaves(nnx.state(m, nnx.Param)))  # nothing left out
  return {k: np.asarray(v[...], np.float64) for k, v in out.items()}


def _project_step(model, loss_fn, grad_clip):
  """The project's gradient of `loss_fn(model)` and its parameters after one optimiser step."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  grads = jax.jit(jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest))))(params)
  o = ml_collections.ConfigDict(dict(b1=B1, b2=B2, weight_decay=WD, grad_clip=grad_clip,
                                     decay_steps=0))
  tx = optim.make_optimizer(LR, 0, 100, o)

  @jax.jit
  def step(grads, params):
    return optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])

  new = step(grads, params)
  return _named(nnx.merge(graphdef, grads, rest)), _named(nnx.merge(graphdef, new, rest))


# ----------------------------------------------------------------------------- the torch side


def _t(x, dtype=torch.float64):
  return torch.tensor(np.asarray(x), dtype=dtype)


def _allowed(family, positions_NxL):
  """Attention allowed `[N, Q, K]`: everything (LLaDA, Dream), or the staircase over `[x_t ; x_0]`."""
  if family in ("llada", "dream"):
    n, t = positions_NxL.shape
    return torch.ones(n, t, t, dtype=torch.bool)
  blk = positions_NxL // BS
  blk2 = torch.cat([blk, blk], 1)
  n, t = positions_NxL.shape
  noisy = torch.cat([torch.ones(n, t, dtype=torch.bool), torch.zeros(n, t, dtype=torch.bool)], 1)
  qb, kb = blk2[:, :, None], blk2[:, None, :]
  qn, kn = noisy[:, :, None], noisy[:, None, :]
  return ((qn & kn & (kb == qb)) | (qn & ~kn & (kb < qb)) | (~qn & ~kn & (kb <= qb)))


def _t_logits(w, cfg, ids_NxL, positions_NxL, allowed_NxQxK):
  def norm(x, scale):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * scale

  h, r = cfg.head_dim, cfg.rotary_dim  # RoPE on the first r dims of each head
  inv = 1.0 / cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
  ang = positions_NxL.double()[..., None] * inv
  cos, sin = torch.cat([ang.cos()] * 2, -1)[:, :, None], torch.cat([ang.sin()] * 2, -1)[:, :, None]

  def rope(x):
    x_rot = x[..., :r]
    rotated = x_rot * cos + torch.cat([-x_rot[..., r // 2:], x_rot[..., :r // 2]], -1) * sin
    return torch.cat([rotated, x[..., r:]], -1)

  def swiglu(y, gate, up, down):
    return (torch.nn.functional.silu(y @ gate) * (y @ up)) @ down

  def moe(y, i):  # LLaDA2.0's router: sigmoid, expert bias and groups choose, unbiased weights
    scores = torch.sigmoid(y @ w[f"{i}.router"])
    choice = (scores + w[f"{i}.expert_bias"]).detach()
    e, g = choice.shape[-1], cfg.n_group
    group = choice.view(n, t, g, e // g).topk(2, -1).values.sum(-1)
    kept = torch.zeros_like(group).scatter(-1, group.topk(cfg.topk_group, -1).indices, 1.0)
    allowed = kept.repeat_interleave(e // g, -1).bool()
    idx = choice.masked_fill(~allowed, float("-inf")).topk(cfg.num_experts_per_tok, -1).indices
    wk = scores.gather(-1, idx)
    wk = wk / (wk.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    weight = torch.zeros_like(scores).scatter(-1, idx, wk)  # [n, t, experts]
    hidden = (torch.nn.functional.silu(torch.einsum("ntd,edf->ntef", y, w[f"{i}.experts_gate"]))
              * torch.einsum("ntd,edf->ntef", y, w[f"{i}.experts_up"]))
    per_expert = torch.einsum("ntef,efd->nted", hidden, w[f"{i}.experts_down"])  # every expert
    return (torch.einsum("nte,nted->ntd", weight, per_expert)
            + swiglu(y, w[f"{i}.shared_gate"], w[f"{i}.shared_up"], w[f"{i}.shared_down"]))

  n, t = ids_NxL.shape
  x = w["embed"][ids_NxL]
  for i in range(cfg.n_layers):
    y = norm(x, w[f"{i}.attn_norm"])
    if f"{i}.qkv" in w:  # fused: [q heads | k heads | v heads]
      q, k, v = (y @ w[f"{i}.qkv"]).view(n, t, -1, h).split(
          [cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads], 2)
    else:
      q, k, v = (y @ w[f"{i}.{p}"] + w.get(f"{i}.{p}_bias", 0.0) for p in "qkv")
    q = q.reshape(n, t, cfg.n_heads, h)
    k, v = k.reshape(n, t, cfg.n_kv_heads, h), v.reshape(n, t, cfg.n_kv_heads, h)
    if cfg.qk_norm:
      q, k = norm(q, w[f"{i}.q_norm"]), norm(k, w[f"{i}.k_norm"])
    q, k = rope(q), rope(k)
    rep = cfg.n_heads // cfg.n_kv_heads
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("nqhd,nkhd->nhqk", q, k) / h ** 0.5
    s = s.masked_fill(~allowed_NxQxK[:, None], float("-inf"))
    o = torch.einsum("nhqk,nkhd->nqhd", torch.softmax(s, -1), v).reshape(n, t, -1)
    x = x + o @ w[f"{i}.o"]
    y = norm(x, w[f"{i}.mlp_norm"])
    x = x + (moe(y, i) if f"{i}.router" in w
             else swiglu(y, w[f"{i}.gate"], w[f"{i}.up"], w[f"{i}.down"]))
  return norm(x, w["final_norm"]) @ w["head"]


def _t_logp(w, cfg, family, seqs, noised_BxMxL):
  """log p(x_i | x_t) `[B, M, L]`: each masked copy through the torch forward."""
  tokens = _t(seqs.tokens_BxL, torch.long)
  noised = _t(noised_BxMxL, torch.bool)
  m = noised.shape[1]
  clean = tokens[:, None].expand(B, m, T)
  noisy = torch.where(noised, cfg.mask_token_id, clean).reshape(B * m, T)
  pos = _t(seqs.positions_BxL, torch.long).repeat_interleave(m, 0)
  if family == "llada":
    logits = _t_logits(w, cfg, noisy, pos, _allowed(family, pos))
  elif family == "dream":  # slot i's logits are slot i - 1's output (slot 0 keeps its own)
    logits = _t_logits(w, cfg, noisy, pos, _allowed(family, pos))
    logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
  else:
    ids = torch.cat([noisy, clean.reshape(B * m, T)], 1)
    logits = _t_logits(w, cfg, ids, torch.cat([pos, pos], 1), _allowed(family, pos))[:, :T]
  lp = torch.log_softmax(logits, -1).gather(-1, clean.reshape(B * m, T)[..., None])[..., 0]
  return lp.view(B, m, T)


def _t_block_random_weights(noised_BxMxL, counted_BxL):
  hit = _t(noised_BxMxL, torch.bool) & _t(counted_BxL, torch.bool)[:, None]
  return hit.double() / hit.sum(-1, keepdim=True).clamp(min=1)


def _t_loss(name, lp_new, lp_old, w_new, w_old, noised_new, noised_old, counted, rewards, obj):
  """The objective from its formulas, per group of G rows."""
  r = _t(rewards).view(GROUPS, G)
  adv = (r - r.mean(-1, keepdim=True)).view(-1)
  if name == "grpo":  # per token: mean log-prob over the samples that masked it, PPO clip
    nn_, no_ = _t(noised_new, torch.bool), _t(noised_old, torch.bool)
    tok_new = (lp_new * nn_).sum(1) / nn_.sum(1).clamp(min=1)
    tok_old = (lp_old * no_).sum(1) / no_.sum(1).clamp(min=1)
    ratio = torch.exp(tok_new - tok_old)
    eps = obj.epsilon
    per_tok = -torch.minimum(ratio * adv[:, None], ratio.clamp(1 - eps, 1 + eps) * adv[:, None])
    keep = _t(counted, torch.bool) & (nn_.sum(1) > 0)
    per_seq = (per_tok * keep).sum(-1) / keep.sum(-1).clamp(min=1)
    return per_seq[keep.any(-1)].mean()
  elbo_new = (w_new * lp_new).sum(-1).mean(-1)
  elbo_old = (w_old * lp_old).sum(-1).mean(-1)
  log_ratio = (elbo_new - elbo_old).detach()
  if obj.max_ratio is not None:
    clipped = log_ratio.clamp(max=float(np.log(obj.max_ratio)))
  else:
    clipped = log_ratio.clamp(min=float(np.log(1 - obj.epsilon)), max=float(np.log1p(obj.epsilon)))
  alpha = torch.softmax(clipped.view(GROUPS, G), -1).view(-1)
  surrogate = elbo_new
  if name == "stabledrl_spg":  # EUBO on A <= 0: (1/β) mean_tokens log mean_M p^β 1(masked) / t̂
    beta = obj.spg_beta
    cnt = _t(counted, torch.bool)
    mk = _t(noised_new, torch.bool) & cnt[:, None]
    t_hat = mk.sum(-1).double() / cnt.sum(-1, keepdim=True)
    inner = (torch.exp(beta * lp_new) * mk / t_hat[..., None]).mean(1)
    seen = mk.any(1)
    eubo = (torch.where(seen, torch.log(torch.where(seen, inner, torch.ones_like(inner))), 0.0)
            .sum(-1) / seen.sum(-1) / beta)
    surrogate = torch.where(adv > 0, elbo_new,
                            obj.spg_omega * eubo + (1 - obj.spg_omega) * elbo_new)
  return -(alpha * adv * surrogate).view(GROUPS, G).sum(-1).mean()


def _torch_grads(start, loss_fn):
  w = {k: _t(v).requires_grad_() for k, v in start.items()}
  loss_fn(w).backward()
  # No gradient reaches the expert bias (it only moves the discrete choice): zero.
  return {k: v.grad.numpy() if v.grad is not None else np.zeros(v.shape) for k, v in w.items()}


def _torch_adamw(start, grads, grad_clip):
  """torch's global-norm clip and AdamW, one step from `start` with the given gradients."""
  w = {k: _t(v).requires_grad_() for k, v in start.items()}
  for k, v in w.items():
    v.grad = _t(grads[k])
  torch.nn.utils.clip_grad_norm_(list(w.values()), grad_clip)
  torch.optim.AdamW(list(w.values()), lr=LR, betas=(B1, B2), eps=1e-8, weight_decay=WD).step()
  return {k: v.detach().numpy() for k, v in w.items()}


def _check_step(start, t_loss, project_step):
  """Gradients of every parameter within 1e-4 (relative) of torch autograd's; then the project's
  clipped AdamW step against torch's on the same gradients, with the clip engaged."""
  want = _torch_grads(start, t_loss)
  clip = 0.5 * np.sqrt(sum(np.sum(g**2) for g in want.values()))
  got, got_params = project_step(clip)
  for k in want:
    if not np.any(want[k]):  # the expert bias: it only moves the (discrete) choice
      np.testing.assert_array_equal(got[k], 0, err_msg=k)
      continue
    err = np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])
    assert err <= 1e-4, (k, err)
  want_params = _torch_adamw(start, got, clip)
  for k in want_params:  # each element moves by about LR
    np.testing.assert_allclose(got_params[k], want_params[k], rtol=0, atol=LR * 1e-4, err_msg=k)


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("family", ["llada", "sdar", "dream", "llada2"])
def test_one_rl_update_matches_torch_autograd(family):
  model, seqs = _model(family, seed=0), _seqs(seed=1)
  old = _old_model(model, seed=2)
  cfg = model.config
  block = family in models.BLOCK_DIFFUSION
  start = _named(model)
  w_old = {k: _t(v) for k, v in _named(old).items()}
  rewards = np.random.default_rng(3).integers(0, 2, size=B).astype(np.float64)
  rewards[:G] = [1, 0, 0, 1]  # both groups carry signal
  adv = losses.group_advantages(jnp.asarray(rewards, jnp.float32), group_size=G)
  base = dataclasses.replace(  # the default config's objective, then this test's shapes
      objectives.Objective.from_config(config_lib.base_config("sdar")), group_size=G,
      scheme="block_t" if block else "block_random", num_samples=2,
      p_mask_prompt=0.0 if block else 0.5, block_size=BS, staircase=block)
  objs = {
      "stabledrl": dataclasses.replace(base, name="stabledrl", epsilon=0.02),
      "stabledrl_spg": dataclasses.replace(base, name="stabledrl_spg", coupling="independent",
                                           max_ratio=1.02),
      "grpo": dataclasses.replace(base, name="grpo", epsilon=0.1),
  }
  if family == "llada2":  # the mixture of experts: the default objective (the others share it)
    objs = {"stabledrl": objs["stabledrl"]}
  for seed, (name, obj) in enumerate(objs.items()):
    k_old, k_new = jax.random.split(jax.random.key(10 + seed))
    masks, logp_old, _, _, _ = _behaviour(old, seqs, k_old, obj)
    batch = objectives.RLBatch(seqs, adv, masks.noised_BxMxL, masks.weight_BxMxL, logp_old,
                       jnp.zeros_like(logp_old))
    new = _draw(k_new, seqs, obj) if obj.coupling == "independent" else masks
    lp_old = _t_logp(w_old, cfg, family, seqs, masks.noised_BxMxL)
    np.testing.assert_allclose(logp_old, lp_old.numpy(), rtol=1e-4, atol=1e-4)  # the forward

    def weights(sample):
      if obj.scheme == "block_random":  # read off the mask, from the definition
        return _t_block_random_weights(sample.noised_BxMxL, seqs.counted_BxL)
      return _t(sample.weight_BxMxL)

    def t_loss(w):
      lp_new = _t_logp(w, cfg, family, seqs, new.noised_BxMxL)
      return _t_loss(name, lp_new, lp_old, weights(new), weights(masks), new.noised_BxMxL,
                     masks.noised_BxMxL, seqs.counted_BxL, rewards, obj)

    _check_step(start, t_loss, lambda clip: _project_step(
        model, lambda m: objectives.policy_loss(m, batch, k_new, obj)[0], clip))
    if name != "grpo":  # the clip was active on some rows and not on others
      with torch.no_grad():
        lp_start = _t_logp({k: _t(v) for k, v in start.items()}, cfg, family, seqs,
                           new.noised_BxMxL)
      log_ratio = ((weights(new) * lp_start).sum(-1).mean(-1)
                   - (weights(masks) * lp_old).sum(-1).mean(-1)).numpy()
      hi = np.log(obj.max_ratio) if obj.max_ratio else np.log1p(obj.epsilon)
      lo = -np.inf if obj.max_ratio else np.log(1 - obj.epsilon)
      outside = (log_ratio > hi) | (log_ratio < lo)
      assert outside.any() and not outside.all(), (name, log_ratio)


@pytest.mark.parametrize("family,scheme", [("llada", "random_t"), ("sdar", "block_t")])
def test_one_sft_step_matches_torch_autograd(family, scheme):
  model, seqs = _model(family, seed=4), _seqs(seed=5)
  cfg = model.config
  staircase = family == "sdar"
  key = jax.random.key(6)
  masks = likelihood.sample(key, seqs, scheme=scheme, num_samples=1, p_mask_prompt=0.0,
                            block_size=BS)

  def t_loss(w):  # minus the Monte Carlo ELBO of the given completions, averaged over rows
    lp = _t_logp(w, cfg, family, seqs, masks.noised_BxMxL)
    return -(_t(masks.weight_BxMxL) * lp).sum(-1).mean(-1).mean()

  _check_step(_named(model), t_loss, lambda clip: _project_step(
      model, lambda m: sft.sft_loss(m, seqs, key, scheme=scheme, staircase=staircase,
                                    block_size=BS)[0], clip))


def _commit_steps(family, steps, seed):
  """Random decoding steps per completion slot, as the samplers record them: LLaDA `steps` total,
  each step committing C / steps slots anywhere; SDAR one slot a step within each block, the
  blocks in order (its step counter runs on across blocks)."""
  rng = np.random.default_rng(seed)
  out = np.full((B, T), -1, np.int32)
  for b in range(B):
    if family == "llada":
      out[b, P:] = rng.permutation(np.repeat(np.arange(steps), C // steps))
    else:
      for k in range(C // BS):
        out[b, P + k * BS:P + (k + 1) * BS] = k * BS + rng.permutation(BS)
  return out


def _t_trajectory(commit_BxL, counted_BxL, family, forwards, shrink):
  """TraceRL's likelihood from its definition: copy j holds the state after j·s decoding steps
  (SDAR: of each block, counted from the block's first step), every slot committed later masked;
  it scores the counted slots committed at steps [j·s, (j+1)·s). Noised `[B, J, L]` and the
  weights J·scored, so that the ELBO's mean over copies is the sum over steps."""
  noised = np.zeros((B, forwards, T), bool)
  scored = np.zeros((B, forwards, T), bool)
  for b in range(B):
    step = commit_BxL[b].astype(np.int64)
    if family == "sdar":
      for k in range(C // BS):
        sl = slice(P + k * BS, P + (k + 1) * BS)
        step[sl] -= step[sl].min()
    for j in range(forwards):
      for i in range(P, T):
        noised[b, j, i] = step[i] >= j * shrink
        scored[b, j, i] = counted_BxL[b, i] and j * shrink <= step[i] < (j + 1) * shrink
  return noised, forwards * scored.astype(np.float64)


@pytest.mark.parametrize("family,scheme", [("llada", "complementary"), ("llada", "trajectory"),
                                           ("sdar", "trajectory")])
def test_one_stabledrl_update_with_complementary_or_trajectory_masks_matches_torch(family, scheme):
  model, seqs = _model(family, seed=7), _seqs(seed=8)
  old = _old_model(model, seed=9)
  cfg, start = model.config, _named(model)
  w_old = {k: _t(v) for k, v in _named(old).items()}
  rewards = np.array([1, 0, 0, 1, 0, 1, 1, 0], np.float64)
  adv = losses.group_advantages(jnp.asarray(rewards, jnp.float32), group_size=G)
  steps, shrink = (6, 2) if family == "llada" else (BS, 2)  # SDAR: steps per block
  forwards = -(-steps // shrink)
  commit = _commit_steps(family, steps, seed=10)
  seqs = seqs._replace(commit_step_BxL=jnp.asarray(commit))
  obj = dataclasses.replace(
      objectives.Objective.from_config(config_lib.base_config(family)), name="stabledrl",
      group_size=G,
      scheme=scheme, num_samples=forwards if scheme == "trajectory" else 2, coupling="coupled",
      trajectory_shrink=shrink, p_mask_prompt=0.0, block_size=BS, staircase=family == "sdar",
      epsilon=0.1 if scheme == "trajectory" else 0.02)  # a sum over the tokens, not a mean
  key = jax.random.key(11)
  masks, logp_old, _, _, _ = _behaviour(old, seqs, key, obj)
  if scheme == "trajectory":
    noised, weights = _t_trajectory(commit, np.asarray(seqs.counted_BxL), family, forwards, shrink)
  else:  # a pair: the second copy masks exactly the completion slots the first left visible
    noised, weights = np.asarray(masks.noised_BxMxL), np.asarray(masks.weight_BxMxL)
    np.testing.assert_array_equal(noised[:, 0] ^ noised[:, 1], np.asarray(seqs.completion_BxL))
  lp_old = _t_logp(w_old, cfg, family, seqs, noised)
  np.testing.assert_allclose(logp_old, lp_old.numpy(), rtol=1e-4, atol=1e-4)  # same states
  batch = objectives.RLBatch(seqs, adv, masks.noised_BxMxL, masks.weight_BxMxL, logp_old,
                     jnp.zeros_like(logp_old))
  counted = np.asarray(seqs.counted_BxL)

  def t_loss(w):
    lp_new = _t_logp(w, cfg, family, seqs, noised)
    return _t_loss("stabledrl", lp_new, lp_old, _t(weights), _t(weights), noised, noised,
                   counted, rewards, obj)

  _check_step(start, t_loss, lambda clip: _project_step(
      model, lambda m: objectives.policy_loss(m, batch, key, obj)[0], clip))
  with torch.no_grad():  # the clip was active on some rows and not on others
    lp_start = _t_logp({k: _t(v) for k, v in start.items()}, cfg, family, seqs, noised)
  log_ratio = ((_t(weights) * (lp_start - lp_old)).sum(-1).mean(-1)).numpy()
  outside = (log_ratio > np.log1p(obj.epsilon)) | (log_ratio < np.log(1 - obj.epsilon))
  assert outside.any() and not outside.all(), log_ratio
