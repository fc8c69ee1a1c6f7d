"""Tests for stabledrl_jax.controls: adaptive ε, schedules, drift brake, config checks."""
import json
import math

import numpy as np
import pytest

from stabledrl_jax import config_lib, controls


def control_config(**kw):
  """`config.controls` (every control off) with `kw`."""
  c = config_lib.base_config("sdar")
  return controls.ControlConfig(**{**c.controls.to_dict(), "clip_low": c.stability.clip_low,
                                   "clip_high": c.stability.clip_high, **kw})


# ----------------------------------------------------------------------------- adaptive ε


def np_clip_fraction(log_ratio, eps):
  low = math.log(1 - eps) if eps < 1 else -np.inf
  return float(np.mean((log_ratio > math.log(1 + eps)) | (log_ratio < low)))


@pytest.mark.parametrize("mean_drift", [0.0, 0.3])
def test_adaptive_epsilon_holds_the_clip_fraction_in_band_on_drifting_ratios(mean_drift):
  rng = np.random.default_rng(5)
  steps, batch, every = 400, 256, 10
  sigma = np.geomspace(0.5, 1.5, steps)  # the ratio spread triples over the run
  mu = np.linspace(0.0, mean_drift, steps)
  ratios = [rng.normal(mu[t], sigma[t], batch) for t in range(steps)]
  ctl = controls.AdaptiveEpsilon(epsilon=controls.epsilon_from_ratios(ratios[0]), every=every,
                                 target_low=0.10, target_high=0.15)
  fixed = ctl.epsilon
  adaptive_cf, fixed_cf = [], []
  for lr in ratios:
    adaptive_cf.append(np_clip_fraction(lr, ctl.epsilon))
    fixed_cf.append(np_clip_fraction(lr, fixed))
    ctl.update(adaptive_cf[-1])
  windows = np.mean(np.reshape(adaptive_cf, (-1, every)), axis=1)[1:]
  fixed_windows = np.mean(np.reshape(fixed_cf, (-1, every)), axis=1)[1:]
  in_band = (windows >= 0.10) & (windows <= 0.15)
  assert in_band.mean() >= 0.85, np.round(windows, 3)
  assert 0.11 <= windows.mean() <= 0.145
  # The stream is hard enough that a fixed ε leaves the band.
  assert ((fixed_windows >= 0.10) & (fixed_windows <= 0.15)).mean() < 0.5
  assert ctl.epsilon > 2 * fixed


def test_adaptive_epsilon_changes_only_every_n_steps_and_in_the_right_direction():
  ctl = controls.AdaptiveEpsilon(epsilon=0.5, every=3, target_low=0.10, target_high=0.15)
  assert [ctl.update(0.5) for _ in range(2)] == [0.5, 0.5]
  assert ctl.update(0.5) > 0.5  # clipping too often: loosen
  e = ctl.epsilon
  for _ in range(3):
    ctl.update(0.0)
  assert ctl.epsilon < e  # never clipping: tighten
  assert math.log1p(ctl.epsilon) >= math.log1p(e) / 2 - 1e-12  # at most ×2 on log(1+ε)


def test_adaptive_epsilon_state_round_trips_through_json():
  cf = (np.random.default_rng(6).random(37) * 0.4).astype(np.float32)  # NumPy scalars in
  whole = controls.AdaptiveEpsilon(epsilon=1.0, every=5, target_low=0.10, target_high=0.15)
  want = [whole.update(c) for c in cf]
  a = controls.AdaptiveEpsilon(epsilon=1.0, every=5, target_low=0.10, target_high=0.15)
  got = [a.update(c) for c in cf[:17]]
  b = controls.AdaptiveEpsilon(epsilon=0.2, every=5, target_low=0.10, target_high=0.15)
  b.load_state_dict(json.loads(json.dumps(a.state_dict())))
  got += [b.update(c) for c in cf[17:]]
  assert got == want


def test_epsilon_from_ratios_is_the_90th_percentile():
  lr = np.random.default_rng(7).normal(0.0, 0.7, 10_000)
  eps = controls.epsilon_from_ratios(lr)
  np.testing.assert_allclose(np.mean(np.exp(lr) > 1 + eps), 0.1, atol=2e-3)


# ----------------------------------------------------------------------------- schedules, drift


