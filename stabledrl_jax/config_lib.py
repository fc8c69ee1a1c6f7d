"""The training config: one `ml_collections.ConfigDict` schema with every key's one default
(`base_config`), its presets (`presets`) and the checks of the keys no settings class owns
(`validate`).

`configs/llada.py`, `configs/sdar.py`, `configs/dream.py` and `configs/llada2.py` build on
`base_config(family)`. The dict is locked, so an
override of a key that does not exist fails in `config_flags` and names the key. Each module that
consumes a section owns a typed, frozen settings class built from it (`from_config`) that checks
its values with one-line errors naming the key: `rl.Settings` / `objectives.Objective` (`rl`),
`rollouts.LLaDASampling` / `SDARSampling` / `DreamSampling` (`sampler`), `sft.Settings` (`sft`),
`detectors.MonitorConfig` (`stability`), `controls.ControlConfig` (`controls`), `build.lora_config`
(`model.lora`, `model.lora_init`); `build.settings` builds them all before anything is compiled or
written. This module imports none of them.
"""
from __future__ import annotations

import math
import os

import ml_collections

from stabledrl_jax import storage
from stabledrl_jax.models.config import BLOCK_DIFFUSION, FAMILIES
from stabledrl_jax.presets import PRESETS, apply_preset, official_gsm8k  # noqa: F401 (the configs' API)


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# The configs: `configs/` beside the package in a checkout; inside it once installed (the wheel
# carries the same files as `stabledrl_jax/configs/`, pyproject.toml).
CONFIG_DIRS = (os.path.join(os.path.dirname(_PACKAGE), "configs"), os.path.join(_PACKAGE, "configs"))


def resolve_config_arg(arg: str) -> str:
  """`configs/NAME.py[:PRESET]` from any directory: a `configs/` path that does not exist here
  names the project's own config (`CONFIG_DIRS`)."""
  path, sep, preset = arg.partition(":")
  if os.path.exists(path) or os.path.basename(os.path.dirname(path)) != "configs":
    return arg
  for directory in CONFIG_DIRS:
    own = os.path.join(directory, os.path.basename(path))
    if os.path.isfile(own):
      return own + sep + preset
  return arg


def resolve_config_flags(argv: list[str], flag: str = "config") -> list[str]:
  """`argv` with the value of `--config=...` (or `--config ...`) resolved by `resolve_config_arg`."""
  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith(f"--{flag}="):
      out[i] = f"--{flag}=" + resolve_config_arg(arg.split("=", 1)[1])
    elif arg == f"--{flag}" and i + 1 < len(out):
      out[i + 1] = resolve_config_arg(out[i + 1])
  return out


