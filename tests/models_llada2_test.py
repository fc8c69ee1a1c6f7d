"""LLaDA2.0 (family llada2): logits against a float64 NumPy forward written from the released
architecture, the group-limited routing with expert bias, config checks, Hugging Face I/O."""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import models
from stabledrl_jax.models import moe
from stabledrl_jax.models import hf_config


@functools.partial(nnx.jit, static_argnames=("attention",))
def _logits(model, ids, attention):
  return model.logits(ids, attention=attention)


def _np(x):
  return np.asarray(x, np.float64)


def _randomise(model, seed=1):
  """Non-trivial norms and a non-zero expert bias (the released init leaves them 1 and 0)."""
  rng = np.random.default_rng(seed)
  for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Variable) and path[-1] in ("scale", "expert_bias"):
      shape = var.get_value().shape
      value = (1 + 0.3 * rng.standard_normal(shape) if path[-1] == "scale"
               else 0.05 * rng.standard_normal(shape))
      var.set_value(jnp.asarray(value, jnp.float32))
  return model


def np_route(logits_E, bias_E, k, n_group, topk_group, scaling):
  """One token's experts and weights, from the released definition (ties: lower index)."""
  scores = 1 / (1 + np.exp(-logits_E))
  choice = scores + bias_E
  size = len(scores) // n_group
  group_score = [np.sum(np.sort(choice[g * size:(g + 1) * size])[::-1][:2]) for g in range(n_group)]
  kept = np.argsort(-np.asarray(group_score), kind="stable")[:topk_group]
  allowed = np.full(len(scores), -np.inf)
  for g in kept:
    allowed[g * size:(g + 1) * size] = choice[g * size:(g + 1) * size]
  experts = np.argsort(-allowed, kind="stable")[:k]
  w = scores[experts]
  if k > 1:
    w = w / (w.sum() + 1e-20)
  return experts, w * scaling


