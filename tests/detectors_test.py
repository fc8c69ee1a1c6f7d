"""Tests for stabledrl_jax.detectors: the troubleshooting table and the stability detectors."""
import json
import math
import pathlib

import numpy as np

from stabledrl_jax import config_lib, detectors, diagnostics

ROOT = pathlib.Path(__file__).resolve().parents[1]
SWITCHES = ("entropy_band", "repetition", "kl_alarm", "zero_advantage", "clip_band", "stop_on_event")


def healthy_entropy(rng, steps):
  """A normal run: entropy wandering inside a 3.5–5.0 band."""
  return np.clip(4.25 + 0.25 * rng.standard_normal(steps), 3.5, 5.0)


def monitor_config(**kw):
  """`config.stability` with every detector off, then `kw`."""
  values = config_lib.base_config("sdar").stability.to_dict()
  return detectors.MonitorConfig(**{**values, **{k: False for k in SWITCHES}, **kw})


def monitor(**kw):
  return detectors.StabilityMonitor(monitor_config(**kw))


# ----------------------------------------------------------------------------- table


def test_troubleshooting_doc_is_the_rendered_table():
  assert detectors.troubleshooting_markdown() in (ROOT / "docs" / "stability.md").read_text()


def test_table_has_the_required_rows():
  assert set(detectors.TROUBLESHOOTING) >= {
      "high_entropy_collapse", "low_entropy_collapse", "kl_alarm", "vanishing_gradients",
      "stalls", "growing_noise", "zero_advantage_groups", "clip_fraction_out_of_band"}
  assert "×1.5" in detectors.TROUBLESHOOTING["vanishing_gradients"].fix
  assert "log space" in detectors.TROUBLESHOOTING["stalls"].fix
  assert "≥ 2" in detectors.TROUBLESHOOTING["growing_noise"].fix


def test_monitor_is_off_by_default():
  m = detectors.StabilityMonitor()
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
  cfg = monitor_config(entropy_band=True, kl_alarm=True, repetition=True)
  rng = np.random.default_rng(4)
  ent = list(healthy_entropy(rng, 30)) + [4.2, 5.4, 6.6, 7.8] + list(healthy_entropy(rng, 10))
  kl = list(rng.random(len(ent)) * 1.2)
  rep = list(rng.random(len(ent)))
  metrics = [{"token_entropy": e, "kl_k3": k, "repetition_rate": r}
             for e, k, r in zip(ent, kl, rep)]
  whole = detectors.StabilityMonitor(cfg)
  want = [whole.update(s, x) for s, x in enumerate(metrics)]
  first = detectors.StabilityMonitor(cfg)
  got = [first.update(s, x) for s, x in enumerate(metrics[:31])]
  resumed = detectors.StabilityMonitor(cfg)
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  got += [resumed.update(s, x) for s, x in enumerate(metrics[31:], start=31)]
  assert got == want
  assert any(want)


def test_should_stop_only_when_configured():
  e = [detectors.Event("kl_alarm", 3, "m")]
  assert not detectors.StabilityMonitor(monitor_config()).should_stop(e)
  stop = detectors.StabilityMonitor(monitor_config(stop_on_event=True))
  assert stop.should_stop(e) and not stop.should_stop([])


def test_detector_switched_on_after_the_checkpoint_starts_fresh():
  off, on = monitor(clip_band=False), monitor(clip_band=True)
  assert "clip_band" in on.state_dict() and "clip_band" not in off.state_dict()
  on.load_state_dict(off.state_dict())  # a checkpoint from before the switch
  assert on.state_dict()["clip_band"] == monitor(clip_band=True).state_dict()["clip_band"]
