"""Stability controls (docs/method.md §8): adaptive and scheduled clip ε, the drift brake on ε and the
learning rate, and the tuning checks of a config.

Plain Python on per-step metrics that are already floats; nothing here touches the device. Which
controls run comes from `config.controls` (`ControlConfig.from_config`); all are off in the default
config. State is a JSON-able dict (`state_dict` / `load_state_dict`) checkpointed with the model.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping
from typing import Any

import numpy as np

from stabledrl_jax.detectors import TROUBLESHOOTING, Stateful, check_clip_band

# ----------------------------------------------------------------------------- ε


def epsilon_from_ratios(log_ratios: Any, quantile: float = 0.9, min_epsilon: float = 1e-3) -> float:
  """Initial ε: the `quantile` of the observed ratios minus 1, so ~10% of ratios clip above."""
  lr = np.asarray(log_ratios, np.float64).ravel()
  lr = lr[np.isfinite(lr)]
  if lr.size == 0:
    raise ValueError("no finite log ratios to choose epsilon from")
  return max(float(np.expm1(np.quantile(lr, quantile))), min_epsilon)


_NORMAL = statistics.NormalDist()


def _model_clip_fraction(epsilon: float, sigma: float) -> float:  # ℓ ~ N(0, σ²)
  c = 1.0 - _NORMAL.cdf(math.log1p(epsilon) / sigma)
  if epsilon < 1.0:
    c += _NORMAL.cdf(math.log1p(-epsilon) / sigma)
  return c


def _bisect_log(f, lo: float, hi: float, increasing: bool) -> float:  # monotone f, 0 < lo < hi
  a, b = math.log(lo), math.log(hi)
  for _ in range(60):
    m = 0.5 * (a + b)
    if (f(math.exp(m)) > 0) == increasing:
      b = m
    else:
      a = m
  return math.exp(0.5 * (a + b))


@dataclasses.dataclass
class AdaptiveEpsilon(Stateful):
  """Every `every` steps, steer ε so that the clip fraction returns to the band's midpoint.

  Model: log ratios `ℓ ~ N(0, σ²)` (log-normal ratios), clipped to `[log(1-ε), log(1+ε)]`. The
  mean clip fraction over the last window gives `σ` under the current ε; the new ε is the one
  that would have clipped the target fraction at that `σ`. The change per update is limited to
  ×`max_change` on `log(1+ε)`, and ε stays in `[min_epsilon, max_epsilon]`. Only the clip
  fraction is needed, not the ratios.
  """
  epsilon: float
  target_low: float
  target_high: float
  every: int
  max_change: float = 2.0
  min_epsilon: float = 1e-3
  max_epsilon: float = 100.0
  window_sum: float = 0.0
  window_count: int = 0
  _STATE = ("epsilon", "window_sum", "window_count")

  def update(self, clip_fraction: float) -> float:
    """Record this step's clip fraction; returns the ε to use from the next step on."""
    if math.isfinite(clip_fraction):
      self.window_sum += float(clip_fraction)
      self.window_count += 1
    if self.window_count < self.every:
      return self.epsilon
    # Clamped so that σ stays identifiable (no clipping at all says only "σ is small").
    c = min(max(self.window_sum / self.window_count, 1e-4), 0.9)
    self.window_sum, self.window_count = 0.0, 0
    target = 0.5 * (self.target_low + self.target_high)
    eps = self.epsilon
    sigma = _bisect_log(lambda s: _model_clip_fraction(eps, s) - c, 1e-6, 1e6, True)
    new = _bisect_log(lambda e: _model_clip_fraction(e, sigma) - target,
                      self.min_epsilon, self.max_epsilon, False)
    h, h_new = math.log1p(eps), math.log1p(new)
    h_new = min(max(h_new, h / self.max_change), h * self.max_change)
    self.epsilon = min(max(math.expm1(h_new), self.min_epsilon), self.max_epsilon)
    return self.epsilon


