"""Analytic FLOPs of the RL step's phases, and model FLOPs utilisation (MFU).

Counts matrix-multiply FLOPs (2 per multiply-add): the projections, the MLP and the head for every
query token, and `QKᵀ` and `AV` against every attended key. Elementwise work (norms, softmax,
RoPE) is left out, as MFU conventionally does. Backward = 2 x forward.
"""
from __future__ import annotations

import dataclasses

from stabledrl_jax.models.config import ModelConfig

# Dense bfloat16 peak per chip, FLOP/s (public specifications); MFU is reported only for these.
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
              "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
              "NVIDIA H100": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100": 312e12}


def forward_flops(cfg: ModelConfig, batch: int, queries: float, keys: float | None = None,
                  head_queries: float | None = None) -> float:
  """One forward of `batch` rows of `queries` tokens, each attending to `keys` (default: queries),
  with the vocabulary head on `head_queries` of them (default: all)."""
  keys = queries if keys is None else keys
  head_queries = queries if head_queries is None else head_queries
  d, hd = cfg.d_model, cfg.head_dim
  per_token = (cfg.n_layers * d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
               + cfg.active_mlp_params)
  attention = cfg.n_layers * 2 * 2 * cfg.n_heads * hd * keys  # QKᵀ and AV, per query
  head = 2.0 * d * cfg.vocab_size * head_queries  # the embedding is a lookup
  return batch * (2.0 * queries * per_token + queries * attention + head)


@dataclasses.dataclass(frozen=True)
class StepShape:
  """What one RL step computes on: `rows` rollouts of `prompt` + `gen` tokens (`total` in the
  sequence layout), `samples` Monte Carlo masks each, `updates` optimiser steps (μ)."""
  rows: int
  prompt: int
  gen: int
  total: int
  samples: int
  updates: int
  sampler_steps: int
  block: int              # the sampler's `head_slots` (LLaDA, SDAR: its block; Dream: the
                          # generated region, or the fast decoder's block)
  staircase: bool         # SDAR: the likelihood runs on [x_t ; x_0] (twice the length)
  reference: bool = False  # a KL reference model adds one more likelihood forward
  # LLaDA: the sampler's own counts per row (`Rollout.forwards_B`, `forward_tokens_B`), which
  # cached and threshold decoding need; None: `sampler_steps` full forwards.
  forwards: float | None = None
  forward_tokens: float | None = None


def rl_step_flops(cfg: ModelConfig, s: StepShape) -> dict[str, float]:
  """`rollout`, `likelihood` (behaviour policy, and reference) and `update` FLOPs of one RL step.

  Rollout, LLaDA and Dream: `forwards` forwards (default `sampler_steps`) of `forward_tokens`
  tokens in all (default `total` each), every token attending to the whole sequence (a cached
  forward's keys are the cache and its own), the head on `block` positions only. SDAR (KV cache):
  per completion block up to `sampler_steps` forwards of the block plus one that commits it, each
  attending to the prefix, after one prefill of the prompt. `sampler_steps` is an upper bound
  for early-stopping strategies.
  """
  if s.staircase:
    blocks = -(-s.gen // s.block)
    prefix = s.total - blocks * s.block
    rollout = forward_flops(cfg, s.rows, prefix) if prefix else 0.0
    for j in range(blocks):
      rollout += (s.sampler_steps + 1) * forward_flops(cfg, s.rows, s.block, prefix + (j + 1) * s.block)
    seq = 2 * s.total
  else:
    forwards = s.sampler_steps if s.forwards is None else s.forwards
    tokens = forwards * s.total if s.forward_tokens is None else s.forward_tokens
    rollout = forward_flops(cfg, s.rows, tokens, s.total, head_queries=forwards * s.block)
    seq = s.total
  one = forward_flops(cfg, s.rows * s.samples, seq)
  return {"rollout": rollout, "likelihood": one * (2 if s.reference else 1),
          "update": 3.0 * one * s.updates}


def peak_flops(device_kind: str) -> float | None:
  """The chip's dense bf16 peak, or None when unknown (CPUs, unlisted chips)."""
  for name in sorted(PEAK_FLOPS, key=len, reverse=True):
    if device_kind.startswith(name):
      return PEAK_FLOPS[name]
  return None
