"""Tests for stabledrl_jax.metrics: the asynchronous writer and the run record's readers."""
import json
import struct
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


def tensorboard_scalars(tb_dir):
  """{tag: [(step, value)]} as TensorBoard shows them: every event of the files in name order,
  but a SessionLog.START at step s hides the events of steps >= s read before it (its purge
  rule)."""
  from tensorboardX.proto import event_pb2
  shown = {}
  for path in sorted(tb_dir.iterdir()):
    data, i = path.read_bytes(), 0
    while i < len(data):  # TFRecord: length (8 bytes), its crc (4), the record, its crc (4)
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 16 + n
      if event.session_log.status == event_pb2.SessionLog.START:
        shown = {tag: [(s, v) for s, v in points if s < event.step]
                 for tag, points in shown.items()}
      for value in event.summary.value:
        shown.setdefault(value.tag, []).append((event.step, value.simple_value))
  return shown


def test_resume_trims_tensorboard_like_metrics_jsonl(tmp_path):
  first = metrics.MetricsWriter(str(tmp_path), total_steps=6, resume_step=None)
  for s in range(5):
    first.write(s, {"loss": float(s)})
  first.close()  # killed after step 4; its checkpoint was step 2
  resumed = metrics.MetricsWriter(str(tmp_path), total_steps=6, resume_step=2)
  for s in range(3, 6):
    resumed.write(s, {"loss": 10.0 + s})
  resumed.close()
  want = [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
  assert tensorboard_scalars(tmp_path / "tb")["loss"] == want
  assert [(r["step"], r["loss"]) for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))] == want
  metrics.MetricsWriter(str(tmp_path), total_steps=6, resume_step=None).close()  # a fresh start
  assert tensorboard_scalars(tmp_path / "tb") == {"loss": []}


def test_progress_counts_steps_per_stage_and_its_eta_leaves_out_the_first(monkeypatch, capsys):
  clock = iter([100.0, 101.0, 200.0, 210.0])  # when each step ended; each stage's first compiles
  monkeypatch.setattr(metrics.time, "time", lambda: next(clock))
  w = metrics.MetricsWriter.__new__(metrics.MetricsWriter)  # the console part alone
  w.active, w.total, w.stage_ends, w._first = True, 6, {"sft": 3, "rl": 6}, None
  record = {"loss": 1.0, "grad_norm": 1.0, "tokens_per_s": 5.0}
  for step, stage in [(0, "sft"), (1, "sft"), (3, "rl"), (4, "rl")]:
    w.progress(step, stage, record)
  lines = [line.split(" | ") for line in capsys.readouterr().out.splitlines()]
  assert [(line[0], line[-1]) for line in lines] == [
      ("[sft] 1/3 (step 0)", "ETA sft after the next step"),
      ("[sft] 2/3 (step 1)", "ETA sft 0m01s"),   # 1 step left at 101 - 100 s per step
      ("[rl] 1/3 (step 3)", "ETA rl after the next step"),
      ("[rl] 2/3 (step 4)", "ETA rl 0m10s")]     # 1 step left at 210 - 200 s per step
  w.stage_ends, w._first = {"sft": 2, "rl": 2}, None  # rl.steps=0
  assert w.stage_span("sft") == (0, 2) and w.stage_span("rl") == (2, 2)