def reference_logits(model, ids_BxL, allowed_LxL):
  cfg = model.config
  silu = lambda z: z / (1 + np.exp(-z))

  def norm(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * _np(w)

  def rope(x):  # partial rotary: rotate-half on the first R dims of each head
    r = cfg.rotary_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, r, 2) / r)
    ang = np.arange(x.shape[1])[:, None] * inv
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    x1, x2, rest = x[..., :r // 2], x[..., r // 2:r], x[..., r:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)

  def mlp(y, gate, up, down):
    return (silu(y @ _np(gate)) * (y @ _np(up))) @ _np(down)

  b, l = ids_BxL.shape
  n, kv, h = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  x = _np(model.embed.embedding[...])[ids_BxL]
  for i, blk in enumerate(model.blocks):
    a = blk.attn
    y = norm(x, blk.attn_norm.scale[...])
    qkv = (y @ _np(a.qkv_proj.kernel[...])).reshape(b, l, n + 2 * kv, h)
    q, k, v = qkv[:, :, :n], qkv[:, :, n:n + kv], qkv[:, :, n + kv:]
    if cfg.qk_norm:
      q, k = norm(q, a.q_norm.scale[...]), norm(k, a.k_norm.scale[...])
    q, k = rope(q), rope(k)
    k, v = np.repeat(k, n // kv, axis=2), np.repeat(v, n // kv, axis=2)
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(h)
    s = np.where(allowed_LxL, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bnqk,bknh->bqnh", p, v).reshape(b, l, n * h)
    x = x + o @ _np(a.o_proj.kernel[...])
    y = norm(x, blk.mlp_norm.scale[...]).reshape(b * l, -1)
    if i < cfg.first_k_dense_replace:
      out = mlp(y, blk.gate_proj.kernel[...], blk.up_proj.kernel[...], blk.down_proj.kernel[...])
    else:
      m = blk.moe
      logits = y @ _np(m.router[...])
      out = np.zeros_like(y)
      for t in range(b * l):
        experts, w = np_route(logits[t], _np(m.expert_bias[...]), cfg.num_experts_per_tok,
                              cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        for e, we in zip(experts, w):
          out[t] += we * mlp(y[t], m.gate_kernel[...][e], m.up_kernel[...][e],
                             m.down_kernel[...][e])
      if cfg.num_shared_experts:
        sh = m.shared_experts
        out += mlp(y, sh.gate_proj.kernel[...], sh.up_proj.kernel[...], sh.down_proj.kernel[...])
    x = x + out.reshape(b, l, -1)
  x = norm(x, model.final_norm.scale[...])
  return x @ _np(model.head.kernel[...])


@pytest.mark.parametrize("changes, attention", [
    ({}, "block_causal"),  # first layer dense, one shared expert
    ({"num_shared_experts": 0, "first_k_dense_replace": 0, "num_experts_per_tok": 1}, "full"),
])
def test_logits_match_float64_reference(changes, attention):
  cfg = models.llada2_tiny(**changes)
  model = _randomise(models.create(cfg, seed=3))
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8))
  pos = np.arange(8)
  allowed = ((pos[None, :] // 4) <= (pos[:, None] // 4) if attention == "block_causal"
             else np.ones((8, 8), bool))
  got = np.asarray(_logits(model, jnp.asarray(ids), attention))
  np.testing.assert_allclose(got, reference_logits(model, ids, allowed), atol=2e-5, rtol=1e-4)


def _route(scores, bias, **kw):
  scores = np.asarray(scores, np.float64)
  logits = jnp.asarray(np.log(scores / (1 - scores)), jnp.float32)[None]
  experts, weights = moe.route_experts(logits, jnp.asarray(bias, jnp.float32), **kw)
  order = np.argsort(np.asarray(experts[0]))
  return np.asarray(experts[0])[order], np.asarray(weights[0])[order]


KW = dict(k=2, n_group=4, topk_group=2, scaling=2.5)


def test_routing_groups_and_bias_change_the_choice():
  # Plain top-2 of the scores is {0, 2}; groups (0,1) and (2,3) lose to (4,5) and (6,7) by their
  # two best, and the bias on 6 beats 5 (tie 4/5 -> 4). The weights are the unbiased scores.
  scores = [0.9, 0.01, 0.8, 0.05, 0.6, 0.6, 0.55, 0.55]
  bias = [0, 0, 0, 0, 0, 0, 0.1, 0]
  experts, weights = _route(scores, bias, **KW)
  np.testing.assert_array_equal(experts, [4, 6])
  np.testing.assert_allclose(weights, [2.5 * 0.6 / 1.15, 2.5 * 0.55 / 1.15], rtol=1e-6)
  experts, _ = _route(scores, np.zeros(8), **KW)
  np.testing.assert_array_equal(experts, [4, 5])


def test_routing_group_scored_by_its_two_best():
  # Group 0 holds the best expert (0.9) but scores 0.9 + 0.1 < 0.6 + 0.6 of group 1.
  experts, _ = _route([0.9, 0.1, 0.6, 0.6, 0.2, 0.2, 0.2, 0.2], np.zeros(8),
                      k=2, n_group=4, topk_group=1, scaling=1.0)
  np.testing.assert_array_equal(experts, [2, 3])


def test_routing_ties_go_to_the_lower_index_and_k1_is_unnormalised():
  experts, weights = _route([0.5] * 8, np.zeros(8), **KW)
  np.testing.assert_array_equal(experts, [0, 1])
  experts, weights = _route([0.3] * 8, np.zeros(8), k=1, n_group=2, topk_group=1, scaling=2.5)
  np.testing.assert_array_equal(experts, [0])
  np.testing.assert_allclose(weights, [0.75], rtol=1e-6)


def test_routing_replay_keeps_the_recorded_experts():
  scores = [0.9, 0.01, 0.8, 0.05, 0.6, 0.6, 0.55, 0.55]
  logits = jnp.asarray(np.log(np.divide(scores, np.subtract(1, scores))), jnp.float32)[None]
  experts, weights = moe.route_experts(logits, jnp.zeros(8), forced_MxK=jnp.asarray([[0, 2]]),
                                       **KW)
  np.testing.assert_array_equal(experts, [[0, 2]])
  np.testing.assert_allclose(weights, [[2.5 * 0.9 / 1.7, 2.5 * 0.8 / 1.7]], rtol=1e-6)


def test_layers_below_first_k_dense_replace_are_dense():
  model = nnx.eval_shape(lambda: models.create(models.llada2_tiny(n_layers=3,
                                                                  first_k_dense_replace=2)))
  assert [hasattr(b, "moe") for b in model.blocks] == [False, False, True]
  assert model.blocks[2].moe.shared_experts is not None
  no_shared = nnx.eval_shape(lambda: models.create(models.llada2_tiny(num_shared_experts=0)))
  assert no_shared.blocks[1].moe.shared_experts is None


@pytest.mark.parametrize("changes, key", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    ({"n_group": 3}, "n_group=3"),
    ({"n_group": 8}, "n_group=8"),
    ({"topk_group": 5}, "topk_group=5"),
    ({"topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok=3"),
    ({"first_k_dense_replace": 3}, "first_k_dense_replace=3"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor=0.1"),
])
def test_bad_moe_configs_are_refused_naming_the_key(changes, key):
  with pytest.raises(ValueError, match=key) as e:
    models.llada2_tiny(**changes)
  assert "\n" not in str(e.value)


def test_num_params_counts_every_parameter():
  cfg = models.llada2_tiny()
  state = nnx.state(nnx.eval_shape(lambda: models.create(cfg)), nnx.Param)
  assert cfg.num_params == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


def test_hf_export_is_the_released_format_and_round_trips(tmp_path):
  cfg = models.llada2_tiny()
  model = _randomise(models.create(cfg, seed=5))
  out = str(tmp_path / "hf")
  models.export_pretrained(model, out)
  with open(os.path.join(out, "config.json")) as f:
    hf = json.load(f)
  assert hf["model_type"] == "llada2_moe"
  assert hf["auto_map"]["AutoModelForCausalLM"] == "modeling_llada2_moe.LLaDA2MoeModelLM"
  for key, want in (("num_experts", 8), ("num_experts_per_tok", 2), ("n_group", 4),
                    ("topk_group", 2), ("moe_intermediate_size", 64), ("num_shared_experts", 1),
                    ("first_k_dense_replace", 1), ("routed_scaling_factor", 2.5),
                    ("partial_rotary_factor", 0.5), ("head_dim", 16), ("use_qk_norm", True),
                    ("use_bias", False), ("use_qkv_bias", False), ("score_function", "sigmoid")):
    assert hf[key] == want, key
  with open(os.path.join(out, "generation_config.json")) as f:
    assert json.load(f)["eos_token_id"] == cfg.eos_token_id
  reader = models.safetensors_io.Reader(out)
  d, f_, e = cfg.d_model, cfg.moe_intermediate_size, cfg.num_experts
  qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
  for name, shape in (("model.word_embeddings.weight", (cfg.vocab_size, d)),
                      ("model.layers.0.attention.query_key_value.weight", (qkv, d)),
                      ("model.layers.0.attention.dense.weight", (d, cfg.n_heads * cfg.head_dim)),
                      ("model.layers.0.attention.query_layernorm.weight", (cfg.head_dim,)),
                      ("model.layers.0.mlp.gate_proj.weight", (cfg.mlp_dim, d)),
                      ("model.layers.1.mlp.gate.weight", (e, d)),
                      ("model.layers.1.mlp.gate.expert_bias", (e,)),
                      ("model.layers.1.mlp.experts.7.down_proj.weight", (d, f_)),
                      ("model.layers.1.mlp.shared_experts.up_proj.weight", (f_, d)),
                      ("lm_head.weight", (cfg.vocab_size, d))):
    assert reader.shape(name) == shape, name
  # Expert 7's down projection is the model's slice 7, transposed (torch Linear layout).
  np.testing.assert_array_equal(reader.read("model.layers.1.mlp.experts.7.down_proj.weight"),
                                np.asarray(model.blocks[1].moe.down_kernel[...][7]).T)
  loaded, loaded_cfg = models.load_pretrained(out, dtype="float32")
  assert loaded_cfg == cfg
  ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 8)))
  np.testing.assert_array_equal(np.asarray(_logits(loaded, ids, "block_causal")),
                                np.asarray(_logits(model, ids, "block_causal")))


def test_loading_on_a_mesh_reads_each_devices_experts_and_part_of_each(tmp_path, monkeypatch):
  """Experts over `expert` (2 of 8 per device) and their input dimension over `fsdp`: every read
  of an expert tensor is one device's half of it, and the loaded model is the exported one."""
  from stabledrl_jax import sharding
  cfg = models.llada2_tiny()
  model = _randomise(models.create(cfg, seed=5))
  out = str(tmp_path / "hf")
  models.export_pretrained(model, out)
  reads = []
  read = models.safetensors_io.Reader.read
  def spy(self, name, idx=None):
    reads.append((name, idx))
    return read(self, name, idx)
  monkeypatch.setattr(models.safetensors_io.Reader, "read", spy)
  mesh = sharding.make_mesh({"expert": 4, "fsdp": 2})
  loaded, _ = models.load_pretrained(out, dtype="float32", mesh=mesh)
  kernel = loaded.blocks[1].moe.gate_kernel[...]
  assert tuple(kernel.sharding.spec)[:2] == ("expert", "fsdp"), kernel.sharding
  np.testing.assert_array_equal(np.asarray(kernel),
                                np.asarray(model.blocks[1].moe.gate_kernel[...]))
  expert_reads = [(n, idx) for n, idx in reads if ".experts." in n]
  assert len(expert_reads) == 2 * 3 * cfg.num_experts  # each tensor by the 2 devices sharing it
  for name, idx in expert_reads:  # half of the torch-layout [out, in] tensor: its `in` half
    shape = models.safetensors_io.Reader(out).shape(name)
    rows, cols = (len(range(shape[i])[idx[i]]) for i in (0, 1))
    assert rows * cols * 2 == shape[0] * shape[1], (name, idx)
  ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 8)))
  np.testing.assert_allclose(np.asarray(_logits(loaded, ids, "block_causal")),
                             np.asarray(_logits(model, ids, "block_causal")), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key, value", [("use_bias", True), ("score_function", "softmax"),
                                        ("norm_topk_prob", False), ("use_qkv_bias", True)])
