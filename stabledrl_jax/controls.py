"""Host-side stability controls (docs/method.md §8): detectors, adaptive ε, schedules, drift brake, checks.

Plain Python on per-step metrics that are already floats (`diagnostics.to_floats`); nothing here
touches the device. Every control is optional and off by default (`MonitorConfig`). Stateful
pieces keep their state in a JSON-able dict (`state_dict` / `load_state_dict`), so a trainer can
checkpoint it with the model and a resumed run behaves as if it had never stopped.

Detector events name a row of `TROUBLESHOOTING` (symptom → likely cause → config change), the
same table `troubleshooting_markdown()` renders into the README's Troubleshooting section.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np


class Row(NamedTuple):
  symptom: str
  cause: str
  fix: str


TROUBLESHOOTING: dict[str, Row] = {
    "high_entropy_collapse": Row(
        "Token entropy leaves its running band upwards within a few steps (e.g. 4.2 → 7.8 in "
        "three steps against a normal 3.5–5.0); garbled, mixed-language output.",
        "One or a few oversized updates: heavy-tailed estimated ratios on negative-advantage "
        "samples, or a learning rate / ε too large for the ratio noise.",
        "Resume from the last checkpoint before the jump; lower `lr` or enable the drift brake; "
        "tighten `epsilon` / `max_ratio`; use coupled masks and ≥ 2 MC samples."),
    "low_entropy_collapse": Row(
        "Repetition rate high and token entropy falling: \"0000…\", one fixed refusal or answer.",
        "The policy found a degenerate mode the reward does not penalise, or rollouts are too "
        "cold to explore.",
        "Resume from a checkpoint before the fall; raise the rollout temperature; lower `lr`; "
        "check the reward on degenerate outputs (empty or repeated answers should score 0)."),
    "kl_alarm": Row(
        "KL(θ_old‖θ) estimate above its threshold (default 0.8) for 3 consecutive steps.",
        "Policy drift: the update moves far from the rollout policy, so estimated ratios and "
        "their variance grow and the next update is noisier still.",
        "Fewer optimizer steps per rollout batch; lower `lr`; enable the drift-aware threshold "
        "and learning-rate brake."),
    "vanishing_gradients": Row(
        "Gradient norm near zero while rewards still vary; clip fraction near 1.",
        "ε too small: almost every ratio sits on a clip bound, where its weight is constant.",
        "Raise `epsilon` ×1.5 (repeat until the clip fraction is back in 10–15%), or enable "
        "adaptive ε."),
    "stalls": Row(
        "Loss, ESS or weights become NaN/inf, or the loss freezes at a constant.",
        "Normalisation overflow: exponentiating raw ratios of sequence likelihoods overflows "
        "float32 before the group normalisation.",
        "Normalise in log space (`α = exp(ℓ̃ - logsumexp ℓ̃)`, as `losses.snis_clip_loss` does); "
        "keep ratio math in float32; check custom objectives for `exp` of raw log ratios."),
    "growing_noise": Row(
        "Gradient norm and log10 ratio spread grow step after step; ESS falls.",
        "High-variance likelihood estimates (one MC sample, independent masks).",
        "More MC samples (≥ 2); coupled masks; a lower-variance estimator (stratified-l)."),
    "zero_advantage_groups": Row(
        "Many groups with all-equal rewards (zero-advantage fraction high): no learning signal.",
        "Tasks too easy or too hard for the current policy, or too few completions per group.",
        "Raise `group_size` G; move task difficulty towards ~50% success; filter prompts the "
        "policy always or never solves."),
    "clip_fraction_out_of_band": Row(
        "Clip fraction outside its 10–15% band for many steps.",
        "ε mismatched to the ratio spread: too tight (above the band) wastes signal, too loose "
        "(below) lets noisy ratios through.",
        "Set ε near the 90th percentile of observed ratios (`epsilon_from_ratios`), or enable "
        "adaptive ε."),
    "effective_step_out_of_range": Row(
        "The effective step `lr·(1+ε)/G` is outside 1e-7…1e-6.",
        "Learning rate, ε and group size chosen independently of each other.",
        "Rescale `lr` so that `lr·(1+ε)/G` falls within 1e-7…1e-6."),
}


def troubleshooting_markdown() -> str:
  """The troubleshooting table as the README's markdown section (the test keeps them equal)."""
  lines = [
      "### Troubleshooting",
      "",
      "Generated from `stabledrl_jax.controls.TROUBLESHOOTING`; detector events name the row key.",
      "",
      "| key | symptom | likely cause | config change that helps |",
      "|---|---|---|---|",
  ]
  for key, row in TROUBLESHOOTING.items():
    cells = [f"`{key}`", *(c.replace("|", "\\|") for c in row)]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


