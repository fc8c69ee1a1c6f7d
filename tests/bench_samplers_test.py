"""Sanity test of bench/samplers.py: a very short measurement on the tiny preset."""
import importlib.util
import os
import sys

import jax
import numpy as np

from stabledrl_jax import models
from stabledrl_jax import samplers

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "samplers.py")


def _bench():
  spec = importlib.util.spec_from_file_location("bench_samplers", _PATH)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def test_measure_rows_are_well_formed():
  bench = _bench()
  rows = bench.measure("tiny", batch=2, gen_length=8, prompt_length=6, runs=2, llada_steps=4,
                       llada_block=8, sdar_steps=4)
  assert [r.sampler for r in rows] == list(bench.SAMPLERS)
  for r in rows:
    assert r.preset == "tiny" and r.batch == 2 and r.gen_tokens == 16 and r.runs == 2
    assert r.compile_s > 0 and r.run_s > 0 and r.tokens_per_s > 0
    assert np.isclose(r.tokens_per_s, r.gen_tokens / r.run_s)
    assert (r.cache_speedup is not None) == (r.sampler == "sdar_cache" or r.sampler in
                                             {**bench.LLADA_FAST, **bench.DREAM_FAST})
    assert r.model_forwards > 0 and r.forward_tokens > 0
  speedup = rows[1].cache_speedup
  assert speedup > 0 and np.isclose(speedup, rows[2].run_s / rows[1].run_s)
  text = bench.table(rows)
  assert text.count("\n") == 1 + len(rows)
  assert all(line.count("|") == 12 for line in text.splitlines())
  by_name = {r.sampler: r for r in rows}
  assert by_name["llada"].forward_tokens == 4 * (6 + 8)  # 4 full forwards
  # One block: a full forward, then 3 forwards of the block (which is also all that follows it).
  assert by_name["llada_dual"].forward_tokens == by_name["llada_prefix"].forward_tokens == 14 + 3 * 8
  assert by_name["dream"].forward_tokens == 4 * 14
  assert by_name["dream_dual"].forward_tokens <= 14 + 3 * 8
  assert "jax" in bench.machine()


def test_lora_rows_time_the_adapted_and_the_merged_model():
  bench = _bench()
  rows = bench.measure("tiny", batch=1, gen_length=8, prompt_length=4, runs=2, llada_steps=2,
                       llada_block=8, which=("llada",), lora_rank=2)
  assert [r.sampler for r in rows] == ["llada+lora", "llada+merged"]
  assert rows[0].cache_speedup is None
  assert np.isclose(rows[1].cache_speedup, rows[0].run_s / rows[1].run_s)


def test_compiled_program_matches_the_public_call():
  """The AOT-compiled program the bench times computes what `sdar_generate` returns."""
  bench = _bench()
  cfg = models.preset("tiny")
  model = models.create(cfg, seed=0)
  prompt = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 2, cfg.mask_token_id)
  valid = np.ones((2, 6), bool)
  key = jax.random.PRNGKey(0)
  sampling = bench._sampling("sdar_cache", 8, 4, 8, 4)
  run, _ = bench._compile("sdar_cache", model, prompt, valid, key, sampling)
  np.testing.assert_array_equal(run().tokens_BxL,
                                samplers.sdar_generate(model, prompt, valid, key,
                                                       sampling).tokens_BxL)