def scheduled_epsilon(step: int, total_steps: int, *, conservative: float, relaxed: float,
                      conservative_fraction: float, ramp_fraction: float = 0.05) -> float:
  """ε schedule: `conservative` for the first `conservative_fraction` of training, then a linear
  ramp over `ramp_fraction` of it to `relaxed`, which holds until the end."""
  start = conservative_fraction * total_steps
  ramp = ramp_fraction * total_steps
  if step < start:
    return conservative
  if ramp <= 0 or step >= start + ramp:
    return relaxed
  return conservative + (relaxed - conservative) * (step - start) / ramp


# ----------------------------------------------------------------------------- drift


def drift_aware_threshold(tau0: float, kl: float, alpha: float) -> float:
  """`τ_t = τ_0 (1 - α·KL)`, floored at 0: a threshold (e.g. ε) that tightens as the policy drifts."""
  return tau0 * max(0.0, 1.0 - alpha * kl)


def lr_brake(lr: float, drift: float, threshold: float) -> float:
  """`lr · min(1, 0.5 / (drift - threshold + 1))` once `drift > threshold`, else `lr`.

  The first step over the threshold halves the rate; it keeps falling as `1/drift` after.
  """
  if not drift > threshold:
    return lr
  return lr * min(1.0, 0.5 / (drift - threshold + 1.0))


@dataclasses.dataclass
class DriftControl(Stateful):
  """Drift-aware ε and learning-rate brake driven by an EMA of the KL estimate (`decay` 0 = none)."""
  threshold: float
  alpha: float
  decay: float         # 0 = no averaging
  drift: float = 0.0
  count: int = 0
  _STATE = ("drift", "count")

  def update(self, kl: float) -> float:  # non-finite KL leaves the drift as it was
    if math.isfinite(kl):
      kl = float(kl)
      self.drift = kl if self.count == 0 else self.decay * self.drift + (1 - self.decay) * kl
      self.count += 1
    return self.drift

  def apply(self, lr: float, epsilon: float) -> tuple[float, float]:
    """`(braked lr, drift-aware ε)` for the current drift."""
    return (lr_brake(lr, self.drift, self.threshold),
            drift_aware_threshold(epsilon, self.drift, self.alpha))


# ----------------------------------------------------------------------------- config checks


def effective_step(lr: float, group_size: int, epsilon: float | None = None,
                   max_ratio: float | None = None) -> float:
  """`lr·(1+ε)/G`; with `max_ratio` (which replaces ε's bounds) `lr·max_ratio/G`."""
  upper = max_ratio if max_ratio is not None else 1.0 + (epsilon if epsilon is not None else 0.0)
  return lr * upper / group_size


def config_warnings(*, lr: float, group_size: int, epsilon: float | None = None,
                    max_ratio: float | None = None, block_length: int | None = None,
                    block_diffusion: bool = False, low: float = 1e-7,
                    high: float = 1e-6) -> list[str]:
  """Tuning guidance of docs/method.md §8 as warning texts (empty when the config is within it)."""
  out = []
  step = effective_step(lr, group_size, epsilon, max_ratio)
  if not low <= step <= high:
    out.append(f"effective step lr·(1+ε)/G = {step:.3g} is outside {low:g}…{high:g} — see "
               "troubleshooting row 'effective_step_out_of_range': "
               + TROUBLESHOOTING["effective_step_out_of_range"].fix)
  if block_length is not None:
    lo, hi = (4, 8) if block_diffusion else (32, 64)
    if not lo <= block_length <= hi:
      kind = "block diffusion" if block_diffusion else "full-attention"
      out.append(f"block length {block_length} is outside the {lo}–{hi} tokens suggested for "
                 f"{kind} models")
  return out


# ----------------------------------------------------------------------------- per-step settings


