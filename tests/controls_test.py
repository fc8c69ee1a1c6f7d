"""Tests for stabledrl_jax.controls: detectors, adaptive ε, schedules, drift brake, checks."""
import json
import math
import pathlib

import numpy as np
import pytest

from stabledrl_jax import controls, diagnostics

ROOT = pathlib.Path(__file__).resolve().parents[1]


def healthy_entropy(rng, steps):
  """A normal run: entropy wandering inside a 3.5–5.0 band."""
  return np.clip(4.25 + 0.25 * rng.standard_normal(steps), 3.5, 5.0)


def monitor(**kw):
  return controls.StabilityMonitor(controls.MonitorConfig(**kw))


# ----------------------------------------------------------------------------- table


def test_troubleshooting_doc_is_the_rendered_table():
  assert controls.troubleshooting_markdown() in (ROOT / "README.md").read_text()


def test_table_has_the_required_rows():
  assert set(controls.TROUBLESHOOTING) >= {
      "high_entropy_collapse", "low_entropy_collapse", "kl_alarm", "vanishing_gradients",
      "stalls", "growing_noise", "zero_advantage_groups", "clip_fraction_out_of_band"}
  assert "×1.5" in controls.TROUBLESHOOTING["vanishing_gradients"].fix
  assert "log space" in controls.TROUBLESHOOTING["stalls"].fix
  assert "≥ 2" in controls.TROUBLESHOOTING["growing_noise"].fix


def test_monitor_is_off_by_default():
  m = controls.StabilityMonitor()
  assert m.detectors == {}
  assert m.update(0, {"token_entropy": 99.0, "kl_k3": 99.0, "repetition_rate": 1.0}) == []


# ----------------------------------------------------------------------------- detectors


def test_entropy_detector_quiet_on_a_healthy_run():
  m = monitor(entropy_band=True)
  for step, h in enumerate(healthy_entropy(np.random.default_rng(0), 500)):
    assert m.update(step, {"token_entropy": float(h)}) == []


def test_entropy_detector_fires_once_on_the_spec_spike():
  # docs/method.md §8: 4.2 → 7.8 in three steps against a normal 3.5–5.0 band.
  m = monitor(entropy_band=True)
  run = list(healthy_entropy(np.random.default_rng(1), 50)) + [4.2, 5.4, 6.6, 7.8, 7.9, 8.0]
  events = [e for step, h in enumerate(run) for e in m.update(step, {"token_entropy": float(h)})]
  assert len(events) == 1
  (e,) = events
  assert e.name == "high_entropy_collapse" and 51 <= e.step <= 53
  assert "high_entropy_collapse" in e.message


def test_entropy_detector_fires_low_on_a_collapse_and_re_arms():
  m = monitor(entropy_band=True)
  run = list(healthy_entropy(np.random.default_rng(2), 50)) + [0.3] * 5 + [4.2] * 5 + [0.2]
  events = [e for step, h in enumerate(run) for e in m.update(step, {"token_entropy": float(h)})]
  assert [(e.name, e.step) for e in events] == [("low_entropy_collapse", 50),
                                                ("low_entropy_collapse", 60)]


def test_repetition_detector_fires_on_repetitive_rollouts_only():
  rng = np.random.default_rng(3)
  mask = np.ones((8, 32), bool)
  healthy = rng.integers(0, 1000, size=(8, 32))
  zeros = np.zeros((8, 32), int)  # "0000…"
  refusal = np.tile(np.arange(4), (8, 8))  # one short phrase over and over
  m = monitor(repetition=True)
  step = 0
  for tokens, want_events in [(healthy, 0), (zeros, 1), (refusal, 0), (healthy, 0),
                              (refusal, 1)]:
    events = []
    for _ in range(3):
      rate = float(diagnostics.repetition_rate(tokens, mask, 4))
      events += m.update(step, {"repetition_rate": rate})
      step += 1
    assert len(events) == want_events, (step, rate)
    assert all(e.name == "low_entropy_collapse" for e in events)


def test_kl_alarm_needs_three_consecutive_steps():
  m = monitor(kl_alarm=True)
  kl = [0.1, 0.9, 0.9, 0.5, 0.9, 0.9, 0.2, 1.0, 1.2, 1.5, 2.0, 3.0, 0.1, 0.9, 0.9, 0.9]
  events = [e for step, v in enumerate(kl) for e in m.update(step, {"kl_k3": v})]
  assert [(e.name, e.step) for e in events] == [("kl_alarm", 9), ("kl_alarm", 15)]
  assert "0.8" in events[0].message and "'kl_alarm'" in events[0].message


def test_kl_alarm_treats_non_finite_as_above():
  m = monitor(kl_alarm=True)
  events = [e for step in range(3) for e in m.update(step, {"kl_k3": math.nan})]
  assert [e.step for e in events] == [2]


def test_zero_advantage_and_clip_band_alarms():
  m = monitor(zero_advantage=True, clip_band=True, clip_consecutive=3,
              zero_advantage_consecutive=2)
  events = []
  for step, (z, c) in enumerate([(0.95, 0.12), (0.95, 0.02), (0.5, 0.03), (0.5, 0.04)]):
    events += m.update(step, {"zero_adv_fraction": z, "clip_fraction": c})
  assert [(e.name, e.step) for e in events] == [("zero_advantage_groups", 1),
                                                ("clip_fraction_out_of_band", 3)]


