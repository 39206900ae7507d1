"""Weight sync: the rollout weights an engine runs with, made from the policy once per policy
version per (QuantConfig, compute dtype) and shared by every engine with that key.

The weights are a deterministic function of the policy's master weights, the rollout's
QuantConfig and its compute dtype, so engines with the same key (the arm's FP4 rollout and
the FP4 evaluation) hold the same arrays, packed once. An engine is synced only when it is
about to run: evaluation engines that run every `eval_every` steps sync only then. The
version is an int that advances at each update (`RLState.version`); an asynchronous loop can
keep older versions' weights by the same key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trace_jax.rollout.engine import RolloutEngine


@dataclasses.dataclass(frozen=True)
class _Weights:
  version: int  # the policy version they were made from
  graphdef: Any
  params: Any  # packed FP4 (or compute-dtype) rollout weights


class WeightSync:
  """The newest rollout weights per (QuantConfig, compute dtype)."""

  def __init__(self):
    self._made: dict[tuple, _Weights] = {}

  @staticmethod
  def key(engine: RolloutEngine) -> tuple:
    return (engine.config.quant, engine.config.compute_dtype)

  def add(self, engine: RolloutEngine, version: int) -> RolloutEngine:
    """Register `engine`, just made from the policy at `version` (it holds that version's
    weights); it takes the shared copy if one of that version exists."""
    made = self._made.get(self.key(engine))
    if made is not None and made.version == version:
      engine.graphdef, engine.params = made.graphdef, made.params
    else:
      self._made[self.key(engine)] = _Weights(version, engine.graphdef, engine.params)
    return engine

  def __call__(self, engine: RolloutEngine, policy, version: int) -> RolloutEngine:
    """`engine` holding the rollout weights of `policy` at `version`: made now if no engine
    of its key holds them yet, else shared."""
    made = self._made.get(self.key(engine))
    if made is None or made.version != version:
      engine.sync(policy)
      self._made[self.key(engine)] = _Weights(version, engine.graphdef, engine.params)
    elif engine.params is not made.params:
      engine.graphdef, engine.params = made.graphdef, made.params
    return engine
