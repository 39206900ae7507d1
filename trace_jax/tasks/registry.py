"""Task registry: `get_task(name, **options)`."""

from __future__ import annotations

from typing import Callable

from trace_jax.tasks.arithmetic import Arithmetic
from trace_jax.tasks.base import Task
from trace_jax.tasks.coding import Coding
from trace_jax.tasks.search import Search

_REGISTRY: dict[str, Callable[..., Task]] = {
    "arith": Arithmetic,  # reasoning
    "coding": Coding,  # coding
    "search": Search,  # long-horizon, multi-turn
}


def register(name: str, factory: Callable[..., Task]) -> None:
  _REGISTRY[name] = factory


def registered() -> list[str]:
  return sorted(_REGISTRY) + ["rg:<reasoning-gym task>"]


def get_task(name: str, **options) -> Task:
  """A task by name, e.g. get_task("arith", terms=3)."""
  if name.startswith("rg:"):
    from trace_jax.tasks.reasoning_gym import ReasoningGymTask
    return ReasoningGymTask(name[3:], **options)
  if name not in _REGISTRY:
    raise ValueError(f"task={name!r} is not registered; registered tasks: {registered()}")
  return _REGISTRY[name](**options)
