"""Device groups across processes (`jax.distributed`): the rollout group is one whole process
(the job's first N devices, `async_rollouts.group_role`) and the learner's mesh the next
process's devices. Each process runs one side only, in its main thread, so every device
program of a group is issued by that group's process alone:

1. The rollout processes run `RolloutServer`: batch j, with the weights of version
   max(0, j - k) (fixed lag, as in one process), for j from the learner's start version to
   the run's steps. The learner's processes run the trainer with `RemoteRollouts` in place
   of the worker. The two sides meet only through `GroupLink`, messages in
   `jax.distributed`'s key-value store under fixed names: the learner sends "weights/V"
   (version V's rollout weights, made on its mesh, as numpy) for every version a batch
   needs, the rollout side sends "batch/J" (`rl.step.on_host`), which the learner places
   on its mesh (`rl.step.on_mesh`). No collective spans both groups, so neither side's
   programs wait on the other's; the weights of version j - k exist only after the learner
   received batch j - k - 1, so at most k + 1 batches are in flight.
2. Every wait for the other side has a timeout (Schedule.rollout_timeout) and ends at once
   when the other side says it failed ("failed", its one line); each process logs that one
   line and stops. The learner's first process writes the run's files
   (`utils.distributed.set_main_process`); the run keeps no checkpoints and makes no warm
   start (`async_rollouts.check_across_processes`).
3. A run is reproducible bit for bit (a batch depends only on the seed, the step and the
   version's weights). Against one process with the same groups the rewards and version
   gaps are the same and the update agrees to float rounding only: with gloo the learner's
   all-reduces over its own devices sum in another order
   (tests/run/test_device_groups_processes.py).

The messages go through host memory: right for CPU hosts and small policies; a
device-to-device transfer between the groups' hosts is what large policies need.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time

import jax
import numpy as np
from flax import nnx
from jax.errors import JaxRuntimeError

from trace_jax.model import sharding as sharding_lib
from trace_jax.model.sharding import make_mesh
from trace_jax.rl import step as step_lib
from trace_jax.rl.pipeline import PipelinedRollout, RolloutWorkerError, WeightRing, schedule_version
from trace_jax.rl.step import StepSpec
from trace_jax.rollout.engine import RolloutEngine
from trace_jax.run.async_rollouts import AsyncRollouts, copy_state, device_ids, slot_names

_KEYS = "trace_jax/rl/device_groups"
_POLL_MS = 200  # how often a wait for the other side rechecks whether it failed


class LearnerError(RuntimeError):
  """The learner's side of a run with device groups across processes failed or stopped."""


class GroupLink:
  """The messages between the two sides of a run with device groups across processes:
  pickled values under fixed names ("weights/V", "batch/J", "done", "failed") in
  `jax.distributed`'s key-value store, so no device program of one group ever waits for
  the other's processes. Every wait has a timeout and ends at once when the other side says
  it failed ("failed": its one line).

  Args:
    timeout: seconds any wait for the other side lasts before the run stops.
  """

  def __init__(self, timeout: float):
    from jax._src import distributed as jax_distributed  # the job's coordination client

    self.client, self.timeout = jax_distributed.global_state.client, timeout
    if self.client is None:
      raise ValueError("device groups across processes need jax.distributed initialized")

  def send(self, name: str, value) -> None:
    self.client.key_value_set_bytes(f"{_KEYS}/{name}", pickle.dumps(value, protocol=5))

  def delete(self, name: str) -> None:
    self.client.key_value_delete(f"{_KEYS}/{name}")

  def failure(self) -> str | None:
    """The other side's line, if it said it failed."""
    try:
      return self.client.key_value_try_get(f"{_KEYS}/failed")
    except JaxRuntimeError:  # not set
      return None

  def fail(self, line: str) -> None:
    """Say this side failed (the first line said stays)."""
    try:
      self.client.key_value_set(f"{_KEYS}/failed", line)
    except JaxRuntimeError:  # the other side said so first
      pass

  def receive(self, name: str, *, waiting: str, error, timeout: float | None = None):
    """The value sent as `name`: raises `error(the other side's line)` if it failed first, a
    TimeoutError (said to the other side too) after `timeout` seconds (default the link's);
    `waiting` names the wait in that line, and in the error of a coordination service that
    failed under it."""
    timeout = self.timeout if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
      line = self.failure()
      if line is not None:
        raise error(line)
      try:
        data = self.client.blocking_key_value_get_bytes(f"{_KEYS}/{name}", _POLL_MS)
        return pickle.loads(data)
      except JaxRuntimeError as e:  # a deadline: the other side is still working
        if "DEADLINE_EXCEEDED" not in str(e):
          first = str(e).splitlines()[0] if str(e) else type(e).__name__
          raise error(f"{waiting}: the job's coordination service failed: {first}") from e
      if time.monotonic() > deadline:
        line = f"{waiting} within {timeout:g} s; the run stops"
        self.fail(line)
        raise TimeoutError(line)