def test_unsupported_released_options_are_refused_naming_the_key(key, value):
  hf = hf_config.config_to_hf(models.llada2_tiny())
  hf[key] = value
  with pytest.raises(ValueError, match=f"{key}={value!r}"):
    hf_config.config_from_hf(hf)


def test_expert_parallel_logits_and_gradients_match_one_device():
  """Experts split over the `expert` mesh axis (2 of 8 per device) and the tokens over it and
  `data`: the same loss and gradients as on one device, and the same logits when replaying
  given experts (routing replay; here each token's next experts, not its own choice)."""
  from stabledrl_jax import sharding
  cfg = models.llada2_tiny()
  model = _randomise(models.create(cfg, seed=7))
  ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (8, 8))

  @nnx.jit
  def loss_and_grads(m, ids):
    return nnx.value_and_grad(lambda m: jnp.mean(
        jax.nn.log_softmax(m.logits(ids, attention="block_causal"))[..., 3]))(m)

  replay = nnx.jit(lambda m, ids, routes: m.staircase_logits(ids, ids, routes=routes,
                                                            with_routes=True))
  want_loss, want_grads = loss_and_grads(model, jnp.asarray(ids))
  want_grads = nnx.to_pure_dict(want_grads)
  routes = (np.asarray(replay(model, jnp.asarray(ids), None)[1]) + 1) % cfg.num_experts  # others
  want_replayed = replay(model, jnp.asarray(ids), jnp.asarray(routes))[0]
  mesh = sharding.make_mesh({"data": 2, "expert": 4})
  sharding.shard_model(model, mesh)
  kernel = model.blocks[1].moe.gate_kernel[...]
  assert kernel.sharding.spec[0] == "expert", kernel.sharding
  got_replayed = replay(model, sharding.shard_batch(ids, mesh), sharding.shard_batch(routes, mesh))
  np.testing.assert_allclose(np.asarray(got_replayed[0]), np.asarray(want_replayed), rtol=1e-5,
                             atol=1e-5)
  got_loss, got_grads = loss_and_grads(model, sharding.shard_batch(ids, mesh))
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                                       atol=1e-6),
               nnx.to_pure_dict(got_grads), want_grads)


