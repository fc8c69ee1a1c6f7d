"""The Task interface: prompts, answer extraction, named rewards and their weighted sum.

An `example` is a plain dict (see each task module for its keys); a completion is the decoded
model output after the prompt. Rewards are pure functions `(completion, example) -> float`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from stabledrl_jax.tasks import extract

Example = Mapping[str, Any]
RewardFn = Callable[[str, Example], float]

# Prompt styles: `plain` is natural-language text for pretrained models (raw or through a chat
# template); `compact` is a short, fixed-vocabulary form for the tiny models' character tokenizer.
PROMPT_STYLES = ("plain", "compact")

FORMAT_INSTRUCTION = (
    "Think it through inside <reasoning> </reasoning> tags, then give only the final answer "
    "inside <answer> </answer> tags."
)


class ChatTokenizer(Protocol):

  def apply_chat_template(
      self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
  ) -> str:
    ...


def format_reward(completion: str, example: Example) -> float:
  """1.0 when the completion closes `</reasoning>` and then gives a closed `<answer>` tag."""
  del example
  return 1.0 if extract.has_answer_format(completion) else 0.0


def answer_tag_reward(completion: str, example: Example) -> float:
  """1.0 when a non-empty `<answer>` tag is present (a weaker, easier format signal)."""
  del example
  return 1.0 if extract.last_answer_tag(completion) else 0.0


MODULE_FUNCTIONS = ("question", "compact_question", "extract_answer", "correctness", "is_correct",
                    "reference_completion")


@dataclasses.dataclass(frozen=True)
class Task:
  """One task: how to ask, how to read the answer, how to score it."""

  name: str
  question: Callable[[Example], str]  # the problem statement in words, no format instruction
  compact_question: Callable[[Example], str]  # the tiny-model prompt (character vocabulary)
  extract_answer: Callable[[str], Any]  # completion -> parsed answer (None when absent)
  correctness: RewardFn  # task score in [0, 1] (partial credit where the task defines it)
  is_correct: Callable[[str, Example], bool]
  reference_completion: Callable[[Example], str] | None = None  # SFT target, where known
  # A (weaker) demonstrator: (example, numpy Generator) -> the SFT target drawn for it; None =
  # `reference_completion`.
  demonstrate: Callable[[Example, Any], str] | None = None
  extra_rewards: Mapping[str, RewardFn] = dataclasses.field(default_factory=dict)
  default_weights: Mapping[str, float] = dataclasses.field(
      default_factory=lambda: {"correctness": 1.0}
  )
  # Data of tasks defined outside the package (built-in tasks have theirs in `datasets`):
  # `generate(split, n, seed)` -> n examples of "train" or "test" (task.source='generated');
  # `from_record(record)` -> the example of one JSONL record (task.source='local'; default: as is).
  generate: Callable[[str, int, int], Sequence[Example]] | None = None
  from_record: Callable[[dict], Example] | None = None

  @classmethod
  def of_module(cls, name: str, module: Any, **fields: Any) -> Task:
    """The task a module defines by functions named as this class's fields (`question`,
    `compact_question`, `extract_answer`, `correctness`, `is_correct`, `reference_completion`),
    with `fields` set explicitly (e.g. `extra_rewards`)."""
    found = {f: getattr(module, f) for f in MODULE_FUNCTIONS if hasattr(module, f)}
    return cls(name=name, **found, **fields)

  @property
  def rewards(self) -> dict[str, RewardFn]:
    """Every named reward this task offers; configs pick and weight them by name."""
    return {
        "correctness": self.correctness,
        "format": format_reward,
        "answer_tag": answer_tag_reward,
        **self.extra_rewards,
    }

  def prompt(self, example: Example, style: str = "plain") -> str:
    if style == "plain":
      return f"{self.question(example)}\n{FORMAT_INSTRUCTION}"
    if style == "compact":
      return self.compact_question(example)
    raise ValueError(f"unknown prompt style {style!r}; expected one of {PROMPT_STYLES}")

  def messages(self, example: Example) -> list[dict[str, str]]:
    return [{"role": "user", "content": self.prompt(example, "plain")}]

  def chat_prompt(self, example: Example, tokenizer: ChatTokenizer) -> str:
    """The plain prompt through an instruct model's chat template, ready to generate from."""
    return tokenizer.apply_chat_template(self.messages(example), add_generation_prompt=True)

  def reward_fn(self, weights: Mapping[str, float] | None = None) -> RewardFn:
    """A weighted sum of named rewards (none given: the task's `default_weights`); unknown names
    fail here, at config time."""
    weights = dict(weights or self.default_weights)
    return weighted_reward(self.rewards, weights)

  def reward(
      self, completion: str, example: Example, weights: Mapping[str, float] | None = None
  ) -> float:
    return self.reward_fn(weights)(completion, example)


def weighted_reward(available: Mapping[str, RewardFn], weights: Mapping[str, float]) -> RewardFn:
  unknown = sorted(set(weights) - set(available))
  if unknown:
    raise KeyError(f"unknown reward(s) {unknown}; available: {sorted(available)}")
  chosen = [(available[name], float(w)) for name, w in weights.items() if w != 0.0]

  def reward(completion: str, example: Example) -> float:
    return sum(w * fn(completion, example) for fn, w in chosen)

  return reward