def weights_needed(version: int, max_staleness: int, steps: int) -> bool:
  """Whether a batch below `steps` is generated with `version` (fixed lag, max(0, j - k))."""
  return version == 0 or version + max_staleness < steps


def to_host(tree):
  """`tree`'s arrays as numpy (the same bits): what `GroupLink` sends."""
  return jax.tree.map(np.asarray, tree)


class RemoteRollouts(AsyncRollouts):
  """The learner's side of device groups across processes (the trainer's `AsyncRollouts`):
  it publishes each needed version's rollout weights (`quantize_params` on the learner's
  mesh, `RolloutEngine.weights`) as "weights/V" and receives batch j as "batch/J" from the
  rollout processes' `RolloutServer`; its master ring is `AsyncRollouts`'."""

  def __init__(
    self,
    spec: StepSpec,
    policy,
    version,
    slots,
    rollout_config,
    task,
    tokenizer,
    *,
    groups,
    timeout: float,
  ):
    k = spec.config.schedule.max_staleness
    self.spec, self.task, self.tokenizer = spec, task, tokenizer
    self.stop_batch, self.groups, self.timeout = spec.config.schedule.steps, groups, timeout
    self.graphdef = nnx.graphdef(policy)
    self.ring = WeightRing(max_staleness=k)
    names = slot_names(k)
    for v in range(max(0, version - k), version):
      self.ring.put(v, slots[names[v - (version - k)]])
    self.ring.put(version, copy_state(policy))
    # the learner's engine: it makes the rollout weights on the learner's mesh
    self.engine = RolloutEngine(policy, rollout_config, mesh=spec.mesh)
    self.link, self.publish_seconds, self.worker = GroupLink(timeout), None, None
    self._next_batch, self._closed = version, False
    self._finished = version >= self.stop_batch  # (a run of 0 steps has nothing to train)
    self.link.send("start", version)
    for v in self.ring.versions:
      if v >= max(0, version - k) and weights_needed(v, k, self.stop_batch):
        self._send_weights(v, self.policy_at(v))

  def _send_weights(self, version: int, policy) -> None:
    start = time.time()
    weights = to_host(self.engine.weights(policy)[1])
    self.publish_seconds = time.time() - start
    self.link.send(f"weights/{version}", weights)

  def next(self) -> PipelinedRollout:
    j = self._next_batch
    where = device_ids(self.groups[0])
    version, collected, seconds, waited = self.link.receive(
      f"batch/{j}",
      waiting=f"rollout worker (devices {where}): no batch for step {j + 1}",
      error=RolloutWorkerError,
    )
    self.link.delete(f"batch/{j}")
    self._next_batch = j + 1
    return PipelinedRollout(j, version, j - version, (collected, seconds), waited)

  def receive(self, version: int) -> tuple:
    try:
      return super().receive(version)
    except (RolloutWorkerError, TimeoutError) as error:  # the rollout side's line, or the wait's
      logging.error("%s", error)
      raise

  def publish(self, policy) -> int:
    version = self.ring.latest_version + 1
    k = self.spec.config.schedule.max_staleness
    if weights_needed(version, k, self.stop_batch):
      self._send_weights(version, policy)
    else:
      self.publish_seconds = 0.0
    self.ring.put(version, copy_state(policy))
    if version == self.stop_batch:
      self._finished = True
    return version

  def failed(self, line: str) -> None:
    self.link.fail(line)

  def close(self) -> None:
    """Tell the rollout side the run is done, or (stopped before its last step) that the
    learner stopped."""
    if self._closed or self.link.failure() is not None:
      return
    self._closed = True
    if self._finished:
      self.link.send("done", True)
    else:
      self.link.fail(
        f"learner (devices {device_ids(self.groups[1])}) stopped before step "
        f"{self._next_batch + 1}; the rollout worker stops"
      )


