"""The Task interface: prompts, answer extraction, named rewards and their weighted sum.

An `example` is a plain dict (see each task module for its keys); a completion is the decoded
model output after the prompt. Rewards are pure functions `(completion, example) -> float` in
[0, 1], checked where they are computed (`WeightedReward`) and once before training
(`check_reward`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
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

  def reward_fn(self, weights: Mapping[str, float] | None = None,
                on_invalid: str = "error") -> WeightedReward:
    """A weighted sum of named rewards (none given: the task's `default_weights`), each checked
    (`WeightedReward`); unknown names fail here, at config time."""
    weights = dict(weights or self.default_weights)
    return weighted_reward(self.rewards, weights, task=self.name, on_invalid=on_invalid)

  def reward(
      self, completion: str, example: Example, weights: Mapping[str, float] | None = None
  ) -> float:
    return self.reward_fn(weights)(completion, example)


INVALID_REWARD = ("error", "clip")  # config.task.invalid_reward
# Completions a reward function must grade without raising (`check_reward`).
MALFORMED_COMPLETIONS = ("", "<answer></answer>", "<reasoning>\n</reasoning>\n<answer>?</answer>",
                         "<answer>" * 3, "\ufffd\x00 #### ", "9" * 400)


class RewardError(ValueError):
  """A reward that raised, or gave a non-number, or (task.invalid_reward=error) a non-finite or
  out-of-range value; names the task, reward, example and completion."""


def _short(value: Any, limit: int = 120) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


class WeightedReward:
  """`sum(weight * reward(completion, example))` over the chosen named rewards, each checked where
  it is computed: a reward that raises or is not a real number is a `RewardError`; one that is
  non-finite or outside [0, 1] is one too (`on_invalid="error"`), or is clipped to [0, 1] (NaN to
  0) and counted in `invalid` (`on_invalid="clip"`)."""

  def __init__(self, available: Mapping[str, RewardFn], weights: Mapping[str, float], *,
               task: str = "", on_invalid: str = "error"):
    unknown = sorted(set(weights) - set(available))
    if unknown:
      raise KeyError(f"unknown reward(s) {unknown}; available: {sorted(available)}")
    if on_invalid not in INVALID_REWARD:
      raise ValueError(f"config.task.invalid_reward={on_invalid!r}: expected one of "
                       f"{INVALID_REWARD}")
    self.chosen = [(name, available[name], float(w)) for name, w in weights.items() if w != 0.0]
    self.task, self.on_invalid = task, on_invalid
    self.invalid = 0  # values clipped so far (on_invalid="clip")

  def __call__(self, completion: str, example: Example) -> float:
    return sum(w * self.checked(name, fn, completion, example) for name, fn, w in self.chosen)

  def checked(self, name: str, fn: RewardFn, completion: str, example: Example) -> float:
    where = (f"task {self.task!r}, reward {name!r}, example {_short(dict(example))}, completion "
             f"{_short(completion)}")
    try:
      value = fn(completion, example)
    except Exception as e:  # a user's checker: any failure, named with what it was grading
      raise RewardError(f"{where}: raised {type(e).__name__}: {e}") from e
    if not isinstance(value, numbers.Real):
      raise RewardError(f"{where}: returned {_short(value)}, not a number")
    value = float(value)
    if math.isfinite(value) and 0.0 <= value <= 1.0:
      return value
    if self.on_invalid == "clip":
      self.invalid += 1
      return 0.0 if math.isnan(value) else min(max(value, 0.0), 1.0)
    raise RewardError(f"{where}: returned {value!r}, outside [0, 1] (config.task.invalid_reward="
                      "'clip' clips such values and counts them)")


def weighted_reward(available: Mapping[str, RewardFn], weights: Mapping[str, float], *,
                    task: str = "", on_invalid: str = "error") -> WeightedReward:
  return WeightedReward(available, weights, task=task, on_invalid=on_invalid)


def check_reward(task: Task, reward_fn: RewardFn, examples: Sequence[Example]) -> tuple[int, int]:
  """Grade each example's reference completion and `MALFORMED_COMPLETIONS` once, before anything
  runs: a reward (or `is_correct`) that raises or returns a non-number fails here, with a
  `RewardError` naming the example and completion. Returns (references graded correct, graded)."""
  correct = graded = 0
  for example in examples:
    reference = task.reference_completion(example) if task.reference_completion else None
    for completion in ((reference,) if reference is not None else ()) + MALFORMED_COMPLETIONS:
      reward_fn(completion, example)
      try:
        ok = bool(task.is_correct(completion, example))
      except Exception as e:
        raise RewardError(f"task {task.name!r}, is_correct, example {_short(dict(example))}, "
                          f"completion {_short(completion)}: raised {type(e).__name__}: {e}") from e
      if completion is reference:
        correct, graded = correct + ok, graded + 1
  return correct, graded
