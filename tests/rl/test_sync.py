"""The weight sync (trace_jax/rl/sync.py): an engine's rollout weights are made once per
policy version per (QuantConfig, compute dtype), shared by the engines of that key, and made
only when an engine is about to run. Engines stand in here as counters of their syncs."""

import dataclasses

import numpy as np

from trace_jax.rl.sync import WeightSync
from trace_jax.rollout.config import RolloutConfig


@dataclasses.dataclass
class _Engine:
  """A rollout engine as the sync sees it: its config, and weights made by `sync`."""

  config: RolloutConfig
  made: list = dataclasses.field(default_factory=list)  # the policy versions it packed

  def __post_init__(self):
    self.graphdef, self.params = None, None

  def sync(self, policy):
    self.made.append(policy["version"])
    self.graphdef, self.params = "graph", {"packed": policy["version"], "by": id(self)}


def _engine(policy, **changes):
  engine = _Engine(RolloutConfig(**changes))
  engine.sync(policy)  # made from the policy, as RolloutEngine's constructor does
  return engine


def test_weights_are_made_once_per_version_and_key_and_shared():
  sync = WeightSync()
  policy = {"version": 0}
  rollout = sync.add(_engine(policy, guidance="compact"), 0)
  fp4_eval = sync.add(_engine(policy, guidance="none", record_routing=False), 0)
  bf16_eval = sync.add(_engine(policy, precision="bf16", guidance="none"), 0)
  # The FP4 rollout and the FP4 evaluation share a key (same QuantConfig and dtype): one
  # copy of version 0; the bf16 evaluation has its own.
  assert fp4_eval.params is rollout.params and bf16_eval.params is not rollout.params
  for version in (1, 2, 3):
    policy = {"version": version}
    assert sync(rollout, policy, version).params["packed"] == version  # about to run
    if version % 2 == 0:  # the evaluations run every other version
      for engine in (fp4_eval, bf16_eval):
        assert sync(engine, policy, version).params["packed"] == version
      assert fp4_eval.params is rollout.params  # taken, not packed again
    assert sync(rollout, policy, version) is rollout  # again at the same version: nothing
  # Each version's weights were packed once per key, and only where an engine ran.
  assert rollout.made == [0, 1, 2, 3] and fp4_eval.made == [0]
  assert bf16_eval.made == [0, 2]


def test_another_dtype_is_another_key():
  sync = WeightSync()
  policy = {"version": 5}
  bf16 = sync.add(_engine(policy), 5)
  f32 = sync.add(_engine(policy, compute_dtype="float32"), 5)
  assert WeightSync.key(bf16) != WeightSync.key(f32) and f32.params is not bf16.params
  sync(f32, {"version": 6}, 6)
  assert sync(bf16, {"version": 6}, 6).params["by"] == id(bf16)  # packed its own
  assert np.array_equal([bf16.made, f32.made], [[5, 6], [5, 6]])