class RolloutServer:
  """The rollout processes' side of device groups across processes: batch j (fixed lag:
  version max(0, j - k), `rl.pipeline.schedule_version`) for j from the learner's start
  version to the run's steps, each generated on the rollout group's mesh with the weights
  the learner sent ("weights/V", placed by `shard_rollout_params`) and sent back
  ("batch/J": `rl.step.on_host`, its version, generate seconds, seconds waited for
  weights). The weights of version j - k exist only once the learner received batch
  j - k - 1, so at most k + 1 batches are ever in flight, as in one process.

  A failure here is said in one line naming the rollout side, here and to the learner; a
  failure there ends the wait here with the learner's line (`LearnerError`)."""

  def __init__(
    self, spec: StepSpec, policy, rollout_config, task, tokenizer, *, groups, timeout: float
  ):
    self.spec, self.task, self.tokenizer, self.groups = spec, task, tokenizer, groups
    self.link = GroupLink(timeout)
    self.mesh = make_mesh(len(groups[0]), 1, 1, devices=groups[0])
    self.spec = dataclasses.replace(spec, mesh=self.mesh)
    self.engine = RolloutEngine(policy, rollout_config, mesh=self.mesh)
    self._version = None  # the engine's weights are its own until the first received

  def _wait(self, name: str, what: str, timeout: float | None = None):
    return self.link.receive(
      name,
      waiting=f"learner (devices {device_ids(self.groups[1])}): no {what}",
      error=LearnerError,
      timeout=timeout,
    )

  def run(self) -> list[dict]:
    """Serve every batch, then wait for the learner's end; returns [] (the learner logs)."""
    config = self.spec.config
    k, steps = config.schedule.max_staleness, config.schedule.steps
    try:
      start = self._wait("start", "start")
      for j in range(start, steps):
        waited, version = time.time(), schedule_version(j, k)
        if version != self._version:
          params = self._wait(f"weights/{version}", f"weights of version {version}")
          self.engine.params = sharding_lib.shard_rollout_params(params, self.mesh)
          if self._version is not None:
            self.link.delete(f"weights/{self._version}")
          self._version = version
        waited = time.time() - waited
        try:
          begun = time.time()
          with jax.set_mesh(self.mesh):
            collected = step_lib.collect(
              self.spec, self.engine, self.task, self.tokenizer, j + 1, version
            )
            collected = step_lib.on_host(collected)
          seconds = time.time() - begun
        except Exception as error:
          line = self._failed(f"failed generating batch {j}", error)
          raise RolloutWorkerError(line) from error
        self.link.send(f"batch/{j}", (version, collected, seconds, waited))
      # after the last batch the learner still makes up to k + 1 updates and its evaluation
      self._wait("done", "end of the run", timeout=self.link.timeout * (k + 2))
      if self._version is not None:
        self.link.delete(f"weights/{self._version}")
    except RolloutWorkerError:  # said and logged where the batch failed
      raise
    except (LearnerError, TimeoutError) as error:  # the learner's line, or this wait's
      logging.error("%s", error)
      raise
    except BaseException as error:  # anything else here, Ctrl-C included: said to the learner
      self._failed("stopped", error)
      raise
    return []

  def _failed(self, what: str, error: BaseException) -> str:
    """Say this side failed, to the learner and in the log, in one line naming it."""
    message = str(error).splitlines()[0] if str(error) else ""
    line = (
      f"rollout worker (devices {device_ids(self.groups[0])}) {what}: "
      f"{type(error).__name__}: {message}"
    )
    self.link.fail(line)
    logging.error("%s", line)
    return line

  def close(self) -> None:
    pass
