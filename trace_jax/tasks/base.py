"""The task interface: sample items, score completions, and (multi-turn) step an environment."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Item:
  """One problem.

  Attributes:
    prompt: the text the policy sees first.
    target: what the scorer needs (the answer, hidden tests, the secret...).
    demonstration: a solver's completion that scores 1.0 (single-turn), or for multi-turn
      tasks the solver's actions, one string per turn.
    meta: anything else (difficulty, seed).
  """

  prompt: str
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

  @abc.abstractmethod
  def sample(self, seed: int, n: int, split: str = "train") -> list[Item]:
    """n items, a deterministic function of the seed and the split.

    split: "train" (what SFT and RL draw) or "eval" (the evaluation problems). A task may
    hold a share of its problems out of "train" (`Arithmetic(eval_share=...)`); one whose
    problem space is vast (coding, search) keeps the splits apart by seed only.
    """

  @abc.abstractmethod
  def score(self, item: Item, completion: str) -> float:
    """Reward in [0, 1]; never raises, whatever the completion."""

  def reset(self, item: Item) -> Any:
    """Initial environment state of a multi-turn episode."""
    raise TypeError(f"task {self.name!r} is single-turn: it has no environment to reset")

  def step(self, state: Any, action: str) -> tuple[Any, EnvStep]:
    """Apply one action; return the new state and what the policy sees next."""
    raise TypeError(f"task {self.name!r} is single-turn: it has no environment to step")
