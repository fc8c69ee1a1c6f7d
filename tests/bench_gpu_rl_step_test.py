"""Sanity test of bench/gpu_rl_step.py on CPU: a very short measurement on the tiny preset."""
import argparse
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "gpu_rl_step.py")


def test_rows_report_throughput_and_mfu():
  spec = importlib.util.spec_from_file_location("bench_gpu_rl_step", _PATH)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  args = argparse.Namespace(preset="tiny", prompts=2, group=2, prompt_len=8, gen=8,
                            sampler_steps=2, samples=2, accumulation=1, remat=True, peak_n=128,
                            runs=1)
  rows = bench.measure(args)
  timed = rows[3:]
  assert [r[0].split(" (")[0] for r in timed] == ["sampler", "behaviour likelihood", "RL update"]
  for name, tput, seconds, mfu in timed:
    assert float(tput.split()[0].replace(",", "")) > 0 and float(seconds.split()[0]) > 0
    assert 0 < float(mfu.split()[1].rstrip("%")) < 1000, name
