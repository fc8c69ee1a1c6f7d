"""The config presets (`configs/NAME.py:PRESET`): `tiny`, `smoke`, `sudoku`, `8b`, `8b_official`,
`8b_ar` (LLaDA), `8b_lora` (LLaDA, SDAR) and `7b` (Dream), as edits of `config_lib.base_config`'s
dict, every one of them here and nowhere else (`config_lib.apply_preset` is this module's
`apply_preset`).
"""
from __future__ import annotations

import ml_collections

from stabledrl_jax.models.config import BLOCK_DIFFUSION


PRESETS = ("tiny", "smoke", "sudoku", "8b", "8b_official", "8b_ar", "8b_lora", "7b", "mini",
           "flash")
# A pretrained checkpoint's settings.
CHECKPOINT_PRESETS = ("8b", "8b_official", "8b_ar", "8b_lora", "7b", "mini", "flash")
# The checkpoint presets of each family (the rest: LLaDA's and SDAR's 8b ones).
FAMILY_CHECKPOINT_PRESETS = {"dream": ("7b",), "llada2": ("mini", "flash")}


def apply_preset(c: ml_collections.ConfigDict, preset: str) -> None:
  """`tiny` is the default (clean SFT, then RL, on sorting digits); `smoke` the same path in
  minutes (on Sudoku); `sudoku` the earlier main job (4x4 Sudoku from a demonstrator that leaves
  half the blanks empty); `8b` the project's recommended 8B setting (the official run's, with the
  differences of docs/training.md); `8b_official` the official StableDRL code's GSM8K run
  (`official_gsm8k`); `8b_ar` JustGRPO's run, GRPO on left-to-right rollouts with the
  exact autoregressive likelihood (`just_grpo`, LLaDA only); `8b_lora` the `8b` run training LoRA
  adapters with d1's settings (`d1_lora`); `7b` Dream-v0-Instruct-7B with the published Dream RL
  settings (`dream_7b`); `mini` and `flash` LLaDA2.0-mini / -flash (`llada2`)."""
  if preset not in PRESETS:
    raise ValueError(f"unknown config preset {preset!r}: expected one of {PRESETS}")
  own = FAMILY_CHECKPOINT_PRESETS.get(c.family, ("8b", "8b_official", "8b_ar", "8b_lora"))
  if preset in CHECKPOINT_PRESETS and preset not in own:
    raise ValueError(f"config preset {preset!r} with family={c.family!r}: the {c.family} "
                     f"checkpoint preset is {own[0]!r}")
  if preset in ("sudoku", "smoke"):
    # The Sudoku job (docs/results.md, earlier runs): SFT imitates a demonstrator that leaves each blank empty with
    # probability task.sft_unfilled; RL on the true reward undoes it. The smoke run is a few steps
    # of it: Sudoku's partial credit gives rewards after a few SFT steps, sorting's does not.
    c.task.name, c.task.num_train, c.task.max_prompt_len = "sudoku", 2000, 24
    c.sft.steps = 300 if c.family in BLOCK_DIFFUSION else 700  # full attention learns Sudoku more slowly
    c.sft.stop_at_accuracy = 0.0
    c.rl.steps, c.rl.warmup_steps, c.eval.every = 40, 0, 10
    c.sampler.gen_length, c.sampler.steps = 20, 10
  if preset == "smoke":
    c.model.n_layers, c.model.d_model, c.model.mlp_dim = 2, 64, 128
    c.task.num_train, c.task.num_test = 256, 32
    c.sft.steps, c.sft.batch_size = 6, 16
    c.rl.steps, c.rl.prompts_per_step, c.rl.group_size = 6, 4, 4
    c.sampler.steps = 2 if c.family in BLOCK_DIFFUSION else 5  # SDAR: per block; LLaDA, Dream: total
    c.eval.num_examples, c.eval.every = 32, 4
    c.checkpoint.every = 4
  if preset in CHECKPOINT_PRESETS:
    # Shared by the checkpoint presets: from the official StableDRL GSM8K run (docs/method.md §6),
    # fp32 master weights, bf16 compute; `official_gsm8k` sets the rest of that run.
    c.model.checkpoint = "/path/to/checkpoint"  # must be overridden
    c.mesh.data, c.mesh.fsdp = 1, -1  # FSDP over every chip
    c.model.tokenizer = "checkpoint"
    c.model.compute_dtype = "bfloat16"
    c.model.remat = True
    c.task.name, c.task.source, c.task.source_dir = "gsm8k", "local", ""  # the user's data
    c.task.prompt_style, c.task.chat, c.task.max_prompt_len = "plain", True, 512
    c.sft.steps, c.sft.stop_at_accuracy = 0, 0.0
    c.rl.steps, c.rl.warmup_steps = 1000, 0
    c.task.num_train = 2000  # unused with local data; as before, so earlier 8b runs resume
    c.rl.lr, c.optim.decay_steps, c.optim.grad_clip = 2e-6, 2000, 0.2
    c.rl.group_size, c.rl.updates_per_batch = 16, 2
    c.rl.prompts_per_step = 16
    c.rl.num_samples = 2
    c.rl.max_ratio = 5.0  # the official code clips the ratio at 5 from above
    c.sampler.gen_length, c.sampler.temperature = 256, 0.9
    c.eval.num_examples, c.eval.every, c.eval.batch_size = 1319, 100, 64
    c.checkpoint.every, c.log_every = 25, 1
    if c.family == "dream":
      dream_7b(c)
    elif c.family == "llada2":
      llada2(c, preset)
    elif c.family == "llada":
      c.model.preset = "llada_8b"
      c.rl.accumulation = 4
      # Rollouts: gen 256, block 32, 128 steps (docs/method.md §6), with the block-wise KV cache
      # (docs/fast_rollouts.md; 8b_official decodes exactly, as the official code).
      c.sampler.block_length, c.sampler.steps = 32, 128
      c.sampler.cache = "none" if preset == "8b_official" else "dual"
    else:
      c.model.preset = "sdar_8b"
      c.sampler.block_length, c.sampler.steps = 4, 4  # denoising steps per block of 4
      c.rl.accumulation = 8  # the same update in 8 micro-batches: fits 4 v5p chips (docs/scaling.md)
  if preset == "8b_official":
    official_gsm8k(c)
  if preset == "8b_ar":
    just_grpo(c)
  if preset == "8b_lora":
    d1_lora(c)