def base_config(family: str) -> ml_collections.ConfigDict:
  """Defaults shared by every family: the tiny CPU run, clean SFT then RL on sorting digits.
  Dream (full attention, like LLaDA) takes LLaDA's defaults wherever the families differ."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # draws the model's initialisation, the data order, masks and rollouts
  # "llada" (full attention), "sdar" (block diffusion), "dream" (full attention, shifted
  # prediction) or "llada2" (block diffusion, mixture of experts: models.config)
  c.family = family
  block = family in BLOCK_DIFFUSION  # llada2 takes SDAR's defaults wherever the families differ

  c.model = ml_collections.ConfigDict()
  # models.PRESETS name; shapes below override it (llada2: its experts are the preset's)
  c.model.preset = "llada2_tiny" if family == "llada2" else "tiny"
  c.model.checkpoint = ""       # Hugging Face directory (config.json + safetensors); "" = random init
  c.model.tokenizer = "char"    # "char" (the tiny task tokenizer) or a directory with tokenizer.json
  c.model.n_layers = 4  # shapes of a model trained from scratch (a checkpoint has its own)
  c.model.d_model = 128  # hidden size; a multiple of n_heads
  c.model.n_heads = 4  # query heads
  c.model.n_kv_heads = 4  # key/value heads (grouped-query attention); divides n_heads
  c.model.mlp_dim = 384  # MLP hidden size
  c.model.compute_dtype = "float32"  # activations' dtype; the checkpoint presets: bfloat16
  c.model.param_dtype = "float32"   # stored weights; bfloat16 halves a LoRA run's frozen base
  c.model.remat = False  # recompute each block in the backward pass (the checkpoint presets: True)
  c.model.remat_policy = "nothing"  # with remat: "nothing" | "dots" | "dots_no_batch" saved
  c.model.attention_impl = "dense"  # "blockwise": key tiles, no [heads, T, S] scores
  c.model.attention_tile = 512      # key positions per blockwise tile
  c.model.train_router = False      # llada2: SFT/RL update the MoE router (frozen by default)
  # llada2: the experts' grouped matmuls, "tiles" (the active experts' work on any backend; CPU)
  # or "ragged_dot" (jax.lax.ragged_dot; XLA's CPU lowering multiplies by every expert)
  c.model.moe_impl = "tiles"
  # LoRA (`build.lora_config`): rank 0 = full fine-tuning; > 0 trains only adapters of this rank on
  # a frozen base (checkpoints hold the adapters alone; the export adds them alone in PEFT format).
  c.model.lora = ml_collections.ConfigDict()
  c.model.lora.rank = 0
  c.model.lora.alpha = 16.0     # the update is scaled by alpha / rank
  c.model.lora.dropout = 0.0    # on the adapters' input, in the updates only
  # "" = the family's attention and MLP projections without the head (`lora.DEFAULT_TARGETS`);
  # else comma-separated PEFT target names, matched as PEFT matches them (a module of that name
  # or ending in ".name"; names that select nothing are skipped, one must select), or all-linear.
  c.model.lora.targets = ""
  # A PEFT adapter directory to start from (its adapter_config.json gives rank, alpha, dropout and
  # targets; with model.lora.rank > 0 they must agree); "" = fresh adapters (B = 0).
  c.model.lora_init = ""

  c.task = ml_collections.ConfigDict()
  c.task.name = "sorting"        # a built-in task, "jsonl", or a Task's import path pkg.mod:NAME
  c.task.source = "generated"   # "generated" (sorting, Countdown, Sudoku) or "local" (source_dir)
  c.task.source_dir = ""        # task.source='local': the folder of the task's files
  c.task.data_dir = ""          # TFDS array_record cache; "" = WORKDIR/data
  c.task.blanks = 11            # Sudoku: blanks per puzzle (RL and evaluation)
  c.task.sft_blanks = 8         # Sudoku: blanks per SFT puzzle (0 = task.blanks); SFT on easier
                                # puzzles than RL sees (docs/results.md, earlier runs)
  c.task.sft_unfilled = 0.5     # Sudoku: the SFT demonstrator leaves each blank empty ("0") with
                                # this probability; RL on the true reward undoes it (docs/results.md)
  c.task.num_train = 20_000  # task.source='generated': training examples generated
  c.task.num_test = 256  # task.source='generated': held-out examples generated
  c.task.max_prompt_len = 12  # prompt tokens (left-padded); longer prompts are an error
  c.task.prompt_style = "compact"  # "compact" (tiny models) or "plain" (pretrained models)
  c.task.chat = False           # wrap plain prompts in the tokenizer's chat template
  # {reward name: weight} (Task.rewards); empty: the task's own mix (Task.default_weights; sorting:
  # half partial credit, half the exact answer)
  c.task.reward_weights = ml_collections.ConfigDict()
  c.task.prompt_field = "question"  # jsonl: the prompt's key in each record
  c.task.answer_field = "answer"    # jsonl: the gold answer's key
  c.task.checker = "number"         # jsonl: number | math | import path of a reward function
  # A reward that is NaN, infinite or outside [0, 1]: "error" stops the run naming the example and
  # completion; "clip" clips it to [0, 1] (NaN to 0) and counts it (metrics: invalid_rewards).
  c.task.invalid_reward = "error"

  c.sft = ml_collections.ConfigDict()
  # At most; stopped at partial skill by sft.stop_at_accuracy (docs/results.md: the main
  # job); full attention learns slower.
  c.sft.steps = 200 if block else 300
  c.sft.batch_size = 64  # sequences per SFT step
  c.sft.lr = 1e-3  # peak learning rate (warmup, then linear decay over the stage)
  c.sft.warmup_steps = 20 if block else 40  # linear warmup of the SFT learning rate
  # the masked-diffusion SFT loss's mask scheme (estimators.SCHEMES)
  c.sft.scheme = "block_t" if block else "random_t"
  # > 0: stop SFT (sft.steps at most) at the first check whose greedy accuracy on the last
  # sft.validation_examples training examples (never held-out ones) reaches this, one check every
  # sft.check_every steps; 0: sft.steps steps
  c.sft.stop_at_accuracy = 0.3
  c.sft.check_every = 2  # SFT steps between validation checks (sft.stop_at_accuracy)
  c.sft.validation_examples = 256  # the last training examples, decoded greedily at each check
  # > 0: SFT runs to its plateau instead (excludes sft.stop_at_accuracy): a check every
  # sft.check_every steps and at sft.steps, the best-accuracy weights kept (WORKDIR/sft_best); it
  # stops after this many checks without a better one (counted from the first non-zero accuracy)
  # and RL starts from the best weights
  c.sft.patience = 0
  # > 0: SFT trains on the first N training examples alone (scarce demonstrations); RL's prompts
  # are still the whole training split, the validation examples never among the N
  c.sft.num_demonstrations = 0

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 60  # RL steps, each one rollout batch and rl.updates_per_batch optimiser updates
  # objectives.OBJECTIVES: stabledrl, stabledrl_spg, grpo, espo, spg, spg_is, wd1, rft
  c.rl.objective = "stabledrl"
  c.rl.prompts_per_step = 16  # prompts per RL step, each rolled out rl.group_size times
  c.rl.group_size = 8           # G
  c.rl.updates_per_batch = 2    # μ optimiser steps on the same rollouts
  c.rl.accumulation = 1         # micro-batches per optimiser step (each a whole number of groups)
  c.rl.lr = 3e-5                # about the longest safe step bench/rl_step_probe.py measured (docs/results.md)
  c.rl.warmup_steps = 20        # optimiser updates (docs/results.md: the main job)
  # estimators.SCHEMES, or "trajectory": TraceRL's likelihood of the steps the sampler took
  # (estimators.trajectory_masks); it runs ceil(sampler.steps / rl.trajectory_shrink) forwards
  # (SDAR: per block, all blocks in each) and ignores num_samples, coupling, p_mask_prompt
  c.rl.scheme = "block_t" if block else "block_random"
  c.rl.trajectory_shrink = 1    # trajectory: s decoding steps merged into one forward (TraceRL's s)
  c.rl.num_samples = 2          # M Monte Carlo masks per completion
  # M copies through the model this many at a time, each pass recomputed in the backward pass
  # (0: all M at once); bounds the trajectory scheme's memory, whose M is its forwards
  c.rl.copies_per_pass = 0
  # llada2: the new policy's forwards reuse the experts the behaviour pass chose for each token
  # (routing replay), so the ratio measures the policy change, not a routing flip
  c.rl.routing_replay = False
  c.rl.coupling = "coupled"     # or "independent" (the official code)
  # probability of masking each prompt token in the likelihood's masks
  c.rl.p_mask_prompt = 0.0 if block else 0.15
  c.rl.min_mask_prob = 1e-3     # ε of the masking level t ~ U[ε, 1] (complementary: U[ε, 1 - ε];
                                # DiffuCoder's coupled-GRPO samples t in [0.2, 0.8])
  c.rl.epsilon = 5.0            # StableDRL clip: log ratio in [log(max(1-ε,0)), log(1+ε)]
  c.rl.max_ratio = 0.0          # > 0: clip the ratio at this value from above only (official: 5)
  c.rl.ppo_epsilon = 0.5        # GRPO / ESPO clip
  c.rl.epsilon_high = 0.0       # GRPO's upper clip ("clip-higher"); 0 = rl.ppo_epsilon
  c.rl.kl_coef = 0.0            # > 0 keeps a frozen reference model (GRPO k3, ESPO k2)
  c.rl.advantage = "mean"       # mean | mean_std | leave_one_out
  c.rl.spg_omega = 0.5  # SPG: weight of the EUBO in the surrogate of negative-advantage rows
  c.rl.spg_beta = 1.5  # SPG: the Rényi order β of the EUBO
  c.rl.adversarial = 0.0        # > 0: docs/method.md §8 ratio explosion on this fraction of rollouts (0.7)
  c.rl.filter_zero_advantage = False  # DAPO dynamic sampling: refill groups with equal rewards
  c.rl.max_prompt_draws = 4     # ... drawing at most this many prompt batches a step (first too)
  # rl.objective=rft (rejection-sampling fine-tuning): the rollouts it trains on, those whose
  # reward reaches this (1.0: a whole answer right under sorting's default reward mix)
  c.rl.rft_min_reward = 1.0

  c.optim = ml_collections.ConfigDict()
  c.optim.b1 = 0.9
  c.optim.b2 = 0.99
  c.optim.weight_decay = 0.1  # AdamW's decoupled weight decay
  c.optim.grad_clip = 1.0  # global-norm clip of each update (the checkpoint presets: 0.2, official)
  c.optim.decay_steps = 0       # linear decay to 0 over this many steps; 0 = the stage length
  # AdamW's two moments: float32, or bfloat16 (weights and moments take 8 bytes per parameter
  # instead of 12; changes the numerics: the moments are rounded every step).
  c.optim.moment_dtype = "float32"
  # True: the moments stay in host memory between updates and are copied to the accelerators for
  # each update (same numbers): 3.2 GiB less per chip for LLaDA-8B on v6e-8 (docs/scaling.md,
  # ahead-of-time fit check), at the cost of two host-device copies per update.
  c.optim.offload_state = False
  # True: every RL update also logs the L2 norms of the parameters' change (`update_norm`), of the
  # parameters and of Adam's two moments, in total and per parameter group (`update_norm/attn`,
  # ...): what moved first when a run breaks down. Costs the trainable parameters' size in memory.
  c.optim.update_norms = False

  c.sampler = ml_collections.ConfigDict()
  c.sampler.gen_length = 12      # sorting: <answer>, 8 digits, </answer>, the stop token, a spare
  # LLaDA, Dream: total; SDAR: per block (1 token a step)
  c.sampler.steps = 4 if block else 12
  # The family's block: LLaDA's semi-autoregressive decoding block; SDAR's diffusion block
  # (decoding, the likelihood's staircase, a new model's config); Dream's likelihood blocks
  # (rl.scheme=block_random) and its fast decoder's (its exact sampler has none).
  c.sampler.block_length = 4
  c.sampler.temperature = 0.7   # rollouts; evaluation is greedy
  c.sampler.remasking = "low_confidence"   # LLaDA: low_confidence | random
  # LLaDA, SDAR: "confidence" (the remasking / strategy rule) or "left_to_right" (one token a step
  # in position order; needs steps = gen_length for LLaDA, = block_length for SDAR)
  c.sampler.order = "confidence"
  c.sampler.strategy = "low_confidence_static"  # SDAR: or low_confidence_dynamic (threshold)
  c.sampler.minimal_topk = 1    # LLaDA2.0 (its generate): steps per block <= gen_length // this
  # Fast decoding, for rollouts (evaluation decodes exactly unless eval.fast). LLaDA, Dream
  # (Fast-dLLM's algorithm, `fast_decoding`): block-wise KV reuse none | prefix | dual;
  # threshold: commit every masked token at least this confident (0 = off; Dream: needs
  # alg=maskgit_plus; SDAR: low_confidence_dynamic's, which needs it).
  c.sampler.cache = "none"
  c.sampler.threshold = 0.0
  c.sampler.top_k = 0           # SDAR, Dream: sample among the k most likely tokens (0 = all)
  c.sampler.top_p = 1.0         # SDAR, Dream: nucleus sampling mass (1 = all)
  # Dream (its released `diffusion_generate`): which masked slots a step commits, origin (at
  # random) | maskgit_plus (top probability) | topk_margin (top-1 minus top-2) | entropy
  # (negative entropy); entropy is what Dream's and DiffuCoder's own examples decode with.
  c.sampler.alg = "entropy"
  c.sampler.alg_temp = 0.0      # Dream: > 0 draws the committed slots from softmax(confidence / it)
  c.sampler.eps = 1e-3          # Dream: the last timestep of linspace(1, eps, steps + 1) (released)
  c.sampler.cfg_scale = 0.0     # LLaDA: classifier-free guidance scale (0 = none)
  # Rollouts decoded at once: a batch of more is decoded this many at a time (`lax.scan`), with the
  # same tokens as in one call and the sampler's memory of one chunk (0 = the whole batch at once).
  c.sampler.chunk = 0

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 20             # RL steps between held-out evaluations
  c.eval.num_examples = 256  # held-out examples per evaluation
  c.eval.batch_size = 128  # rows decoded at once in evaluation
  c.eval.fast = False           # True: decode with the rollouts' fast settings (sampler.cache, ...)

  # Stability detectors (docs/method.md §8, `detectors.MonitorConfig`): events go to metrics.jsonl and the
  # console, each naming its row of docs/stability.md's Troubleshooting table.
  c.stability = ml_collections.ConfigDict()
  c.stability.entropy_band = True         # token entropy leaves its running band (either collapse)
  c.stability.entropy_z = 5.0  # band half-width in running standard deviations
  c.stability.repetition = True           # low-entropy collapse: repeated 4-grams in rollouts
  c.stability.repetition_threshold = 0.5  # repeated 4-gram rate that counts
  c.stability.repetition_consecutive = 2  # steps running above it before the event
  c.stability.kl_alarm = True             # KL(old‖new) per token above threshold, 3 steps running
  c.stability.kl_metric = "kl_k3"           # kl_k1 or kl_k3 (`diagnostics.kl_estimates`)
  c.stability.kl_threshold = 0.8  # KL(old‖new) per token that counts
  c.stability.kl_consecutive = 3  # steps running above it before the event
  c.stability.zero_advantage = True       # most groups carry no learning signal
  c.stability.zero_advantage_threshold = 0.9  # fraction of groups with equal rewards that counts
  c.stability.zero_advantage_consecutive = 10  # steps running above it before the event
  c.stability.clip_band = False           # clip fraction outside [clip_low, clip_high]
  # The healthy clip-fraction band, also the adaptive ε control's target (controls.adaptive_epsilon).
  c.stability.clip_low = 0.10
  c.stability.clip_high = 0.15
  c.stability.clip_consecutive = 20  # steps running outside the band before the event
  c.stability.stop_on_event = False       # True: checkpoint and stop at the first event

  # Optional controls (docs/method.md §8, `controls.ControlConfig`), all off: they move the clip ε of the
  # objective (rl.epsilon, or rl.ppo_epsilon for grpo/espo) and scale the learning rate.
  c.controls = ml_collections.ConfigDict()
  c.controls.epsilon_schedule = False     # conservative_epsilon for the first part of RL
  c.controls.conservative_epsilon = 1.0  # the schedule's ε at the start
  c.controls.conservative_fraction = 0.2  # of the RL steps, then ε ramps to its configured value
  c.controls.adaptive_epsilon = False     # hold the clip fraction in stability.clip_low/high
  c.controls.adaptive_every = 10  # RL steps between adaptive ε adjustments
  c.controls.drift = False                # ε·(1 - α·KL) and lr·min(1, 0.5/(KL - threshold + 1))
  c.controls.drift_metric = "kl_k3"  # the KL estimate the drift control follows
  c.controls.drift_threshold = 0.5  # smoothed KL above which the learning rate is braked
  c.controls.drift_alpha = 0.5  # α of ε·(1 - α·KL)
  c.controls.drift_decay = 0.9  # EMA decay of the smoothed KL

  # Device mesh (`sharding.make_mesh`): -1 takes the devices the other axes leave.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data parallel: each device holds whole parameters (unless fsdp)
  c.mesh.fsdp = 1  # fully sharded: parameters and batch split over these devices
  c.mesh.tensor = 1  # tensor parallel: heads, MLP and vocabulary split
  c.mesh.expert = 1  # expert parallel (llada2): experts and the batch split over these devices
  # The rollouts' mesh over the same devices (e.g. tensor-parallel decoding while the update runs
  # FSDP): the weights are resharded onto it before each rollout. All 0: the training mesh.
  c.rollout_mesh = ml_collections.ConfigDict()
  c.rollout_mesh.data = 0
  c.rollout_mesh.fsdp = 0
  c.rollout_mesh.tensor = 0

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 50  # steps between checkpoints (and at the end of each stage)
  c.checkpoint.keep = 2  # the newest checkpoints kept; export --step=N needs N among them
  # The latest step fails to restore: True resumes from the previous complete step (the failed
  # one is renamed N.unreadable-<time>, and said); False stops naming the step and the cause.
  c.checkpoint.fallback = True
  c.log_every = 1  # steps between console progress lines (metrics.jsonl gets every step)
  return c


def config(family: str, preset: str = "tiny") -> ml_collections.ConfigDict:
  """`configs/<family>.py:<preset>`: `base_config(family)` with the preset applied, locked."""
  c = base_config(family)
  apply_preset(c, preset)
  c.lock()
  return c


def validate(c: ml_collections.ConfigDict) -> None:
  """Raise `ValueError` naming the first bad key and value among those no settings class owns
  (module docstring); nothing has run yet."""
  def bad(key: str, why: str):
    value = c
    for part in key.split("."):
      value = value[part]
    raise ValueError(f"config.{key}={value!r}: {why}")

  if c.family not in FAMILIES:
    bad("family", f"expected one of {', '.join(FAMILIES)}")
  for key in ("sft.steps", "rl.steps"):
    if c[key.split(".")[0]][key.split(".")[1]] < 0:
      bad(key, "must be >= 0")
  for key in ("checkpoint.every", "log_every", "eval.every", "eval.num_examples", "eval.batch_size",
              "checkpoint.keep", "task.max_prompt_len", "sft.check_every",
              "sft.validation_examples"):
    stage, name = key.split(".") if "." in key else (None, key)
    if (c[stage][name] if stage else c[name]) < 1:
      bad(key, "must be >= 1")
  for key in ("sft.lr", "rl.lr"):
    stage, name = key.split(".")
    if not c[stage][name] > 0 or not math.isfinite(c[stage][name]):
      bad(key, "must be a finite number > 0")
  if not 0 <= c.sft.stop_at_accuracy <= 1:
    bad("sft.stop_at_accuracy", "must be an accuracy in (0, 1], or 0 to run all sft.steps")
  for key in ("sft.patience", "sft.num_demonstrations"):
    if c.sft[key.split(".")[1]] < 0:
      bad(key, "must be >= 0 (0: off)")
  if c.sft.patience and c.sft.stop_at_accuracy:
    bad("sft.patience", f"excludes sft.stop_at_accuracy={c.sft.stop_at_accuracy} (one SFT stop "
        "rule): set one of them to 0")
  if c.sft.num_demonstrations and c.task.source == "generated" and (
      c.sft.num_demonstrations + c.sft.validation_examples > c.task.num_train):
    bad("sft.num_demonstrations", f"plus sft.validation_examples={c.sft.validation_examples} "
        f"exceeds task.num_train={c.task.num_train}: the validation examples must lie outside "
        "the demonstrations; raise task.num_train")
  if c.task.source == "generated" and c.eval.num_examples > c.task.num_test:
    bad("eval.num_examples", f"exceeds task.num_test={c.task.num_test}, the held-out examples "
        "generated; raise task.num_test too")
  if c.task.name == "sudoku":
    if not 1 <= c.task.blanks <= 12:
      bad("task.blanks", "a 4x4 Sudoku with a unique solution has 1 to 12 blanks")
    if not 0 <= c.task.sft_blanks <= 12:
      bad("task.sft_blanks", "expected 0 (= task.blanks) or 1 to 12")
    if not 0 <= c.task.sft_unfilled < 1:
      bad("task.sft_unfilled", "must lie in [0, 1)")
  if not c.model.checkpoint:  # a model built from these sizes (a checkpoint brings its own)
    for key in ("model.n_layers", "model.d_model", "model.n_heads", "model.n_kv_heads",
                "model.mlp_dim"):
      if c.model[key.split(".")[1]] < 1:
        bad(key, "must be >= 1")
    if c.model.d_model % c.model.n_heads:
      bad("model.d_model", f"must be a multiple of model.n_heads={c.model.n_heads}")
    if c.model.n_heads % c.model.n_kv_heads:
      bad("model.n_kv_heads", f"must divide model.n_heads={c.model.n_heads}")
  for key in ("model.param_dtype", "optim.moment_dtype"):
    if c[key.split(".")[0]][key.split(".")[1]] not in ("float32", "bfloat16"):
      bad(key, "expected float32 or bfloat16")
  for key in ("optim.offload_state", "optim.update_norms", "eval.fast"):
    if not isinstance(c[key.split(".")[0]][key.split(".")[1]], bool):
      bad(key, "expected True or False")
  if c.task.prompt_style not in ("compact", "plain"):
    bad("task.prompt_style", "expected 'compact' or 'plain'")
  if c.task.chat and c.model.tokenizer == "char":
    bad("task.chat", "the char tokenizer has no chat template")
  if c.model.tokenizer != "char" and not c.model.checkpoint:
    bad("model.tokenizer", "a Hugging Face tokenizer needs model.checkpoint")
  if c.model.checkpoint:
    if not storage.path(c.model.checkpoint).is_dir():
      bad("model.checkpoint", "no such directory")
  if c.task.source == "local":
    if not c.task.source_dir:
      bad("task.source_dir", "task.source='local' needs the folder of your data files "
          "(GSM8K: train.jsonl, test.jsonl); or set task.source=public to download GSM8K")
    if not storage.path(c.task.source_dir).is_dir():
      bad("task.source_dir", "no such directory (task.source='local' reads files from it)")
  elif c.task.source not in ("generated", "public"):
    bad("task.source", "expected 'generated', 'local' or 'public'")
  if storage.is_remote(c.task.data_dir):
    bad("task.data_dir", "must be on local disk or a shared file system (TFDS's array_record "
        "files cannot be written to a bucket; leave it empty for a local cache per process)")
  for name, weight in c.task.reward_weights.items():
    if not isinstance(weight, (int, float)):
      raise ValueError(f"config.task.reward_weights.{name}={weight!r}: must be a number")
