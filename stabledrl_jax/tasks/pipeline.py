"""Grain pipelines over task sources: deterministic, split between processes, checkpointable.

    source = datasets.load_source("sudoku", "train", data_dir=..., blanks=8)
    ds = prompt_batches(get_task("sudoku"), source, CharTokenizer(), batch_size=16, seed=0,
                        max_prompt_len=24)
    it = iter(ds)                      # a grain DatasetIterator
    batch = next(it)                   # {"prompt_ids_BxP", "prompt_mask_BxP", "examples"}
    state = it.get_state()             # save with the checkpoint; it.set_state(state) resumes

Every batch is a slice of one global batch sequence: the records are shuffled (per epoch, from
`seed`) and cut into batches of `batch_size` whatever the number of processes, and a process reads
only its rows `[start, stop)` of each (`rows=`, from `sharding.process_rows`). So processes read
disjoint records, and a run on `n` hosts sees the same global batches as a run on one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from stabledrl_jax.tasks import base
from stabledrl_jax.tasks.tokenizer import Tokenizer


def make_dataset(
    source: Sequence[Any],
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    rows: tuple[int, int] | None = None,
    drop_remainder: bool = True,
    batch_fn: Callable[[Sequence[Any]], Any] | None = None,
    num_threads: int = 2,
) -> grain.IterDataset:
  """(Shuffle per epoch) -> repeat -> global batches of `batch_size` -> this process's `rows`.

  `rows=(start, stop)`: the rows of every global batch this process reads (default: all of them).
  `num_epochs=None` repeats forever.
  """
  ds = grain.MapDataset.source(source)
  if len(ds) < batch_size and drop_remainder:
    raise ValueError(f"source has {len(ds)} examples, fewer than one batch of {batch_size}")
  if shuffle:
    # A fresh permutation each epoch, all derived from `seed`.
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)
  start, stop = (0, batch_size) if rows is None else rows
  if not 0 <= start < stop <= batch_size:
    raise ValueError(f"rows {rows} are not a slice of a batch of {batch_size}")
  if (start, stop) != (0, batch_size):
    if not drop_remainder:
      raise ValueError("reading part of each batch (rows=...) needs drop_remainder=True")
    every, full, local = ds, batch_size, stop - start
    ds = grain.MapDataset.range(len(every) // full * local).map(
        lambda j: every[j // local * full + start + j % local])
    batch_size = local
  ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=batch_fn or list)
  return ds.to_iter_dataset(
      grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=2 * num_threads)
  )


def prompt_text(
    task: base.Task,
    example: base.Example,
    *,
    style: str = "compact",
    chat_tokenizer: base.ChatTokenizer | None = None,
) -> str:
  """The prompt string: compact/plain text, or the plain prompt through a chat template."""
  if chat_tokenizer is not None:
    return task.chat_prompt(example, chat_tokenizer)
  return task.prompt(example, style)


def encode_prompts(
    task: base.Task,
    examples: Sequence[base.Example],
    tokenizer: Tokenizer,
    *,
    max_prompt_len: int,
    style: str = "compact",
    chat: bool = False,
    add_bos: bool = True,
) -> dict[str, Any]:
  """Left-padded prompt ids `[B, L]` with a mask, plus the examples themselves for grading.

  Left padding keeps every prompt ending at the same position, where generation starts.
  A prompt longer than `max_prompt_len` is an error rather than silently truncated.
  """
  ids_BxL = np.full((len(examples), max_prompt_len), tokenizer.pad_id, dtype=np.int32)
  mask_BxL = np.zeros((len(examples), max_prompt_len), dtype=bool)
  for b, example in enumerate(examples):
    text = prompt_text(task, example, style=style, chat_tokenizer=tokenizer if chat else None)
    ids = tokenizer.encode(text)
    # Chat templates write their own bos. A raw prompt gets the tokenizer's bos, if it has one:
    # LLaDA's and Dream's raw-prompt evaluations prepend it (Fast-dLLM's Dream GSM8K commands set
    # add_bos_token=true, which prepends `tokenizer.bos_token`).
    if add_bos and not chat and tokenizer.bos_id >= 0:
      ids = [tokenizer.bos_id, *ids]
    if len(ids) > max_prompt_len:
      raise ValueError(
          f"{task.name} prompt of {len(ids)} tokens exceeds "
          f"max_prompt_len={max_prompt_len}: {text[:80]!r}"
      )
    ids_BxL[b, max_prompt_len - len(ids) :] = ids
    mask_BxL[b, max_prompt_len - len(ids) :] = True
  return {"prompt_ids_BxP": ids_BxL, "prompt_mask_BxP": mask_BxL, "examples": list(examples)}


def prompt_batches(
    task: base.Task,
    source: Sequence[base.Example],
    tokenizer: Tokenizer,
    *,
    batch_size: int,
    seed: int,
    max_prompt_len: int,
    style: str = "compact",
    chat: bool = False,
    **kwargs: Any,
) -> grain.IterDataset:
  """Batches of encoded prompts (see `encode_prompts`) over `source`; kwargs: `make_dataset`."""

  def batch_fn(examples: Sequence[base.Example]) -> dict[str, Any]:
    return encode_prompts(
        task, examples, tokenizer, max_prompt_len=max_prompt_len, style=style, chat=chat
    )

  return make_dataset(source, batch_size=batch_size, seed=seed, batch_fn=batch_fn, **kwargs)


def decode_completions(
    tokenizer: Tokenizer, ids_BxL: np.ndarray, stop_ids: Sequence[int] = ()
) -> list[str]:
  """Decoded completions, each cut at its first eos (or any of `stop_ids`, e.g. LLaDA's
  `<|eot_id|>`): what a model writes after ending its turn is not part of its answer."""
  stops = {int(tokenizer.eos_id), *map(int, stop_ids)}
  texts = []
  for row in np.asarray(ids_BxL):
    ends = [i for i, t in enumerate(row.tolist()) if t in stops]
    texts.append(tokenizer.decode(row[: ends[0]] if ends else row))
  return texts