def test_monitor_state_round_trips_through_json():
  cfg = controls.MonitorConfig(entropy_band=True, kl_alarm=True, repetition=True)
  rng = np.random.default_rng(4)
  ent = list(healthy_entropy(rng, 30)) + [4.2, 5.4, 6.6, 7.8] + list(healthy_entropy(rng, 10))
  kl = list(rng.random(len(ent)) * 1.2)
  rep = list(rng.random(len(ent)))
  metrics = [{"token_entropy": e, "kl_k3": k, "repetition_rate": r}
             for e, k, r in zip(ent, kl, rep)]
  whole = controls.StabilityMonitor(cfg)
  want = [whole.update(s, x) for s, x in enumerate(metrics)]
  first = controls.StabilityMonitor(cfg)
  got = [first.update(s, x) for s, x in enumerate(metrics[:31])]
  resumed = controls.StabilityMonitor(cfg)
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  got += [resumed.update(s, x) for s, x in enumerate(metrics[31:], start=31)]
  assert got == want
  assert any(want)


def test_should_stop_only_when_configured():
  e = [controls.Event("kl_alarm", 3, "m")]
  assert not controls.StabilityMonitor(controls.MonitorConfig()).should_stop(e)
  stop = controls.StabilityMonitor(controls.MonitorConfig(stop_on_event=True))
  assert stop.should_stop(e) and not stop.should_stop([])


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
  ctl = controls.AdaptiveEpsilon(epsilon=controls.epsilon_from_ratios(ratios[0]), every=every)
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
  ctl = controls.AdaptiveEpsilon(epsilon=0.5, every=3)
  assert [ctl.update(0.5) for _ in range(2)] == [0.5, 0.5]
  assert ctl.update(0.5) > 0.5  # clipping too often: loosen
  e = ctl.epsilon
  for _ in range(3):
    ctl.update(0.0)
  assert ctl.epsilon < e  # never clipping: tighten
  assert math.log1p(ctl.epsilon) >= math.log1p(e) / 2 - 1e-12  # at most ×2 on log(1+ε)


def test_adaptive_epsilon_state_round_trips_through_json():
  cf = (np.random.default_rng(6).random(37) * 0.4).astype(np.float32)  # NumPy scalars in
  whole = controls.AdaptiveEpsilon(epsilon=1.0, every=5)
  want = [whole.update(c) for c in cf]
  a = controls.AdaptiveEpsilon(epsilon=1.0, every=5)
  got = [a.update(c) for c in cf[:17]]
  b = controls.AdaptiveEpsilon(every=5)
  b.load_state_dict(json.loads(json.dumps(a.state_dict())))
  got += [b.update(c) for c in cf[17:]]
  assert got == want


def test_epsilon_from_ratios_is_the_90th_percentile():
  lr = np.random.default_rng(7).normal(0.0, 0.7, 10_000)
  eps = controls.epsilon_from_ratios(lr)
  np.testing.assert_allclose(np.mean(np.exp(lr) > 1 + eps), 0.1, atol=2e-3)


# ----------------------------------------------------------------------------- schedules, drift


def test_scheduled_epsilon_conservative_then_relaxed():
  f = lambda s: controls.scheduled_epsilon(s, 1000, conservative=1.0, relaxed=5.0)
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
  sc = controls.StepControls(controls.ControlConfig(), epsilon=5.0, total=10)
  for i in range(10):
    assert sc.settings(i) == (5.0, 1.0)
    sc.update({"clip_fraction": 0.9, "kl_k3": 9.0})
  assert sc.state_dict() == {}


def test_step_controls_compose_schedule_adaptive_and_drift():
  cfg = controls.ControlConfig(epsilon_schedule=True, conservative_epsilon=1.0)
  sc = controls.StepControls(cfg, epsilon=5.0, total=100)
  assert sc.settings(0)[0] == 1.0 and sc.settings(99)[0] == 5.0  # same formula as the schedule
  # Adaptive ε: a clip fraction far above the band loosens ε after `adaptive_every` steps.
  cfg = controls.ControlConfig(adaptive_epsilon=True, adaptive_every=2)
  sc = controls.StepControls(cfg, epsilon=0.2, total=100)
  for _ in range(2):
    assert sc.settings(0) == (0.2, 1.0)
    sc.update({"clip_fraction": 0.6})
  assert sc.settings(2)[0] > 0.2
  # Drift: KL above the threshold brakes the rate and tightens ε by the formulas of docs/method.md §8.
  cfg = controls.ControlConfig(drift=True, drift_threshold=0.5, drift_alpha=0.5, drift_decay=0.0)
  sc = controls.StepControls(cfg, epsilon=4.0, total=100)
  sc.update({"kl_k3": 1.5})
  eps, lr_scale = sc.settings(1)
  assert lr_scale == pytest.approx(0.5 / (1.5 - 0.5 + 1)) and eps == pytest.approx(4.0 * 0.25)
  again = controls.StepControls(cfg, epsilon=4.0, total=100)
  again.load_state_dict(json.loads(json.dumps(sc.state_dict())))
  assert again.settings(1) == (eps, lr_scale)
  with pytest.raises(ValueError, match="enable one"):
    controls.StepControls(controls.ControlConfig(epsilon_schedule=True, adaptive_epsilon=True),
                          epsilon=1.0, total=10)


def test_config_warnings_on_the_effective_step():
  # The paper's LLaDA setting: 2e-6 · 6 / 16 = 7.5e-7, inside 1e-7…1e-6.
  assert controls.config_warnings(lr=2e-6, epsilon=5.0, group_size=16) == []
  assert controls.effective_step(2e-6, 16, max_ratio=5.0) == pytest.approx(2e-6 * 5 / 16)
  (w,) = controls.config_warnings(lr=5e-5, epsilon=5.0, group_size=8)
  assert "3.75e-05" in w and "effective_step_out_of_range" in w
  (w,) = controls.config_warnings(lr=2e-6, epsilon=5.0, group_size=16, block_length=32,
                                  block_diffusion=True)
  assert "block length 32" in w
