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


def test_llada_rollout_flops_count_the_samplers_forwards_by_hand():
  cfg = models.tiny(family="llada", d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, mlp_dim=128,
                    vocab_size=100, n_layers=2)
  # Written out per token: 2 x (q, k, v, o: 4 x 64 x 64, MLP: 3 x 64 x 128) per layer, and
  # QKᵀ + AV against 48 keys (2 x 2 x 4 heads x 16 x 48) per layer; the head 2 x 64 x 100 on the
  # block's 8 positions of each forward.
  body = 2 * 2 * (4 * 64 * 64 + 3 * 64 * 128) + 2 * (2 * 2 * 4 * 16 * 48)
  shape = flops.StepShape(rows=3, prompt=16, gen=32, total=48, samples=1, updates=1,
                          sampler_steps=8, block=8, staircase=False)
  exact = flops.rl_step_flops(cfg, shape)["rollout"]
  assert exact == pytest.approx(3 * (8 * 48 * body + 8 * 8 * 2 * 64 * 100))
  cached = flops.rl_step_flops(cfg, flops.StepShape(**{**shape.__dict__, "forwards": 5,
                                                        "forward_tokens": 4 * 48 + 8}))["rollout"]
  assert cached == pytest.approx(3 * ((4 * 48 + 8) * body + 5 * 8 * 2 * 64 * 100))