@pytest.mark.parametrize("impl", moe.IMPLS)
def test_the_experts_step_shrinks_with_the_devices(impl):
  """Each device routes and sorts its own rows: the compiled loss-and-gradient of a batch split
  over 8 devices needs under a quarter of one device's temporaries (measured 45 of 344 MiB with
  tiles, 70 of 580 with ragged_dot). Left to the compiler, the sort by expert gathered every
  row onto every device: 200 and 446 MiB on 8 devices."""
  from stabledrl_jax import sharding
  cfg = models.llada2_tiny(moe_impl=impl, d_model=128, moe_intermediate_size=128)
  ids = np.zeros((64, 128), np.int32)

  def temporaries(devices):
    model = models.create(cfg, seed=0)
    mesh = sharding.make_mesh({"fsdp": len(devices)}, devices)
    sharding.shard_model(model, mesh)
    step = nnx.jit(lambda m, ids: nnx.grad(lambda m: jnp.mean(
        jax.nn.log_softmax(m.logits(ids, attention="block_causal"))[..., 3]))(m))
    compiled = step.lower(model, sharding.shard_batch(ids, mesh)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  one, eight = temporaries(jax.devices()[:1]), temporaries(jax.devices()[:8])
  assert eight < one / 4, (one / 2**20, eight / 2**20)


def test_routing_replay_reproduces_the_behaviour_forward():
  """The expert bias moves only the choice. A model whose bias sends every token elsewhere
  computes other logits; replaying the first model's experts in it gives the first model's
  logits exactly (the weights are the unbiased scores, the same in both)."""
  cfg = models.llada2_tiny()
  model = _randomise(models.create(cfg, seed=2))
  ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 8)))
  run = nnx.jit(lambda m, ids, routes: m.staircase_logits(ids, ids, routes=routes,
                                                         with_routes=True))
  want, routes = run(model, ids, None)
  assert routes.shape == (2, 1, 16, cfg.num_experts_per_tok)
  same, _ = run(model, ids, routes)
  np.testing.assert_array_equal(np.asarray(same), np.asarray(want))
  moe_layer = model.blocks[1].moe
  moe_layer.expert_bias.set_value(jnp.asarray([0, 0, 0, 0, 0, 0, 5.0, 5.0]))  # always 6 and 7
  moved, moved_routes = run(model, ids, None)
  assert set(np.unique(np.asarray(moved_routes))) == {6, 7}
  assert np.abs(np.asarray(moved) - np.asarray(want)).max() > 1e-3
  replayed, replayed_routes = run(model, ids, routes)
  np.testing.assert_array_equal(np.asarray(replayed_routes), np.asarray(routes))
  np.testing.assert_allclose(np.asarray(replayed), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name, total, active", [("llada2_mini", 16e9, 1.4e9),
                                                 ("llada2_flash", 100e9, 6.1e9)])