def llada2(c: ml_collections.ConfigDict, preset: str) -> None:
  """LLaDA2.0-mini or -flash (`models.llada2_mini` / `llada2_flash`) on GSM8K, on top of the
  checkpoint presets' shared settings (StableDRL's GSM8K run). Rollouts decode as the released
  `generate` defaults (modeling_llada2_moe.py): blocks of 32, 32 steps a block, every masked
  token above 0.95 committed (at least the scheduled count); the expert router frozen
  (model.train_router). Fits ahead of time (docs/llada2.md): mini with LoRA on v6e-8, flash with
  LoRA on v5p-16; mini's full fine-tuning fits neither v5p-8 nor v5p-16."""
  c.model.preset = "llada2_mini" if preset == "mini" else "llada2_flash"
  c.model.moe_impl = "ragged_dot"  # grouped kernels of the accelerators
  c.sampler.block_length, c.sampler.steps = 32, 32
  c.sampler.threshold = 0.95
  c.rl.accumulation = 8


def d1_lora(c: ml_collections.ConfigDict) -> None:
  """d1's LoRA (dllm-reasoning/d1, diffu-GRPO on LLaDA-8B-Instruct: its peft LoraConfig and
  train.yaml) on top of the `8b` preset: r=128, lora_alpha=64, lora_dropout=0.05, the Qwen/LLaMA
  target_modules below, and its learning rate 3e-6; the frozen base stored in bfloat16 (d1's
  QLoRA 4-bit base is not built here); everything else is the `8b` preset's.

  PEFT's matching is kept: a name that selects no module is skipped, one must select. On LLaDA's
  own module names (attn_out, ff_proj, ff_out) only q_proj, k_proj, v_proj and up_proj exist, so
  PEFT, d1 and this preset adapt just those four; on SDAR's Qwen-style names all seven."""
  c.model.lora.rank, c.model.lora.alpha, c.model.lora.dropout = 128, 64.0, 0.05
  c.model.lora.targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
  c.model.param_dtype = "bfloat16"
  c.rl.lr = 3e-6


