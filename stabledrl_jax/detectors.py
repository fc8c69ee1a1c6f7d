"""Stability detectors (docs/method.md §8): host-side watchers of the per-step metrics, and the
troubleshooting table their events point to.

Plain Python on metrics that are already floats (`diagnostics.to_floats`); nothing here touches
the device. Which detectors run, and their thresholds, come from `config.stability`
(`build.settings`). Stateful pieces keep their state in a JSON-able dict (`state_dict` /
`load_state_dict`), so a trainer can checkpoint it with the model and a resumed run behaves as if
it had never stopped.

Detector events name a row of `TROUBLESHOOTING` (symptom → likely cause → config change), the
same table `troubleshooting_markdown()` renders into docs/stability.md's Troubleshooting section.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

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
        "Tasks too easy or too hard for the current policy, or too few completions per group. "
        "If the training reward fell to about 0 within a step or two before it: the policy broke "
        "(seen without the global-norm clip: one batch's gradient, a few times the usual, set the "
        "direction of Adam's next updates; KL and the importance weights stayed quiet).",
        "Raise `group_size` G; move task difficulty towards ~50% success; "
        "`rl.filter_zero_advantage=True` (dynamic sampling: such groups are replaced by groups of "
        "further prompts, at most `rl.max_prompt_draws` prompt batches a step; `groups_drawn` / "
        "`groups_kept` in metrics.jsonl). After such a fall: resume from a checkpoint before it "
        "with `optim.grad_clip` on (0.2, the official value), fewer `rl.updates_per_batch` or a "
        "lower `rl.lr` (docs/results.md: the collapse without the clip, diagnosed)."),
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
  """The troubleshooting table as docs/stability.md's section (the test keeps them equal)."""
  lines = [
      "## Troubleshooting",
      "",
      "Generated from `stabledrl_jax.detectors.TROUBLESHOOTING`; detector events name the row key.",
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


class Stateful:
  """`state_dict` / `load_state_dict` over the dataclass fields listed in `_STATE`."""
  _STATE: tuple[str, ...] = ()

  def state_dict(self) -> dict[str, Any]:
    return {k: getattr(self, k) for k in self._STATE}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    for k in self._STATE:  # a field newer than the checkpoint keeps its fresh value
      setattr(self, k, state.get(k, getattr(self, k)))


# ----------------------------------------------------------------------------- detectors


@dataclasses.dataclass
class BandDetector(Stateful):
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
class ThresholdAlarm(Stateful):
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


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
  """`config.stability` as typed settings (`from_config`; the defaults are the config's)."""
  entropy_band: bool
  entropy_z: float
  repetition: bool
  repetition_threshold: float
  repetition_consecutive: int
  kl_alarm: bool
  kl_metric: str
  kl_threshold: float
  kl_consecutive: int
  zero_advantage: bool
  zero_advantage_threshold: float
  zero_advantage_consecutive: int
  clip_band: bool
  clip_low: float
  clip_high: float
  clip_consecutive: int
  stop_on_event: bool

  def __post_init__(self):
    for name in ("repetition", "kl", "zero_advantage", "clip"):
      if getattr(self, f"{name}_consecutive") < 1:
        raise ValueError(f"config.stability.{name}_consecutive="
                         f"{getattr(self, f'{name}_consecutive')!r}: must be >= 1")
    if self.kl_metric not in ("kl_k1", "kl_k3"):
      raise ValueError(f"config.stability.kl_metric={self.kl_metric!r}: expected 'kl_k1' or 'kl_k3'")
    check_clip_band(self.clip_low, self.clip_high)

  @classmethod
  def from_config(cls, stability) -> MonitorConfig:
    return cls(**stability.to_dict())


def check_clip_band(low: float, high: float) -> None:
  """The healthy clip-fraction band `config.stability.clip_low/clip_high` (the clip-band detector
  watches it, the adaptive ε control steers into it)."""
  if not 0 <= low < high <= 1:
    raise ValueError(f"config.stability.clip_high={high!r}: need 0 <= stability.clip_low={low!r} "
                     "< clip_high <= 1")


def _alarms(c: MonitorConfig) -> dict[str, tuple[bool, ThresholdAlarm]]:
  """The threshold alarms: name -> (enabled, detector)."""
  return {
      "repetition": (c.repetition, ThresholdAlarm(
          "repetition_rate", c.repetition_threshold, c.repetition_consecutive,
          "low_entropy_collapse")),
      "kl_alarm": (c.kl_alarm, ThresholdAlarm(
          c.kl_metric, c.kl_threshold, c.kl_consecutive, "kl_alarm")),
      "zero_advantage": (c.zero_advantage, ThresholdAlarm(
          "zero_adv_fraction", c.zero_advantage_threshold, c.zero_advantage_consecutive,
          "zero_advantage_groups")),
      "clip_band": (c.clip_band, ThresholdAlarm(
          "clip_fraction", c.clip_high, c.clip_consecutive, "clip_fraction_out_of_band",
          c.clip_low)),
  }


class StabilityMonitor:
  """The enabled detectors of a `MonitorConfig` (none without one), fed the per-step metrics."""

  def __init__(self, config: MonitorConfig | None = None):
    self.config = config
    self.detectors: dict[str, BandDetector | ThresholdAlarm] = {}
    if config is None:
      return
    if config.entropy_band:
      self.detectors["entropy_band"] = BandDetector("token_entropy", z=config.entropy_z)
    self.detectors.update({k: d for k, (on, d) in _alarms(config).items() if on})

  def update(self, step: int, metrics: Mapping[str, float]) -> list[Event]:
    """Events fired at this step; detectors whose metric is absent from `metrics` skip it."""
    events = []
    for det in self.detectors.values():
      if det.metric in metrics:
        events += det.update(step, float(metrics[det.metric]))
    return events

  def should_stop(self, events: Sequence[Event]) -> bool:
    return self.config is not None and self.config.stop_on_event and bool(events)

  def state_dict(self) -> dict[str, Any]:
    return {k: d.state_dict() for k, d in self.detectors.items()}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    for k, d in self.detectors.items():  # one switched on since the checkpoint starts fresh
      if k in state:
        d.load_state_dict(state[k])