def test_scheduled_epsilon_conservative_then_relaxed():
  f = lambda s: controls.scheduled_epsilon(s, 1000, conservative=1.0, relaxed=5.0,
                                             conservative_fraction=0.2)
  assert [f(0), f(199), f(200), f(225), f(250), f(999)] == [1.0, 1.0, 1.0, 3.0, 5.0, 5.0]


def test_drift_threshold_and_lr_brake_follow_the_spec_formulas():
  assert controls.drift_aware_threshold(0.2, kl=0.5, alpha=0.4) == pytest.approx(0.2 * 0.8)
  assert controls.drift_aware_threshold(0.2, kl=5.0, alpha=0.4) == 0.0
  assert controls.lr_brake(1e-6, drift=0.5, threshold=0.8) == 1e-6
  assert controls.lr_brake(1e-6, drift=2.8, threshold=0.8) == pytest.approx(1e-6 * 0.5 / 3.0)
  d = controls.DriftControl(threshold=0.8, alpha=0.5, decay=0.5)
  d.update(1.0)
  d.update(2.0)  # EMA: 0.5·1 + 0.5·2
  lr, eps = d.apply(1e-6, 4.0)
  assert lr == pytest.approx(1e-6 * 0.5 / (1.5 - 0.8 + 1))
  assert eps == pytest.approx(4.0 * (1 - 0.5 * 1.5))
  d2 = controls.DriftControl(threshold=0.8, alpha=0.5, decay=0.5)
  d2.load_state_dict(json.loads(json.dumps(d.state_dict())))
  assert d2.apply(1e-6, 4.0) == (lr, eps)


def test_step_controls_are_a_no_op_when_off():
  sc = controls.StepControls(control_config(), epsilon=5.0, total=10)
  for i in range(10):
    assert sc.settings(i) == (5.0, 1.0)
    sc.update({"clip_fraction": 0.9, "kl_k3": 9.0})
  assert sc.state_dict() == {}


def test_step_controls_compose_schedule_adaptive_and_drift():
  cfg = control_config(epsilon_schedule=True, conservative_epsilon=1.0)
  sc = controls.StepControls(cfg, epsilon=5.0, total=100)
  assert sc.settings(0)[0] == 1.0 and sc.settings(99)[0] == 5.0  # same formula as the schedule
  # Adaptive ε: a clip fraction far above the band loosens ε after `adaptive_every` steps.
  cfg = control_config(adaptive_epsilon=True, adaptive_every=2)
  sc = controls.StepControls(cfg, epsilon=0.2, total=100)
  for _ in range(2):
    assert sc.settings(0) == (0.2, 1.0)
    sc.update({"clip_fraction": 0.6})
  assert sc.settings(2)[0] > 0.2
  # Drift: KL above the threshold brakes the rate and tightens ε by the formulas of docs/method.md §8.
  cfg = control_config(drift=True, drift_threshold=0.5, drift_alpha=0.5, drift_decay=0.0)
  sc = controls.StepControls(cfg, epsilon=4.0, total=100)
  sc.update({"kl_k3": 1.5})
  eps, lr_scale = sc.settings(1)
  assert lr_scale == pytest.approx(0.5 / (1.5 - 0.5 + 1)) and eps == pytest.approx(4.0 * 0.25)
  again = controls.StepControls(cfg, epsilon=4.0, total=100)
  again.load_state_dict(json.loads(json.dumps(sc.state_dict())))
  assert again.settings(1) == (eps, lr_scale)
  with pytest.raises(ValueError, match="^config.controls.adaptive_epsilon=True: .*enable one"):
    control_config(epsilon_schedule=True, adaptive_epsilon=True)  # one check, in the class


def test_config_warnings_on_the_effective_step():
  # The paper's LLaDA setting: 2e-6 · 6 / 16 = 7.5e-7, inside 1e-7…1e-6.
  assert controls.config_warnings(lr=2e-6, epsilon=5.0, group_size=16) == []
  assert controls.effective_step(2e-6, 16, max_ratio=5.0) == pytest.approx(2e-6 * 5 / 16)
  (w,) = controls.config_warnings(lr=5e-5, epsilon=5.0, group_size=8)
  assert "3.75e-05" in w and "effective_step_out_of_range" in w
  (w,) = controls.config_warnings(lr=2e-6, epsilon=5.0, group_size=16, block_length=32,
                                  block_diffusion=True)
  assert "block length 32" in w