def official_gsm8k(c: ml_collections.ConfigDict) -> None:
  """The official StableDRL code's GSM8K training run, line for line (docs/training.md: choosing a preset),
  on top of the `8b` preset's settings (which already match it where this sets nothing, e.g. its
  rollouts: gen 256, block 32, 128 steps).

  Its config sets one prompt per process per micro-batch and 4 micro-batches; its README launches
  8 processes, so an optimiser step averages 32 groups: 32 prompts here, 4 micro-batches of 8 (one
  per chip on 8 chips). Rewards: its GSM8K correctness is +1/-1, twice the project's 1/0 plus a
  constant that the mean-centred advantages cancel.
  """
  if c.family != "llada":
    raise ValueError(f"config preset '8b_official' with family={c.family!r}: the official "
                     "StableDRL code trains LLaDA only; use configs/llada.py:8b_official")
  c.seed = 113
  c.model.compute_dtype, c.model.remat = "bfloat16", True  # remat: every whole layer
  c.task.reward_weights = ml_collections.ConfigDict({"correctness": 2.0})
  c.rl.objective, c.rl.spg_beta, c.rl.spg_omega = "stabledrl_spg", 1.5, 0.5
  c.rl.max_ratio, c.rl.coupling, c.rl.advantage, c.rl.kl_coef = 5.0, "independent", "mean", 0.0
  c.rl.scheme, c.rl.num_samples, c.rl.p_mask_prompt = "block_random", 2, 0.15
  c.rl.group_size, c.rl.prompts_per_step, c.rl.accumulation = 16, 32, 4
  c.rl.updates_per_batch, c.rl.steps = 2, 1000  # 2000 optimiser steps
  c.rl.lr, c.rl.warmup_steps = 2e-6, 0
  c.optim.b1, c.optim.b2, c.optim.weight_decay = 0.9, 0.99, 0.1
  c.optim.decay_steps, c.optim.grad_clip = 2000, 0.2
  c.sampler.temperature, c.sampler.remasking = 0.9, "low_confidence"  # gen 256, block 32, 128 steps


def just_grpo(c: ml_collections.ConfigDict) -> None:
  """JustGRPO (Ni et al., "The Flexibility Trap", arXiv 2601.15165): plain GRPO on
  LLaDA-8B-Instruct with rollouts decoded left to right, one token a step, and the exact
  autoregressive likelihood, on top of the `8b` preset; 89.1 on GSM8K (the paper's abstract; 256
  tokens in the code's README results table). The values are those of the public code,
  github.com/LeapLabTHU/JustGRPO (commit eebe50e; the GSM8K values unchanged since its first
  release): its `train.py` (`TrainConfig`, the AdamW call), `grpo.py` (`sample`, `logprob_loss`,
  `compute_group_advantages`) and README (the GSM8K training command and its batch note). The
  paper's own text was not available here; nothing below comes from it but the score.

  - The method: rl.scheme=trajectory with rl.trajectory_shrink=1 and sampler.order=left_to_right,
    sampler.steps = sampler.gen_length = 256 (`grpo.sample`: LLaDA's generate with block_length 1,
    gen_steps = gen_length = 256; `logprob_loss`: one forward per completion token, its
    predecessors visible and its successors masked). The objective is GRPO's token-level PPO clip
    (rl.objective=grpo) with ε 0.2 (`logprob_loss` eps), no KL term (the 8b's kl_coef 0), one
    update per rollout batch (μ = 1: the ratio is taken against the same parameters' detached
    log-probabilities), advantages (r - mean) / (std + 1e-4) within the group (mean_std).
  - Rollouts: G = 16 (num_generations 8 x repeat_times 2), temperature 1.0 (`sample`'s default;
    `train.py` passes none).
  - Batch: 64 prompts per optimiser step (README: global batch num_gpus x grad_accum = 64; 8
    processes x 1 prompt x grad_accum 8), in 8 micro-batches of 8 prompts (grad_accum 8; 8
    prompts = JustGRPO's one per process). 125 steps (total_steps).
  - AdamW: lr 5e-6, betas (0.9, 0.999), eps 1e-8 (optax's default too), weight decay 0, gradient
    clip 1.0 (max_grad_norm), seed 1234. JustGRPO's rate is constant (no scheduler); the
    project's optimiser always decays linearly, so here over 10^6 updates: within 0.013% of
    constant over the run's 125.

  Kept from the `8b` preset: GSM8K with the project's plain chat prompt (JustGRPO's prompt is the
  bare question through the chat template) and 1/0 correctness (JustGRPO's +1/-1 is 2x that minus
  1: the mean_std advantages cancel both, up to the 1e-4); bf16 compute with every layer
  rematerialised (as JustGRPO's whole-layer activation checkpointing), fp32 master weights
  (JustGRPO keeps its weights in bfloat16); sampler.block_length 32 (JustGRPO's evaluation block;
  left to right, the block does not change the exact rollouts); sampler.cache=dual: the cached
  sampler decodes left to right too, though its rollouts are not the model's exact distribution
  (JustGRPO's are: --config.sampler.cache=none); checkpointing, evaluation and the unused
  StableDRL keys (rl.max_ratio, rl.num_samples). Not reproduced: JustGRPO's loss normalisation
  (each token's term / gen_length / the mean count of non-zero advantages, padding tokens after
  the answer included; here the per-sequence mean over counted tokens). Its reported score
  decodes greedily in blocks of 32 in 256 steps by confidence, not left to right: evaluate with
  --config.sampler.order=confidence for that figure. The sampler decodes a step's 1024
  rollouts 256 at a time (sampler.chunk, the same tokens as at once): 256 is the `8b` preset's
  rollout batch; the preset fits a v5p-8 as it is (docs/scaling_fits.md).
  """
  if c.family != "llada":
    raise ValueError(f"config preset '8b_ar' with family={c.family!r}: JustGRPO's published run "
                     "trains LLaDA only; use configs/llada.py:8b_ar")
  c.seed = 1234
  c.rl.objective, c.rl.ppo_epsilon, c.rl.kl_coef, c.rl.advantage = "grpo", 0.2, 0.0, "mean_std"
  c.rl.scheme, c.rl.trajectory_shrink = "trajectory", 1
  # Its 256 forwards one at a time, each recomputed in the backward pass (JustGRPO runs one
  # backward per position): a pass holds 128 rows (sequences x copies), as the `8b` preset's.
  c.rl.copies_per_pass = 1
  c.rl.group_size, c.rl.updates_per_batch = 16, 1
  c.rl.prompts_per_step, c.rl.accumulation, c.rl.steps = 64, 8, 125
  c.rl.lr, c.rl.warmup_steps = 5e-6, 0
  c.optim.b1, c.optim.b2, c.optim.weight_decay, c.optim.grad_clip = 0.9, 0.999, 0.0, 1.0
  c.optim.decay_steps = 10**6  # ~constant (see above)
  c.sampler.order, c.sampler.temperature = "left_to_right", 1.0
  c.sampler.gen_length = c.sampler.steps = 256
  c.sampler.chunk = 256