def test_released_sizes_match_the_published_parameter_counts(name, total, active):
  """inclusionAI's model cards: mini 16B (1.4B active), flash 100B (6.1B active); active counts
  the embedding and the head."""
  cfg = models.preset(name)
  attention = cfg.n_layers * cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
  active_params = attention + cfg.active_mlp_params + 2 * cfg.vocab_size * cfg.d_model
  assert abs(cfg.num_params / total - 1) < 0.04
  assert abs(active_params / active - 1) < 0.04


def test_tiled_experts_equal_ragged_dot_values_and_gradients():
  """The two grouped-matmul formulations: the same outputs and gradients, with an expert that
  gets no token and one that gets more than a tile."""
  rng = np.random.default_rng(9)
  m, d, f, e, k = 40, 8, 6, 5, 2
  x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
  experts = jnp.asarray(np.stack([rng.choice([0, 1, 3, 4], 2, replace=False, p=[0.7, 0.1, 0.1, 0.1])
                                  for _ in range(m)]))
  weights = jnp.asarray(rng.random((m, k)), jnp.float32)
  ws = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]

  def run(impl):
    return jax.value_and_grad(lambda x, ws: jnp.sum(jnp.sin(moe.grouped_swiglu(
        x, experts, weights, *ws, impl=impl))), argnums=(0, 1))(x, ws)

  (v1, g1), (v2, g2) = run("ragged_dot"), run("tiles")
  np.testing.assert_allclose(v2, v1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), g2, g1)
  # Decoding's few rows, each assignment its own expert: every expert needs a whole tile, and
  # the tile count's bound (n + min(n, e) (tile - 1)) / tile is reached exactly.
  x, experts, weights = x[:2], jnp.asarray([[0, 1], [2, 3]]), weights[:2]  # 4 tiles of 8 rows
  (v1, g1), (v2, g2) = run("ragged_dot"), run("tiles")
  np.testing.assert_allclose(v2, v1, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), g2, g1)


def test_lora_default_targets_are_the_released_module_names():
  from stabledrl_jax import lora
  chosen = lora.select(models.llada2_tiny(), lora.DEFAULT_TARGETS["llada2"])
  assert sorted(chosen) == [
      f"model.layers.{i}.{name}" for i, names in (
          (0, ("attention.dense", "attention.query_key_value", "mlp.down_proj", "mlp.gate_proj",
               "mlp.up_proj")),
          (1, ("attention.dense", "attention.query_key_value", "mlp.shared_experts.down_proj",
               "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")))
      for name in names]
