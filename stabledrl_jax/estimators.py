"""Monte Carlo likelihood estimators for masked diffusion LMs: which tokens to mask, how to weigh.

An estimator draws `M` corrupted copies of each sequence and a weight per position; the ELBO
estimate is `mean_M Σ_L weight · log p_θ(x_i | x_t)` (`losses.mc_elbo` / `losses.elbo_ratio`).
The model call sits outside: feed `apply_masks(...)` to the model, take `token_logp` of its
logits, pass the result with `weight` to `losses.elbo_ratio`. Everything here is a pure function
of arrays and a PRNG key.

Sequences are `[B, L]` (prompt and completion together). Three boolean position sets describe a
row: `completion` (the generated region, noised by the scheme), `counted` (completion positions
whose log-probabilities count: up to and including the first end-of-sequence token, see
`counted_until_eos`; a prefix of the completion) and `prompt` (prompt tokens that may be noised
with probability `p_mask_prompt`; never weighted).

Schemes (docs/method.md §1):
  random_t      t ~ U(0,1), p = (1-ε)t + ε, mask i.i.d. with p; weight 1/(p·n) on masked counted
                tokens, n = number of counted tokens (LLaDA pretraining; E = log p(x)/n).
  stratified_l  mask exactly l of the R completion tokens, l stratified over the M samples;
                weight R/l (LLaDA's low-variance estimator; E = log p(x)).
  block_random  one completion block holding counted tokens chosen per sample (`block_choice`);
                earlier blocks clean, later ones fully masked, k ~ U{1..n} of its n counted
                tokens masked; the earlier blocks are then noised like the prompt; weight =
                mean over every masked counted token, whatever masked it (SPG, the official
                StableDRL default, drawn as its code draws it).
  mean_field    every completion token masked; weight 1/n (d1's one-step estimate: mean log p).
  block_t       per completion block t_b ~ U(0,1), mask i.i.d. with p_b; weight 1/(p_b·n): the
                random-t estimator per block, for block diffusion's one-pass staircase likelihood.
  complementary samples in pairs (M even): sample 2k masks the completion i.i.d. at a level
                p ~ U(ε, 1-ε), sample 2k+1 masks exactly the completion positions that 2k left
                visible (level 1-p); weight 1/(level·n) on masked counted tokens, so every
                counted token is scored exactly once per pair (coupled-GRPO of DiffuCoder;
                E = log p(x)/n as random_t). `complementary_pairs` says why these weights.

Not a mask draw: `trajectory` (TraceRL's trajectory likelihood, `trajectory_masks`) scores a
rollout by the decoding steps its sampler took. Its masks are a deterministic function of the
recorded commit steps, so it has no key, no `num_samples` of its own and is not in `SCHEMES`.
"""
from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
Scheme = Literal["random_t", "stratified_l", "block_random", "mean_field", "block_t",
                 "complementary"]
SCHEMES: tuple[str, ...] = ("random_t", "stratified_l", "block_random", "mean_field", "block_t",
                            "complementary")
TRAJECTORY = "trajectory"  # `trajectory_masks`: the rollout's own decoding trajectory


class MaskSample(NamedTuple):
  """`noised`: positions replaced by the mask token; `weight`: per-position estimator weight."""
  noised_BxMxL: Array  # bool
  weight_BxMxL: Array  # float32, 0 where a position does not count


def counted_until_eos(tokens_BxL: Array, completion_BxL: Array, eos_id: int | Array) -> Array:
  """Completion positions up to and including the first end-of-sequence token, `[B, L]` bool.

  `eos_id` may be a scalar or a 1-D array of ids that all end a sequence.
  """
  completion_BxL = completion_BxL.astype(bool)
  is_eos = jnp.isin(tokens_BxL, jnp.atleast_1d(jnp.asarray(eos_id))) & completion_BxL
  eos_before = jnp.cumsum(is_eos, axis=-1) - is_eos  # EOS tokens strictly before each position
  return completion_BxL & (eos_before == 0)


def apply_masks(tokens_BxL: Array, noised_BxMxL: Array, mask_id: int) -> Array:
  """The model inputs `[B, M, L]`: `tokens` with noised positions replaced by `mask_id`."""
  return jnp.where(noised_BxMxL, jnp.asarray(mask_id, tokens_BxL.dtype), tokens_BxL[:, None, :])