def dream_7b(c: ml_collections.ConfigDict) -> None:
  """Dream-v0-Instruct-7B (`models.dream_7b`) on GSM8K, on top of the `8b` presets' shared
  settings (GSM8K, StableDRL, fp32 master weights, FSDP). Where a Dream RL run published a
  value it is taken from it, each with its source: DiffuCoder's coupled-GRPO (apple/ml-diffucoder,
  recipes/config_coupled_code.yaml, and the `diffusion_generate` call of
  src/open_r1/coupled_grpo.py), which decodes with Dream's own sampler, and dLLM-RL's TraceRL
  for Dream (Gen-Verse/dLLM-RL, configs/rl_dream.yaml), which decodes with a block sampler of its
  own. The rest is the `8b` presets' (StableDRL's GSM8K run: `official_gsm8k`'s docstring)."""
  c.model.preset = "dream_7b"
  c.task.max_prompt_len = 512  # dLLM-RL rl_dream.yaml training.max_prompt_len (and the 8b's)
  # Rollouts, DiffuCoder: max_completion_length 256, diffusion_steps 256 (one token a step),
  # generation_temperature 1.0, top_p 0.95, alg entropy, alg_temp 0.
  c.sampler.gen_length, c.sampler.steps = 256, 256
  c.sampler.temperature, c.sampler.top_p, c.sampler.top_k = 1.0, 0.95, 0
  c.sampler.alg, c.sampler.alg_temp, c.sampler.eps = "entropy", 0.0, 1e-3
  # The likelihood's blocks (rl.scheme=block_random), as LLaDA's 8b, and the fast decoder's:
  # Fast-dLLM's Dream settings (NVlabs/Fast-dLLM dream/eval_gsm8k.sh: blocks of 32, threshold 0.9,
  # dual cache) are --config.sampler.cache=dual --config.sampler.threshold=0.9
  # --config.sampler.alg=maskgit_plus (its loop ignores the steps; here 256 never bind).
  c.sampler.block_length = 32
  # DiffuCoder: num_generations 10, num_iterations 2 (μ), 8 processes x per-device batch 5 x
  # gradient_accumulation_steps 2 = 80 completions (8 prompts) per optimiser step.
  c.rl.group_size, c.rl.updates_per_batch = 10, 2
  c.rl.prompts_per_step, c.rl.accumulation = 8, 2
  c.rl.lr, c.rl.warmup_steps = 1e-6, 0  # DiffuCoder learning_rate 1e-6 (warmup_ratio 1e-4)
  # DiffuCoder: adam_beta1 0.9, adam_beta2 0.99, weight_decay 0.1, max_grad_norm 0.2 (the 8b's).
  c.optim.b1, c.optim.b2, c.optim.weight_decay, c.optim.grad_clip = 0.9, 0.99, 0.1, 0.2
  # DiffuCoder: p_mask_prompt 0 (the prompt is never noised in the likelihood); epsilon 0.5
  # (GRPO's clip, rl.ppo_epsilon). Its beta 0.01 is GRPO's KL term: the StableDRL objective has
  # none (--config.rl.objective=grpo --config.rl.kl_coef=0.01 to run DiffuCoder's objective).
  c.rl.p_mask_prompt, c.rl.ppo_epsilon = 0.0, 0.5
