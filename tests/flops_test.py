"""Tests for stabledrl_jax.flops against XLA's own cost analysis of the compiled model."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from stabledrl_jax import flops, models


@pytest.mark.parametrize("family,n_kv", [("llada", 4), ("sdar", 2)])
def test_forward_flops_match_xla_cost_analysis(family, n_kv):
  cfg = models.tiny(family=family, d_model=256, n_heads=4, n_kv_heads=n_kv, head_dim=64,
                    mlp_dim=768, vocab_size=1024, n_layers=2, max_seq_len=512)
  model = models.create(cfg)
  ids = jax.ShapeDtypeStruct((2, 128), jnp.int32)
  compiled = nnx.jit(lambda m, x: m.logits(x, attention="full")).lower(model, ids).compile()
  ca = compiled.cost_analysis()
  xla = (ca[0] if isinstance(ca, (list, tuple)) else ca)["flops"]
  ours = flops.forward_flops(cfg, 2, 128)
  # XLA also counts elementwise work (norms, softmax, RoPE), which MFU leaves out: a few percent.
  assert ours <= xla <= 1.15 * ours


def test_rl_step_flops_scale_with_the_work():
  cfg = models.tiny()
  base = flops.StepShape(rows=8, prompt=16, gen=32, total=48, samples=2, updates=2,
                         sampler_steps=8, block=8, staircase=False)
  f = flops.rl_step_flops(cfg, base)
  assert f["update"] == pytest.approx(3 * 2 * f["likelihood"])
  g = flops.rl_step_flops(cfg, flops.StepShape(**{**base.__dict__, "rows": 16}))
  assert g["rollout"] == pytest.approx(2 * f["rollout"])
  ref = flops.rl_step_flops(cfg, flops.StepShape(**{**base.__dict__, "reference": True}))
  assert ref["likelihood"] == pytest.approx(2 * f["likelihood"])
  assert flops.peak_flops("TPU v5p") == 459e12 and flops.peak_flops("cpu") is None
