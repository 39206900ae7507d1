"""Glue between tasks (text) and the policy (token ids): prompts and SFT demonstrations."""

from __future__ import annotations

from typing import Sequence

from trace_jax.tasks.base import Item, Task, prompt_text
from trace_jax.tasks.tokenizer import Tokenizer


def prompt_ids(tokenizer: Tokenizer, item: Item) -> list[int]:
  """<bos> + the prompt text (characters the tokenizer lacks become '?'; a conversation's
  contents joined, `tasks.base.prompt_text`); a checkpoint's tokenizer renders it itself
  (its chat template: `tasks.chat.CheckpointTokenizer`)."""
  if hasattr(tokenizer, "prompt_ids"):
    return tokenizer.prompt_ids(item.prompt)
  return [tokenizer.bos_id] + tokenizer.encode(prompt_text(item.prompt), errors="replace")


def observation_ids(tokenizer: Tokenizer, text: str, turn_closed: bool = True) -> list[int]:
  """An environment observation, wrapped in <obs> ... </obs> when the tokenizer has them; a
  checkpoint's tokenizer renders it as the chat template's user or tool turn (`turn_closed`:
  the policy's last action ended with a stop token, so the turn needs no closing)."""
  if hasattr(tokenizer, "observation_ids"):
    return tokenizer.observation_ids(text, turn_closed=turn_closed)
  ids = tokenizer.encode(text, errors="replace")
  if hasattr(tokenizer, "obs_id"):
    return [tokenizer.obs_id] + ids + [tokenizer.obs_end_id]
  return ids


def demonstration_pairs(
  task: Task, tokenizer: Tokenizer, seed: int, n: int
) -> list[tuple[list[int], list[int]]]:
  """(prompt ids, completion ids) of n solver demonstrations, for SFT.

  Single-turn: the completion is the demonstration + <eos>. Multi-turn: the solver's episode
  is played through the task's environment and flattened into one sequence of actions
  (each ending in <eos>) and observations; the loss mask of `sft_batch` covers it all, so
  observations are learned too (cheap, and harmless for a warm start).
  """
  pairs = []
  for item in task.sample(seed, n):
    prompt = prompt_ids(tokenizer, item)
    if not task.multi_turn:
      pairs.append(
        (prompt, tokenizer.encode(item.demonstration, errors="replace") + [tokenizer.eos_id])
      )
      continue
    completion, state = [], task.reset(item)
    for action in item.demonstration:
      completion += tokenizer.encode(action) + [tokenizer.eos_id]
      state, step = task.step(state, action)
      if step.done:
        break
      completion += observation_ids(tokenizer, step.observation)
    pairs.append((prompt, completion))
  return pairs


def decode_responses(tokenizer: Tokenizer, responses: Sequence[Sequence[int]]) -> list[str]:
  return [tokenizer.decode(r) for r in responses]


def eval_seed(seed: int) -> int:
  """The seed of a run's fixed evaluation problems (RL and SFT share it, so their
  evaluations score the same problems), apart from every training step's problems."""
  return 10_007 * seed + 999_983
