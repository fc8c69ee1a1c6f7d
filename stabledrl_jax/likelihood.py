"""Per-token log-probabilities of a batch under Monte Carlo masks: the model side of the ELBO.

`estimators` decides which tokens to mask and how to weigh them; this module runs the model on
the corrupted copies and returns `log p_θ(x_i | x_t)` for every position, `[B, M, L]`. Full
attention models (LLaDA) see each corrupted copy on its own; block-diffusion models (SDAR) see
`[x_t ; x_0]` through the staircase mask, so one forward gives every block's logits conditioned on
its clean prefix (docs/method.md §4).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stabledrl_jax import diagnostics, estimators
from stabledrl_jax.rollouts import Sequences

Array = jax.Array


def sample(key: Array, seqs: Sequences, *, scheme: str, num_samples: int, p_mask_prompt: float,
           block_size: int, **options) -> estimators.MaskSample:
  """`estimators.sample_masks` for this batch's completion, counted and prompt positions
  (`options`: its other settings, e.g. `min_mask_prob`)."""
  return estimators.sample_masks(key, seqs.completion_BxL, scheme=scheme, num_samples=num_samples,
                                 counted_BxL=seqs.counted_BxL, prompt_BxL=seqs.prompt_BxL,
                                 p_mask_prompt=p_mask_prompt, block_size=block_size, **options)


def trajectory(seqs: Sequences, *, num_forwards: int, shrink: int,
               block_size: int | None = None) -> estimators.MaskSample:
  """`estimators.trajectory_masks` for this batch's recorded commit steps (`Sequences` of
  `from_rollout`). `block_size` (SDAR's staircase; None: full attention) counts steps per block
  of `positions // block_size`, the blocks the staircase attends by."""
  if seqs.commit_step_BxL is None:
    raise ValueError("the trajectory likelihood needs the rollouts' commit steps "
                     "(rollouts.from_rollout); these sequences have none")
  block_BxL = None if block_size is None else seqs.positions_BxL // block_size
  return estimators.trajectory_masks(seqs.commit_step_BxL, seqs.completion_BxL, seqs.counted_BxL,
                                     num_forwards=num_forwards, shrink=shrink, block_BxL=block_BxL)


def masked_hidden(model, seqs: Sequences, noised_BxMxL: Array, *, staircase: bool,
                  block_size: int | None = None, routes=None, with_routes: bool = False):
  """Final-normed hidden states for every position of every masked copy, `[B*M, L, D]`.

  Mixture of experts: `with_routes=True` also returns the experts each token of each copy chose,
  `[B, M, MoE layers, T, k]` (T: the forward's tokens, 2L for the staircase), and `routes` of
  that shape replays them (routing replay)."""
  b, m, t = noised_BxMxL.shape
  cfg = model.config
  noisy = estimators.apply_masks(seqs.tokens_BxL, noised_BxMxL, cfg.mask_token_id).reshape(b * m, t)

  def tile(x_BxL):
    return jnp.repeat(x_BxL, m, axis=0)

  flat = None if routes is None else routes.reshape(b * m, *routes.shape[2:])
  if staircase:
    out = model.staircase_logits(noisy, tile(seqs.tokens_BxL), block_size=block_size,
                                 positions=tile(seqs.positions_BxL), valid_BxN=tile(seqs.valid_BxL),
                                 head=False, routes=flat, with_routes=True)
  else:
    out = model.logits(noisy, attention="full", positions=tile(seqs.positions_BxL),
                       valid_BxL=tile(seqs.valid_BxL), head=False, routes=flat, with_routes=True)
  h, chosen = out
  if not with_routes:
    return h
  if chosen is None:
    raise ValueError("routing replay needs a mixture-of-experts model; this one has none")
  return h, chosen.reshape(b, m, *chosen.shape[1:])


# Logits held at once per chunk of positions: rows x chunk x vocab float32 values (64 MiB per row).
_CHUNK_ELEMENTS = 2**24


def head_logp(model, h_NxLxD: Array, targets_NxL: Array, *, with_entropy: bool = False):
  """`log p(target)` `[N, L]` (and the prediction's entropy) from hidden states, the head run on
  chunks of positions under `jax.checkpoint`: full `[N, L, V]` logits never exist at once, in the
  forward or the backward pass (an 8B vocabulary of 152k makes them the largest tensor)."""
  n, t, d = h_NxLxD.shape
  chunk = max(1, min(t, _CHUNK_ELEMENTS // model.config.vocab_size))
  pad = (-t) % chunk

  @jax.checkpoint
  def one(args):
    h_NxQxD, tgt_NxQ = args
    logits = model.head_logits(h_NxQxD)
    lp = estimators.token_logp(logits, tgt_NxQ)
    ent = diagnostics.token_entropies(logits) if with_entropy else jnp.zeros_like(lp)
    return lp, ent

  if pad == 0 and chunk == t:
    lp, ent = one((h_NxLxD, targets_NxL))
  else:
    h = jnp.pad(h_NxLxD, ((0, 0), (0, pad), (0, 0)))
    tgt = jnp.pad(targets_NxL, ((0, 0), (0, pad)))
    k = (t + pad) // chunk
    h_KxNxQxD = h.reshape(n, k, chunk, d).transpose(1, 0, 2, 3)
    tgt_KxNxQ = tgt.reshape(n, k, chunk).transpose(1, 0, 2)
    lp, ent = jax.lax.map(one, (h_KxNxQxD, tgt_KxNxQ))
    lp = lp.transpose(1, 0, 2).reshape(n, t + pad)[:, :t]
    ent = ent.transpose(1, 0, 2).reshape(n, t + pad)[:, :t]
  return (lp, ent) if with_entropy else lp


def masked_logp(model, seqs: Sequences, noised_BxMxL: Array, *, staircase: bool,
                block_size: int | None = None, with_entropy: bool = False,
                copies_per_pass: int = 0, routes=None, with_routes: bool = False):
  """float32 `log p(x_i | x_t)` for every position of every masked copy, `[B, M, L]`.

  `with_entropy=True` returns `(logp, entropy)`, the entropy (nats) of the model's prediction at
  each position, same shape, from the same forward pass. `copies_per_pass` C in (0, M): the
  copies go through the model C at a time in a loop, each pass recomputed in the backward pass
  (`jax.checkpoint`), so activations are held for B*C sequences instead of B*M (the trajectory
  scheme's M is its number of forwards, up to the generation length).

  `with_routes=True` returns `(out, experts)` and `routes` replays them (`masked_hidden`); not
  with `copies_per_pass`.
  """
  b, m, t = noised_BxMxL.shape
  c = copies_per_pass
  if 0 < c < m and (with_routes or routes is not None):
    raise ValueError("routing replay runs every copy in one pass: set rl.copies_per_pass=0")
  if 0 < c < m:
    k = -(-m // c)  # passes; the last one padded with unmasked copies, dropped after
    noised_KxBxCxL = jnp.pad(noised_BxMxL, ((0, 0), (0, k * c - m), (0, 0))).reshape(
        b, k, c, t).transpose(1, 0, 2, 3)
    one = jax.checkpoint(lambda n_BxCxL: masked_logp(
        model, seqs, n_BxCxL, staircase=staircase, block_size=block_size, with_entropy=with_entropy))
    out = jax.lax.map(one, noised_KxBxCxL)
    return jax.tree.map(lambda x: x.transpose(1, 0, 2, 3).reshape(b, k * c, t)[:, :m], out)
  h = masked_hidden(model, seqs, noised_BxMxL, staircase=staircase, block_size=block_size,
                    routes=routes, with_routes=with_routes)
  h, chosen = h if with_routes else (h, None)
  out = head_logp(model, h, jnp.repeat(seqs.tokens_BxL, m, axis=0), with_entropy=with_entropy)
  out = (out.reshape(b, m, t) if not with_entropy
         else (out[0].reshape(b, m, t), out[1].reshape(b, m, t)))
  return (out, chosen) if with_routes else out
