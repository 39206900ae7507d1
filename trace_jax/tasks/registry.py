"""Task registry: `get_task(name, **options)`."""

from __future__ import annotations

import inspect
from typing import Callable

from trace_jax.tasks.arithmetic import Arithmetic, ArithmeticChain, FlawedChain
from trace_jax.tasks.base import Task
from trace_jax.tasks.coding import Coding
from trace_jax.tasks.search import Search

_REGISTRY: dict[str, Callable[..., Task]] = {
  "arith": Arithmetic,  # reasoning
  "chain": ArithmeticChain,  # reasoning: arith's 4-term chains, held-out evaluation
  "chain_flawed": FlawedChain,  # the main job's: chain taught by a flawed teacher
  "coding": Coding,  # coding
  "search": Search,  # long-horizon, multi-turn
}


def register(name: str, factory: Callable[..., Task]) -> None:
  _REGISTRY[name] = factory


def registered() -> list[str]:
  return sorted(_REGISTRY) + ["rg:<reasoning-gym task>", "dataset:<path>"]


def get_task(name: str, **options) -> Task:
  """A task by name, e.g. get_task("arith", terms=3), get_task("dataset:train.jsonl")."""
  if name.startswith("dataset:"):
    from trace_jax.tasks.dataset import DatasetTask

    if "path" in options:
      raise ValueError(f"task {name!r}: the file is named by the task (dataset:PATH), not path=")
    _check_option_names(name, DatasetTask, options)
    return DatasetTask(name[len("dataset:") :], **options)
  if name.startswith("rg:"):
    from trace_jax.tasks.reasoning_gym import ReasoningGymTask

    return ReasoningGymTask(name[3:], **options)
  if name not in _REGISTRY:
    raise ValueError(f"task={name!r} is not registered; registered tasks: {registered()}")
  _check_option_names(name, _REGISTRY[name], options)
  return _REGISTRY[name](**options)


def _check_option_names(name: str, factory: Callable[..., Task], options: dict) -> None:
  """A ValueError naming unknown options and the known ones (a TypeError would not say)."""
  params = inspect.signature(factory).parameters
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return
  unknown = sorted(set(options) - set(params))
  if unknown:
    known = ", ".join(
      f"{k}={p.default!r}" for k, p in params.items() if p.default is not inspect.Parameter.empty
    )
    raise ValueError(
      f"task {name!r} has no option {', '.join(map(repr, unknown))}; its options "
      f"(with defaults): {known or 'none'}"
    )
