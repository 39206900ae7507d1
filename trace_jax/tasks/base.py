"""The task interface: sample items, score completions, and (multi-turn) step an environment."""

from __future__ import annotations

import abc
import random
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Item:
  """One problem.

  Attributes:
    prompt: the text the policy sees first, or a conversation: a tuple of {role, content}
      messages (a `dataset:` file's), which a chat template renders as it is and a raw
      prompt reads as its contents joined (`prompt_text`).
    target: what the scorer needs (the answer, hidden tests, the secret...).
    demonstration: a solver's completion that scores 1.0 (single-turn), or for multi-turn
      tasks the solver's actions, one string per turn; a task may teach a flawed solver's
      instead (`arith`'s `flawed_facts`: the score still checks the true answer).
    meta: anything else (difficulty, seed).
  """

  prompt: str | tuple[dict, ...]
  target: Any
  demonstration: Any
  meta: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class EnvStep:
  """What a multi-turn environment returns after an action."""

  observation: str  # shown to the policy before its next action ("" when done)
  done: bool
  reward: float  # the episode's reward once done (0 before)


SPLITS = ("train", "eval")
MAX_LISTED = 20_000  # a split with at most this many problems is evaluated whole


def prompt_text(prompt) -> str:
  """A prompt as plain text: a string as it is; a conversation's message contents, one
  message a line."""
  if isinstance(prompt, str):
    return prompt
  return "\n".join(str(message["content"]) for message in prompt)


def check_split(task: "Task", split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"task {task.name!r}: split={split!r} is not one of {SPLITS}")


class Task(abc.ABC):
  """Single-turn tasks implement `sample` and `score`; multi-turn tasks also set
  `multi_turn = True` and implement `reset` and `step`."""

  name: str = "task"
  kind: str = "reasoning"  # "reasoning", "coding" or "long-horizon"
  multi_turn: bool = False
  max_turns: int = 1
  # whether items carry demonstrations for the SFT warm start (a run without skips it)
  has_demonstrations: bool = True

  @abc.abstractmethod
  def sample(self, seed: int, n: int, split: str = "train") -> list[Item]:
    """n items, a deterministic function of the seed and the split.

    split: "train" (what SFT and RL draw) or "eval" (the evaluation problems). A task may
    hold a share of its problems out of "train" (`Arithmetic(eval_share=...)`); one whose
    problem space is vast (coding, search) keeps the splits apart by seed only.
    """

  def problems(self, split: str) -> list[Item] | None:
    """Every problem of a split, in a fixed order, where the split is small enough to list
    (`MAX_LISTED` at most); None for a task whose problem space is vast."""
    del split
    return None

  def evaluation_items(self, seed: int, n: int) -> list[Item]:
    """The evaluation's problems, `n` at most and each once (no replacement): a held-out
    split the task can list (`problems("eval")`) whole when `n` covers it, else `n` of it
    chosen with the seed; a vast problem space's `n` distinct problems drawn with the seed.

    Drawing with replacement repeats problems (128 draws from 324 held-out problems hold
    about 105 distinct ones): a repeat adds no information and makes the standard error
    look smaller than it is. `n` = 0: no evaluation.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
      raise ValueError(f"task {self.name!r}: evaluation size n={n!r} must be an int >= 0")
    if n == 0:
      return []
    listed = self.problems("eval")
    if listed is not None:
      if n >= len(listed):
        return listed
      chosen = sorted(random.Random(f"{self.name}:eval:{seed}").sample(range(len(listed)), n))
      return [listed[i] for i in chosen]
    items, seen, draws = [], set(), 0
    while len(items) < n:
      draws += 1
      if draws > 64:
        raise ValueError(
          f"task {self.name!r}: {n} distinct evaluation problems not found in "
          f"{draws - 1} draws of {n} ({len(items)} found); ask for fewer"
        )
      # the first draw is `seed`'s own problems; more only to replace repeats
      for item in self.sample(seed + (draws - 1) * 1_000_003, n, split="eval"):
        # a problem is its prompt and target (a multi-turn task's prompt may be the same
        # for every secret)
        key = (repr(item.prompt), repr(item.target))  # a conversation is a tuple of dicts
        if key not in seen and len(items) < n:
          seen.add(key)
          items.append(item)
    return items

  def prompt_probe(self) -> list[Item]:
    """The problems whose prompts size a run's episodes (the longest of them sets the cache):
    the first 64 training problems; a task whose prompts vary more returns its longest."""
    return self.sample(0, 64)

  def origin(self, item: Item) -> str:
    """Where one of the task's problems comes from, for a message about it (a file's task
    names the file and the row)."""
    del item
    return f"a problem of task {self.name!r}"

  @abc.abstractmethod
  def score(self, item: Item, completion: str) -> float:
    """Reward in [0, 1]; never raises, whatever the completion."""

  def reset(self, item: Item) -> Any:
    """Initial environment state of a multi-turn episode."""
    raise TypeError(f"task {self.name!r} is single-turn: it has no environment to reset")

  def step(self, state: Any, action: str) -> tuple[Any, EnvStep]:
    """Apply one action; return the new state and what the policy sees next."""
    raise TypeError(f"task {self.name!r} is single-turn: it has no environment to step")