class Event(NamedTuple):
  """A detector firing; `name` is the key of its `TROUBLESHOOTING` row."""
  name: str
  step: int
  message: str


def _event(row: str, step: int, what: str) -> Event:
  return Event(row, step, f"{what} — see troubleshooting row '{row}': {TROUBLESHOOTING[row].fix}")


class _Stateful:
  """`state_dict` / `load_state_dict` over the dataclass fields listed in `_STATE`."""
  _STATE: tuple[str, ...] = ()

  def state_dict(self) -> dict[str, Any]:
    return {k: getattr(self, k) for k in self._STATE}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    for k in self._STATE:  # a field newer than the checkpoint keeps its fresh value
      setattr(self, k, state.get(k, getattr(self, k)))


# ----------------------------------------------------------------------------- detectors


@dataclasses.dataclass
class BandDetector(_Stateful):
  """Fires when a metric leaves its running band: `|x - μ| > z·max(σ, min_std)`.

  `μ`, `σ²` are exponential moving averages (`decay`) of healthy values only: the band freezes
  while the metric is outside it, so a collapse is not absorbed into "normal". One event per
  excursion (`high_row` above the band, `low_row` below; `None` silences a side); nothing fires
  during the first `warmup` values. Non-finite values are skipped.
  """
  metric: str = "token_entropy"
  z: float = 5.0
  decay: float = 0.95
  min_std: float = 0.1
  warmup: int = 10
  high_row: str | None = "high_entropy_collapse"
  low_row: str | None = "low_entropy_collapse"
  mean: float = 0.0
  var: float = 0.0
  count: int = 0
  outside: bool = False
  _STATE = ("mean", "var", "count", "outside")

  def update(self, step: int, value: float) -> list[Event]:
    value = float(value)  # a NumPy scalar would make the state not JSON-able
    if not math.isfinite(value):
      return []
    if self.count >= self.warmup:
      half = self.z * max(math.sqrt(self.var), self.min_std)
      if abs(value - self.mean) > half:
        row = self.high_row if value > self.mean else self.low_row
        fired, self.outside = not self.outside and row is not None, True
        what = (f"{self.metric} {value:.3g} left its running band "
                f"[{self.mean - half:.3g}, {self.mean + half:.3g}]")
        return [_event(row, step, what)] if fired else []
    self.outside = False
    # EMA of mean and variance; the 1/n weights early on make the first values a plain
    # running mean/variance, so the band does not start out artificially narrow.
    w = max(1.0 - self.decay, 1.0 / (self.count + 1))
    delta = value - self.mean
    self.mean += w * delta
    self.var = (1.0 - w) * (self.var + w * delta * delta)
    self.count += 1
    return []


@dataclasses.dataclass
class ThresholdAlarm(_Stateful):
  """Fires once when `metric` is outside `[low, threshold]` for `consecutive` steps in a row.

  It re-arms when the metric returns inside. A non-finite value counts as outside (something
  already broke).
  """
  metric: str = "kl_k3"
  threshold: float = 0.8
  consecutive: int = 3
  row: str = "kl_alarm"
  low: float = -math.inf
  streak: int = 0
  fired: bool = False
  _STATE = ("streak", "fired")

  def update(self, step: int, value: float) -> list[Event]:
    if self.low <= float(value) <= self.threshold:  # False for nan
      self.streak, self.fired = 0, False
      return []
    self.streak += 1
    if self.streak < self.consecutive or self.fired:
      return []
    self.fired = True
    bound = f"above {self.threshold:g}" if not value < self.low else f"below {self.low:g}"
    what = f"{self.metric} {value:.3g} {bound} for {self.streak} consecutive steps"
    return [_event(self.row, step, what)]


@dataclasses.dataclass
class MonitorConfig:
  """Which detectors run (all off by default) and whether an event should stop the run."""
  entropy_band: bool = False
  entropy_z: float = 5.0
  repetition: bool = False
  repetition_threshold: float = 0.5
  repetition_consecutive: int = 2
  kl_alarm: bool = False
  kl_metric: str = "kl_k3"
  kl_threshold: float = 0.8
  kl_consecutive: int = 3
  zero_advantage: bool = False
  zero_advantage_threshold: float = 0.9
  zero_advantage_consecutive: int = 10
  clip_band: bool = False
  clip_low: float = 0.10
  clip_high: float = 0.15
  clip_consecutive: int = 20
  stop_on_event: bool = False


