"""Sanity test of bench/gpu_rl_step.py on CPU: a very short measurement on the tiny preset."""
import argparse
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "gpu_rl_step.py")


def test_every_phase_reports_throughput_and_mfu():
  spec = importlib.util.spec_from_file_location("bench_gpu_rl_step", _PATH)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  rows = []
  for family in ("llada", "sdar"):
    args = argparse.Namespace(preset="tiny", prompts=2, group=2, prompt_len=8, gen=8, block=4,
                              llada_steps=4, threshold=0.9, sdar_steps=2, samples=2,
                              accumulation=1, remat=True, blockwise=True, runs=1)
    bench.measure_family(family, args, 1e12, rows.append)
  timed = [r for r in rows if r[0].startswith("  ") and "memory" not in r[0]]
  assert [r[0].strip().split(",")[0] for r in timed] == [
      "rollout", "rollout", "behaviour pass", "RL update",
      "rollout", "behaviour pass", "RL update", "RL update"]
  assert "cache=dual" in timed[1][0] and "blockwise" in timed[-2][0]
  for name, tput, seconds, mfu, _ in timed:
    assert float(tput.split()[0].replace(",", "")) > 0 and float(seconds.split()[0]) > 0, name
    assert 0 < float(mfu.split()[1].rstrip("%")), name
  # The exact sampler's forwards are its step budget; the cache forwards fewer tokens per row.
  exact, dual = (int(r[4].split()[0]) for r in timed[:2])
  assert exact == 4 and dual <= 4
  exact_tokens, dual_tokens = (float(r[4].split(", ")[1].split()[0].replace(",", ""))
                               for r in timed[:2])
  assert dual_tokens < exact_tokens