@dataclasses.dataclass(frozen=True)
class ControlConfig:
  """`config.controls` as typed settings (`from_config`; the defaults are the config's)."""
  epsilon_schedule: bool      # conservative ε for the first part of RL, then the configured one
  conservative_epsilon: float
  conservative_fraction: float
  adaptive_epsilon: bool      # steer ε so the clip fraction sits in [clip_low, clip_high]
  adaptive_every: int
  clip_low: float             # the band: config.stability.clip_low / clip_high
  clip_high: float
  drift: bool                 # drift-aware ε and learning-rate brake from the KL estimate
  drift_metric: str
  drift_threshold: float
  drift_alpha: float
  drift_decay: float

  def __post_init__(self):
    def bad(key, why):
      raise ValueError(f"config.controls.{key}={getattr(self, key)!r}: {why}")
    if self.epsilon_schedule and self.adaptive_epsilon:
      bad("adaptive_epsilon", "controls.epsilon_schedule also sets ε: enable one")
    if not 0 <= self.conservative_fraction <= 1:
      bad("conservative_fraction", "must lie in [0, 1]")
    if self.conservative_epsilon < 0:
      bad("conservative_epsilon", "must be >= 0")
    if self.adaptive_every < 1:
      bad("adaptive_every", "must be >= 1")
    if self.drift_metric not in ("kl_k1", "kl_k3"):
      bad("drift_metric", "expected 'kl_k1' or 'kl_k3'")
    check_clip_band(self.clip_low, self.clip_high)

  @classmethod
  def from_config(cls, c, objective) -> ControlConfig:
    """`config.controls` with the clip band of `config.stability`, checked against the run's
    `objectives.Objective` (a control moves its clip ε)."""
    config = cls(**c.controls.to_dict(), clip_low=c.stability.clip_low,
                 clip_high=c.stability.clip_high)
    if config.moves_epsilon:
      key = next(n for n in ("epsilon_schedule", "adaptive_epsilon", "drift")
                 if getattr(config, n))
      if objective.spec.clip is None:
        raise ValueError(f"config.controls.{key}=True: rl.objective={objective.name!r} has no "
                         "clip ε to control")
      if objective.spec.clip == "log_ratio" and objective.max_ratio is not None:
        raise ValueError(f"config.controls.{key}=True: controls move ε; with rl.max_ratio set ε "
                         "is unused (set rl.max_ratio=0)")
    return config

  @property
  def moves_epsilon(self) -> bool:
    """Whether any control sets the step's clip ε (else the objective keeps its own)."""
    return self.epsilon_schedule or self.adaptive_epsilon or self.drift


class StepControls:
  """The clip ε and learning-rate factor of each RL step, from the enabled controls.

  `settings(i)` gives `(epsilon, lr_scale)` for RL step `i` (0-based) of `total`; `update(metrics)`
  feeds the step's metrics back (clip fraction to adaptive ε, KL to the drift control). With
  everything off it returns `(epsilon, 1.0)` every step. State is JSON-able for checkpoints.
  """

  def __init__(self, config: ControlConfig, *, epsilon: float, total: int):
    self.config, self.epsilon, self.total = config, float(epsilon), total
    self.adaptive = (AdaptiveEpsilon(epsilon=self.epsilon, target_low=config.clip_low,
                                     target_high=config.clip_high, every=config.adaptive_every)
                     if config.adaptive_epsilon else None)
    self.drift = (DriftControl(threshold=config.drift_threshold, alpha=config.drift_alpha,
                               decay=config.drift_decay) if config.drift else None)

  def settings(self, i: int) -> tuple[float, float]:
    c = self.config
    eps = self.epsilon
    if c.epsilon_schedule:
      eps = scheduled_epsilon(i, self.total, conservative=c.conservative_epsilon, relaxed=eps,
                              conservative_fraction=c.conservative_fraction)
    if self.adaptive is not None:
      eps = self.adaptive.epsilon
    if self.drift is not None:
      lr_scale, eps = self.drift.apply(1.0, eps)
      return eps, lr_scale
    return eps, 1.0

  def update(self, metrics: Mapping[str, float]) -> None:
    if self.adaptive is not None and "clip_fraction" in metrics:
      self.adaptive.update(float(metrics["clip_fraction"]))
    if self.drift is not None and self.config.drift_metric in metrics:
      self.drift.update(float(metrics[self.config.drift_metric]))

  def state_dict(self) -> dict[str, Any]:
    return {k: d.state_dict() for k, d in (("adaptive", self.adaptive), ("drift", self.drift))
            if d is not None}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    for k, d in (("adaptive", self.adaptive), ("drift", self.drift)):
      if d is not None and k in state:
        d.load_state_dict(state[k])
