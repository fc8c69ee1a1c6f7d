"""Tests for stabledrl_jax.metrics: the asynchronous writer and the run record's readers."""
import json
import threading
import time

import pytest

from stabledrl_jax import metrics


def test_records_arrive_in_order_after_flush(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path), total_steps=50, resume_step=None)
  for s in range(50):
    w.write(s, {"loss": 1.0 / (s + 1), "bad": float("nan"), "worse": float("-inf")})
  w.write(3, {"accuracy": 0.5}, eval_record=True)
  w.flush()
  rows = metrics.read_jsonl(w.path)
  assert [r["step"] for r in rows] == list(range(50))
  assert rows[9]["loss"] == pytest.approx(0.1) and rows[0]["bad"] is None
  assert rows[0]["worse"] is None  # JSON null, never a string
  assert metrics.number(rows[0]["bad"]) == "nan" and metrics.number(0.25) == "0.250"
  assert metrics.read_jsonl(w.eval_path) == [{"step": 3, "accuracy": 0.5}]
  w.close()


def test_write_does_not_wait_for_the_disk(tmp_path, monkeypatch):
  w = metrics.MetricsWriter(str(tmp_path), total_steps=5, resume_step=None)
  release = threading.Event()
  slow = w._write_now
  monkeypatch.setattr(w, "_write_now", lambda *a: (release.wait(10), slow(*a)))
  t0 = time.time()
  for s in range(5):
    w.write(s, {"loss": 0.0})
  assert time.time() - t0 < 1.0 and metrics.read_jsonl(w.path) == []  # queued, not written
  release.set()
  w.flush()
  assert len(metrics.read_jsonl(w.path)) == 5
  w.close()


def test_a_failed_write_surfaces_on_the_next_call(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path), total_steps=5, resume_step=None)
  w.write(0, {"obj": object()})  # not JSON-able
  with pytest.raises(RuntimeError, match="metrics.jsonl"):
    w.flush()
  with pytest.raises(RuntimeError, match="TypeError"):
    w.write(1, {"loss": 1.0})
  w.close()


def test_resume_truncates_records_after_the_checkpoint(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path), total_steps=10, resume_step=None)
  for s in range(6):
    w.write(s, {"loss": float(s)})
  w.close()
  w = metrics.MetricsWriter(str(tmp_path), total_steps=10, resume_step=3)
  assert [r["step"] for r in metrics.read_jsonl(w.path)] == [0, 1, 2, 3]
  w.close()


def test_curve_panels_split_the_stages():
  rows = [{"step": 0, "stage": "sft", "loss": 4.5, "grad_norm": 1.0},
          {"step": 1, "stage": "rl", "loss": 0.01, "reward_mean": 0.5, "grad_norm": 0.2}]
  panels = dict(metrics.curve_panels(rows, [{"step": 1, "mean_reward": 0.25}]))
  assert panels["SFT loss"] == [(0, 4.5)] and panels["RL loss"] == [(1, 0.01)]
  assert panels["gradient norm"] == [(0, 1.0), (1, 0.2)]
  assert "SFT loss" not in dict(metrics.curve_panels(rows[1:], []))


def test_sft_end_is_the_step_after_the_last_sft_record(tmp_path):
  assert metrics.sft_end(str(tmp_path)) is None  # no record
  rows = [{"step": i, "stage": "sft" if i < 4 else "rl"} for i in range(7)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert metrics.sft_end(str(tmp_path)) == 4
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "stage": "rl"}) + "\n")
  assert metrics.sft_end(str(tmp_path)) == 0  # RL alone