class StabilityMonitor:
  """The enabled detectors of a `MonitorConfig`, fed the per-step metrics dict."""

  def __init__(self, config: MonitorConfig | None = None):
    c = self.config = config or MonitorConfig()
    self.detectors: dict[str, BandDetector | ThresholdAlarm] = {}
    if c.entropy_band:
      self.detectors["entropy_band"] = BandDetector("token_entropy", z=c.entropy_z)
    if c.repetition:
      self.detectors["repetition"] = ThresholdAlarm(
          "repetition_rate", c.repetition_threshold, c.repetition_consecutive,
          "low_entropy_collapse")
    if c.kl_alarm:
      self.detectors["kl_alarm"] = ThresholdAlarm(
          c.kl_metric, c.kl_threshold, c.kl_consecutive, "kl_alarm")
    if c.zero_advantage:
      self.detectors["zero_advantage"] = ThresholdAlarm(
          "zero_adv_fraction", c.zero_advantage_threshold, c.zero_advantage_consecutive,
          "zero_advantage_groups")
    if c.clip_band:
      self.detectors["clip_band"] = ThresholdAlarm(
          "clip_fraction", c.clip_high, c.clip_consecutive, "clip_fraction_out_of_band",
          c.clip_low)

  def update(self, step: int, metrics: Mapping[str, float]) -> list[Event]:
    """Events fired at this step; detectors whose metric is absent from `metrics` skip it."""
    events = []
    for det in self.detectors.values():
      if det.metric in metrics:
        events += det.update(step, float(metrics[det.metric]))
    return events

  def should_stop(self, events: Sequence[Event]) -> bool:
    return self.config.stop_on_event and bool(events)

  def state_dict(self) -> dict[str, Any]:
    return {k: d.state_dict() for k, d in self.detectors.items()}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    for k, d in self.detectors.items():  # one switched on since the checkpoint starts fresh
      if k in state:
        d.load_state_dict(state[k])


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
class AdaptiveEpsilon(_Stateful):
  """Every `every` steps, steer ε so that the clip fraction returns to the band's midpoint.

  Model: log ratios `ℓ ~ N(0, σ²)` (log-normal ratios), clipped to `[log(1-ε), log(1+ε)]`. The
  mean clip fraction over the last window gives `σ` under the current ε; the new ε is the one
  that would have clipped the target fraction at that `σ`. The change per update is limited to
  ×`max_change` on `log(1+ε)`, and ε stays in `[min_epsilon, max_epsilon]`. Only the clip
  fraction is needed, not the ratios.
  """
  epsilon: float = 0.2
  target_low: float = 0.10
  target_high: float = 0.15
  every: int = 10
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
                      conservative_fraction: float = 0.2, ramp_fraction: float = 0.05) -> float:
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
class DriftControl(_Stateful):
  """Drift-aware ε and learning-rate brake driven by an EMA of the KL estimate (`decay` 0 = none)."""
  threshold: float = 0.8
  alpha: float = 0.5
  decay: float = 0.0
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


@dataclasses.dataclass
class ControlConfig:
  """The optional controls of docs/method.md §8 (all off by default), as the trainer's `config.controls`."""
  epsilon_schedule: bool = False     # conservative ε for the first part of RL, then the configured one
  conservative_epsilon: float = 1.0
  conservative_fraction: float = 0.2
  adaptive_epsilon: bool = False     # steer ε so the clip fraction sits in [clip_low, clip_high]
  adaptive_every: int = 10
  clip_low: float = 0.10
  clip_high: float = 0.15
  drift: bool = False                # drift-aware ε and learning-rate brake from the KL estimate
  drift_metric: str = "kl_k3"
  drift_threshold: float = 0.5
  drift_alpha: float = 0.5
  drift_decay: float = 0.9


class StepControls:
  """The clip ε and learning-rate factor of each RL step, from the enabled controls.

  `settings(i)` gives `(epsilon, lr_scale)` for RL step `i` (0-based) of `total`; `update(metrics)`
  feeds the step's metrics back (clip fraction to adaptive ε, KL to the drift control). With
  everything off it returns `(epsilon, 1.0)` every step. State is JSON-able for checkpoints.
  """

  def __init__(self, config: ControlConfig, *, epsilon: float, total: int):
    if config.epsilon_schedule and config.adaptive_epsilon:
      raise ValueError("epsilon_schedule and adaptive_epsilon both set ε: enable one of them")
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