def token_logp(logits_xV: Array, targets_x: Array) -> Array:
  """float32 `log softmax(logits)[target]` for any leading shape (no shift: position i → token i)."""
  logp = jax.nn.log_softmax(logits_xV.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, targets_x[..., None].astype(jnp.int32), axis=-1)[..., 0]


def sample_masks(
    key: Array,
    completion_BxL: Array,
    *,
    scheme: Scheme,
    num_samples: int,
    counted_BxL: Array | None = None,
    prompt_BxL: Array | None = None,
    p_mask_prompt: float = 0.0,
    block_size: int = 32,
    min_mask_prob: float = 1e-3,
) -> MaskSample:
  """Draw `num_samples` masks per row for `scheme` (module docstring); returns a `MaskSample`.

  `completion_BxL` is the noised region, `counted_BxL` (default: all of it) the positions that
  count, `prompt_BxL` (default: none) the prompt tokens noised with probability `p_mask_prompt`.
  `block_size` is used by `block_random` and `block_t`, `min_mask_prob` (ε) by the `*_t` schemes
  and `complementary` (which needs an even `num_samples` and ε < 1/2).
  """
  if scheme not in SCHEMES:
    raise ValueError(f"unknown estimator scheme {scheme!r}: expected one of {SCHEMES}")
  if num_samples < 1:
    raise ValueError(f"num_samples must be >= 1, got {num_samples}")
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}")
  if not 0.0 <= p_mask_prompt <= 1.0:
    raise ValueError(f"p_mask_prompt must lie in [0, 1], got {p_mask_prompt}")
  if scheme == "complementary" and num_samples % 2:
    raise ValueError(f"scheme 'complementary' draws masks in complementary pairs: num_samples must "
                     f"be even, got {num_samples}")
  if scheme == "complementary" and not 0.0 <= min_mask_prob < 0.5:
    raise ValueError(f"scheme 'complementary' draws levels in [ε, 1 - ε]: min_mask_prob must lie "
                     f"in [0, 0.5), got {min_mask_prob}")
  completion = completion_BxL.astype(bool)
  counted = completion if counted_BxL is None else counted_BxL.astype(bool) & completion
  prompt = jnp.zeros_like(completion) if prompt_BxL is None else prompt_BxL.astype(bool) & ~completion
  b, l = completion.shape
  m = num_samples
  k_scheme, k_prompt = jax.random.split(key)

  n_counted_B11 = jnp.maximum(jnp.sum(counted, -1), 1).astype(jnp.float32)[:, None, None]
  comp = jnp.broadcast_to(completion[:, None, :], (b, m, l))
  cnt = jnp.broadcast_to(counted[:, None, :], (b, m, l))
  # Index of each completion position inside the completion region (-1 outside it).
  region_idx_BxL = jnp.where(completion, jnp.cumsum(completion, -1) - 1, -1)

  if scheme == "random_t":
    k_t, k_u = jax.random.split(k_scheme)
    p_BxMx1 = _mask_prob(jax.random.uniform(k_t, (b, m, 1)), min_mask_prob)
    noised = comp & (jax.random.uniform(k_u, (b, m, l)) < p_BxMx1)
    weight = jnp.where(noised & cnt, 1.0 / (p_BxMx1 * n_counted_B11), 0.0)
    clean_visible = jnp.zeros_like(noised)
  elif scheme == "block_t":
    k_t, k_u = jax.random.split(k_scheme)
    block_BxL = jnp.where(completion, region_idx_BxL // block_size, 0)
    p_BxMxNb = _mask_prob(jax.random.uniform(k_t, (b, m, l // block_size + 1)), min_mask_prob)
    p_BxMxL = jnp.take_along_axis(p_BxMxNb, jnp.broadcast_to(block_BxL[:, None, :], (b, m, l)), -1)
    noised = comp & (jax.random.uniform(k_u, (b, m, l)) < p_BxMxL)
    weight = jnp.where(noised & cnt, 1.0 / (p_BxMxL * n_counted_B11), 0.0)
    clean_visible = jnp.zeros_like(noised)
  elif scheme == "complementary":
    noised, level_BxMx1 = complementary_pairs(k_scheme, completion, num_pairs=m // 2,
                                              min_mask_prob=min_mask_prob)
    weight = jnp.where(noised & cnt, 1.0 / (level_BxMx1 * n_counted_B11), 0.0)
    clean_visible = jnp.zeros_like(noised)
  elif scheme == "stratified_l":
    k_l, k_perm = jax.random.split(k_scheme)
    region_B11 = jnp.maximum(jnp.sum(completion, -1), 1)[:, None, None]
    # l_m = floor((m + u) / M · R) + 1: one stratum of {1..R} per sample, a shared offset u.
    u_B11 = jax.random.uniform(k_l, (b, 1, 1))
    strata_1xMx1 = jnp.arange(m, dtype=jnp.float32)[None, :, None]
    l_BxMx1 = jnp.minimum(jnp.floor((strata_1xMx1 + u_B11) / m * region_B11), region_B11 - 1) + 1
    noised = _random_subset(k_perm, comp, l_BxMx1)
    weight = jnp.where(noised & cnt, region_B11 / l_BxMx1, 0.0)
    clean_visible = jnp.zeros_like(noised)
  elif scheme == "block_random":
    k_c, k_k, k_perm = jax.random.split(k_scheme, 3)
    block_BxL = jnp.where(completion, region_idx_BxL // block_size, -1)
    n_blocks_B = (jnp.sum(completion, -1) + block_size - 1) // block_size
    # Blocks holding counted tokens (counted is a prefix of the region): 0 .. ceil(n/bs) - 1.
    n_live_B = (jnp.sum(counted, -1) + block_size - 1) // block_size
    chosen_BxMx1 = block_choice(k_c, n_blocks_B, n_live_B, num_samples=m,
                                max_blocks=l // block_size + 1)[..., None]
    block_1 = block_BxL[:, None, :]
    in_chosen = comp & (block_1 == chosen_BxMx1)
    # Uncounted (post-EOS) positions of the chosen block are masked like later blocks, so the k
    # masked tokens are always counted ones and no sample has an empty estimate.
    later = comp & ((block_1 > chosen_BxMx1) | (in_chosen & ~cnt))
    size_BxMx1 = jnp.maximum(jnp.sum(in_chosen & cnt, -1, keepdims=True), 1)
    k_BxMx1 = jnp.floor(jax.random.uniform(k_k, (b, m, 1)) * size_BxMx1) + 1
    noised = later | _random_subset(k_perm, in_chosen & cnt, k_BxMx1)
    weight = None  # after the prompt noise below, which also masks counted tokens
    clean_visible = comp & (block_1 < chosen_BxMx1)  # the earlier blocks: noised like the prompt
  else:  # mean_field
    noised = comp
    weight = jnp.where(cnt, 1.0 / n_counted_B11, 0.0)
    clean_visible = jnp.zeros_like(noised)

  if p_mask_prompt > 0.0:
    extra = (prompt[:, None, :] | clean_visible) & (jax.random.uniform(k_prompt, (b, m, l)) < p_mask_prompt)
    noised = noised | extra
  if scheme == "block_random":  # the mean over every masked counted token, noised ones included
    hit = noised & cnt
    weight = jnp.where(hit, 1.0 / jnp.maximum(jnp.sum(hit, -1, keepdims=True), 1), 0.0)
  return MaskSample(noised, weight.astype(jnp.float32))


def trajectory_masks(commit_step_BxL: Array, completion_BxL: Array,
                     counted_BxL: Array | None = None, *, num_forwards: int, shrink: int = 1,
                     block_BxL: Array | None = None) -> MaskSample:
  """TraceRL's (shrunk) trajectory likelihood as `num_forwards = J` masked copies `[B, J, L]`.

  `commit_step_BxL` is the decoding step at which the sampler committed each slot (`Rollout`;
  < 0: never committed, so masked in every copy and scored in none). Copy `j` masks every
  completion position committed at step `>= j·s` (`s = shrink`): the state the sampler saw at
  step `j·s`, up to the `s - 1` later steps it merges. It scores (weight `J`, so that
  `losses.mc_elbo`'s mean over the copies is a sum) the counted positions committed at steps in
  `[j·s, (j+1)·s)`: each counted token exactly once, in the copy that predicts it from the state
  it was decoded in. The estimate is `Σ_j Σ_{i committed in group j} log p(x_i | x_{state j})`,
  deterministic given the trajectory; with one token a step in position order and `s = 1` it is
  the chain rule `Σ_i log p(x_i | x_{<i}, masks after i)`. Post-stop positions (completion,
  not counted) keep their recorded steps: visible (as the pad the rollout holds there) after
  them, masked before, as the sampler saw that slot.

  `block_BxL` (SDAR's staircase; None: full attention) gives each position's block: steps then
  count from the block's first committed step, so copy `j` holds every block at its own `j·s`-th
  step, each conditioned on its clean prefix by the staircase (a block is decoded after its
  prefix is done). The steps must then stay below `J·s` within a block (`J = ceil(steps / s)`,
  the sampler's per-block steps); without blocks, below `J·s` overall (LLaDA's, Dream's total
  steps). Positions at later steps are masked in every copy and scored in none.
  """
  if num_forwards < 1:
    raise ValueError(f"num_forwards must be >= 1, got {num_forwards}")
  if shrink < 1:
    raise ValueError(f"shrink must be >= 1, got {shrink}")
  completion = completion_BxL.astype(bool)
  counted = completion if counted_BxL is None else counted_BxL.astype(bool) & completion
  never = jnp.iinfo(jnp.int32).max
  committed_BxL = completion & (commit_step_BxL >= 0)
  step_BxL = jnp.where(committed_BxL, commit_step_BxL, never).astype(jnp.int32)
  if block_BxL is not None:
    step_BxL = jnp.where(committed_BxL, step_BxL - _block_min(step_BxL, block_BxL), never)
  lo_1xJx1 = (jnp.arange(num_forwards, dtype=jnp.int32) * shrink)[None, :, None]
  step_Bx1xL = step_BxL[:, None, :]
  noised = completion[:, None, :] & (step_Bx1xL >= lo_1xJx1)
  scored = counted[:, None, :] & (step_Bx1xL >= lo_1xJx1) & (step_Bx1xL < lo_1xJx1 + shrink)
  return MaskSample(noised, jnp.where(scored, float(num_forwards), 0.0).astype(jnp.float32))


def _block_min(x_BxL: Array, block_BxL: Array) -> Array:
  """Each position's minimum of `x` over the positions of its block (same row), `[B, L]`."""
  l = x_BxL.shape[1]
  ids_BxL = jnp.clip(block_BxL, 0, l - 1).astype(jnp.int32)
  per_block = jax.vmap(lambda x, i: jax.ops.segment_min(x, i, num_segments=l))(x_BxL, ids_BxL)
  return jnp.take_along_axis(per_block, ids_BxL, axis=1)


def complementary_pairs(key: Array, completion_BxL: Array, *, num_pairs: int,
                        min_mask_prob: float) -> tuple[Array, Array]:
  """`complementary`'s masks `[B, 2K, L]` and each sample's masking level `[B, 2K, 1]`.

  Pair `k` (samples `2k`, `2k+1`) draws one level `p ~ U(ε, 1-ε)` per row; sample `2k` masks each
  completion position independently with probability `p`, sample `2k+1` masks exactly the
  completion positions sample `2k` left visible. So every completion position, counted or not, is
  masked in exactly one sample of the pair, and sample `2k+1` on its own is an i.i.d. mask at
  level `1-p` over the whole completion: the forward process at that level.

  The weights (applied by `sample_masks`: `1/(level·n)` on masked counted tokens). The ELBO is
  `E_s[(1/s) Σ_{i masked at level s} log p(x_i | x_s)]` with `s` uniform: a draw at level `s`
  weighted `1/s` is an unbiased sample of its integrand at `s`. Here `p` and `1-p` are both
  uniform on `[ε, 1-ε]`, so each sample of a pair alone, weighted by `1/level`, is unbiased for the
  ELBO over levels in `[ε, 1-ε]` (random_t's ε already leaves out `[0, ε)`), and so is any mean of
  them, whatever the pairs' correlation. In general, weights `a(s)` on the first and `b(s)` on the
  second sample are unbiased for the pair's mean iff `a(s) + b(s) = 2/s` for every level `s`
  (each level arises once as a `p` and once as a `1-p`, with the same density); `1/s` each is the
  one choice that keeps every sample unbiased alone. Scoring each token once with weight 1 (the
  pair's sum is `Σ_i log p(x_i | ·)`, exact for a context-free model) does not satisfy it: it
  estimates `2 ∫ s g(s) ds` instead of `∫ g(s) ds`, with `g(s)` the mean log-prob of a token
  masked at level `s`, a biased, looser bound.

  Why `[ε, 1-ε]` and not random_t's `[ε, 1]`: the complement's level `1-p` would then reach 0,
  where its weight `1/(1-p)` grows without bound and the estimate's variance is infinite
  (`∫_0 ds/s` diverges). The pair's gain is antithetic: for a context-free model a token of
  log-prob `ℓ` contributes variance `ℓ²(1/(p(1-p)) - 4)/4` per pair (0 at `p = 1/2`), against
  `ℓ²((1-p₁)/p₁ + (1-p₂)/p₂)/4` for two independent random_t draws; averaged over the levels,
  `2.46 ℓ²` against `2.96 ℓ²` at ε = 1e-3, where the small levels dominate both, and
  `0.16 ℓ²` against `0.51 ℓ²` at ε = 0.2 (DiffuCoder draws its level from `[0.2, 0.8]`).
  """
  b, l = completion_BxL.shape
  completion = completion_BxL.astype(bool)[:, None, :]
  k_t, k_u = jax.random.split(key)
  p_BxKx1 = min_mask_prob + (1.0 - 2.0 * min_mask_prob) * jax.random.uniform(k_t, (b, num_pairs, 1))
  first_BxKxL = completion & (jax.random.uniform(k_u, (b, num_pairs, l)) < p_BxKx1)
  second_BxKxL = completion & ~first_BxKxL
  noised_BxMxL = jnp.stack([first_BxKxL, second_BxKxL], axis=2).reshape(b, 2 * num_pairs, l)
  level_BxMx1 = jnp.stack([p_BxKx1, 1.0 - p_BxKx1], axis=2).reshape(b, 2 * num_pairs, 1)
  return noised_BxMxL, level_BxMx1


def block_choice(key: Array, n_blocks_B: Array, n_live_B: Array, *, num_samples: int,
                 max_blocks: int) -> Array:
  """`block_random`'s block per sample, `[B, M]` int32, drawn as the official StableDRL code does.

  For a row with `N = n_blocks` completion blocks of which the first `n = n_live` hold counted
  tokens, take a uniform random permutation `π` of `0..N-1`; sample `m` gets block
  `π[m mod N] mod n`. So the `M` samples read `M` distinct entries of the permutation (all `N`
  before any repeats), and:
    - each sample's block `j` has probability `c_j / N`, `c_j = ⌊N/n⌋ + [j < N mod n]` (the
      count of `0..N-1` congruent to `j` mod `n`): uniform only when `n` divides `N`
      (3 live of 8: 3/8, 3/8, 2/8);
    - two samples `m ≠ m'` (with `M ≤ N`) get blocks `(j, j')` with probability
      `c_j (c_j' - [j = j']) / (N (N-1))`: with every block live they never share one
      (independent uniform draws would share one with probability 1/n per pair).
  `M > N` (which the official code does not allow) wraps around the permutation. Rows with no
  block (`N = 0`) or no live block (`n = 0`) get block 0. `max_blocks` (static) bounds `N`.
  """
  b = n_blocks_B.shape[0]
  n_blocks_B1 = jnp.maximum(n_blocks_B, 1)[:, None]
  n_live_B1 = jnp.clip(n_live_B[:, None], 1, n_blocks_B1)
  # Uniform scores, the row's N blocks first: argsort gives a uniform permutation of 0..N-1.
  scores_BxNb = jax.random.uniform(key, (b, max_blocks))
  scores_BxNb = jnp.where(jnp.arange(max_blocks)[None, :] < n_blocks_B1, scores_BxNb, 2.0)
  perm_BxNb = jnp.argsort(scores_BxNb, axis=-1)
  entry_BxM = jnp.arange(num_samples)[None, :] % n_blocks_B1
  return (jnp.take_along_axis(perm_BxNb, entry_BxM, axis=-1) % n_live_B1).astype(jnp.int32)


def sample_old_new_masks(
    key: Array,
    completion_BxL: Array,
    *,
    coupling: Literal["coupled", "independent"] = "coupled",
    **kwargs,
) -> tuple[MaskSample, MaskSample]:
  """Masks for the new (θ) and the old (behaviour) policy's ELBO: `(new, old)`.

  `coupled` (default) returns the same draw twice (common random numbers: the estimated ratio is
  exactly 1 at θ = θ_old, and its variance is lower after); `independent` draws the old policy's
  masks from a separate key, as the official StableDRL code does. `kwargs` go to `sample_masks`.
  """
  if coupling == "coupled":
    sample = sample_masks(key, completion_BxL, **kwargs)
    return sample, sample
  if coupling == "independent":
    k_new, k_old = jax.random.split(key)
    return sample_masks(k_new, completion_BxL, **kwargs), sample_masks(k_old, completion_BxL, **kwargs)
  raise ValueError(f"unknown mask coupling {coupling!r}: expected 'coupled' or 'independent'")


def adversarial_masks(
    key: Array,
    completion_BxL: Array,
    counted_BxL: Array | None = None,
    *,
    num_samples: int,
    fraction: float = 0.7,
    easy_fraction: float = 0.1,
) -> tuple[Array, MaskSample, MaskSample]:
  """docs/method.md §8's adversarial ratio explosion: `(rows_B, easy, hard)`, driving `ρ → ∞` on purpose.

  A random `fraction` of the rows is chosen (`rows_B`); for those the new policy's ELBO is meant
  to use `easy` (only the last `max(1, ⌈easy_fraction·n⌉)` counted tokens masked: the fewest,
  at the end, each predicted from nearly the whole clean sequence) and the old policy's `hard`
  (every completion position masked: the most, from the start). Weights are on the
  sequence-sum scale (`n/l` for `l` masked of `n` counted tokens, as `stratified_l`), so the
  estimated log ratio grows with the completion length times the per-token gap: tens of nats
  (log10 ρ ≫ 8) for a model that has learnt anything. All `num_samples` samples are equal.
  """
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f"adversarial fraction must lie in [0, 1], got {fraction}")
  if not 0.0 < easy_fraction <= 1.0:
    raise ValueError(f"easy_fraction must lie in (0, 1], got {easy_fraction}")
  completion = completion_BxL.astype(bool)
  counted = completion if counted_BxL is None else counted_BxL.astype(bool) & completion
  b, l = completion.shape
  rows_B = jax.random.uniform(key, (b,)) < fraction
  n_B1 = jnp.sum(counted, -1, keepdims=True)
  k_B1 = jnp.maximum(jnp.ceil(easy_fraction * n_B1), 1)
  from_end_BxL = n_B1 - jnp.cumsum(counted, -1)  # 0 at the last counted token
  easy = counted & (from_end_BxL < k_B1)
  n_f = jnp.maximum(n_B1, 1).astype(jnp.float32)
  easy_w = jnp.where(easy, n_f / k_B1.astype(jnp.float32), 0.0)
  hard_w = jnp.where(counted, 1.0, 0.0)

  def tile(x_BxL):
    return jnp.broadcast_to(x_BxL[:, None, :], (b, num_samples, l))

  return (rows_B, MaskSample(tile(easy), tile(easy_w).astype(jnp.float32)),
          MaskSample(tile(completion), tile(hard_w).astype(jnp.float32)))


def _mask_prob(t: Array, min_mask_prob: float) -> Array:
  return (1.0 - min_mask_prob) * t + min_mask_prob


def _random_subset(key: Array, eligible_BxMxL: Array, count_BxMx1: Array) -> Array:
  """Exactly `min(count, |eligible|)` eligible positions per row, uniformly at random."""
  scores = jnp.where(eligible_BxMxL, jax.random.uniform(key, eligible_BxMxL.shape), 2.0)
  rank = jnp.argsort(jnp.argsort(scores, axis=-1), axis=-1)
  return eligible_BxMxL & (rank < count_BxMx1)
