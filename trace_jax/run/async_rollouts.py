"""The rollout side of an asynchronous RL run (max_staleness k > 0; DESIGN.md section 4), on
`rl.pipeline`'s WeightRing and RolloutWorker:

1. The ring holds copies of the policy's state at versions v - k .. v (the update donates
   the policy's buffers, so the ring's are copies of their own).
2. A background thread generates batch j (step j + 1) with the weights of version
   max(0, j - k) (fixed lag): its own rollout engine, synced when the version changes, runs
   `rl.step.collect` with the step's PRNG key, so a batch depends only on (seed, step,
   version's weights). One generate call plays a whole batch, multi-turn episodes included:
   an episode never continues across a weight change.
3. The learner takes batch j at version j, updates, and publishes version j + 1.
4. Checkpoints hold k slots beside the state: slot i the weights of version
   max(0, v - k + i) (v the checkpoint's version; early on the first slots repeat version
   0), so the names are fixed and a restore needs nothing but the config. Rollouts in flight
   at a crash are not saved: a resume regenerates them, bit for bit the ones the crashed
   run would have consumed.

Device groups (RLConfig.rollout_devices = N > 0, `device_groups`): the job's first N devices
are the rollout group, with a mesh of their own (N data-parallel replicas, the FP4 weights
whole on each); the learner's (data, expert, model) mesh lies on the devices after them.
Then:

5. After each update the learner makes the new version's rollout weights on its own mesh
   (`quantize_params`, `RolloutEngine.weights`) and publishes them with `jax.device_put`
   onto the rollout mesh's shardings; the ring the worker reads holds those, the last
   k + 1 versions, on the rollout group. A second ring, on the learner, holds the master
   weights of the same versions: the checkpoint's slots and the version-split diagnostic
   read them.
6. The worker's batches are made on the rollout mesh and come back through the bounded
   queue; the learner moves each onto its own shardings (`rl.step.on_mesh`) when it
   receives it.
7. With max_staleness = 0 the same groups run the synchronous loop: each batch is
   generated in the learner's thread, at its call, on the rollout group, with the weights
   the previous update published; nothing else changes, so a run equals the shared-device
   synchronous loop on meshes of the same shapes bit for bit.

Without device groups both share the run's mesh, and the overlap is the rollout thread's
host and device time against the update's (docs/scale-out.md).

Device groups across processes (`jax.distributed`; `group_role`): the rollout group must be
whole processes (the job's first N devices: processes 0..r-1) and the learner's mesh the
whole processes after them. Each process then runs one side only, in its main thread, so
every device program of a group is issued by that group's processes alone and in the same
order on each:

8. The rollout processes run `RolloutServer`: batch j, with the weights of version
   max(0, j - k) (fixed lag, as in one process), for j from the learner's start version to
   the run's steps. The learner's processes run the trainer with `RemoteRollouts` in place
   of the worker. The two sides meet only through `GroupLink`, messages in
   `jax.distributed`'s key-value store under fixed names: the learner sends "weights/V"
   (version V's rollout weights, made on its mesh, as numpy) for every version a batch
   needs, the rollout side sends "batch/J" (`rl.step.on_host`), which the learner places
   on its mesh (`rl.step.on_mesh`). No collective spans both groups, so neither side's
   programs wait on the other's; the weights of version j - k exist only after the learner
   received batch j - k - 1, so at most k + 1 batches are in flight.
9. Every wait for the other side has a timeout (Schedule.rollout_timeout) and ends at once
   when the other side says it failed ("failed", its one line); each process logs that one
   line and stops. The learner's first process writes the run's files
   (`utils.distributed.set_main_process`); the run keeps no checkpoints and makes no warm
   start (`check_across_processes`).
10. A run is reproducible bit for bit (a batch depends only on the seed, the step and the
   version's weights). Against one process with the same groups the rewards and version gaps
   are the same and the update agrees to float rounding only: with gloo the learner's all-reduces over
   its own devices sum in another order (tests/run/test_device_groups_processes.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import pickle
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.errors import JaxRuntimeError

from trace_jax.model import sharding as sharding_lib
from trace_jax.model.sharding import make_mesh
from trace_jax.rl import step as step_lib
from trace_jax.rl.pipeline import (
  PipelinedRollout,
  RolloutWorker,
  RolloutWorkerError,
  WeightRing,
  schedule_version,
)
from trace_jax.rl.step import StepSpec
from trace_jax.rollout.engine import RolloutEngine


def check_staleness(config) -> int:
  """The run's max_staleness; refused (ValueError) for a multi-process run whose rollouts
  share the learner's devices (the rollout thread would issue collectives out of step with
  the learner's), allowed across processes with device groups (`group_role`)."""
  staleness = config.schedule.max_staleness
  if staleness and jax.process_count() > 1 and not config.rollout_devices:
    raise ValueError(
      f"RLConfig.max_staleness={staleness} with rollouts on the learner's devices runs in "
      f"one process only (its rollout thread would issue collectives out of step with the "
      f"learner's); this run has {jax.process_count()} processes: use --rollout_devices "
      f"(the rollouts on whole processes of their own), or max_staleness=0"
    )
  return staleness


def device_groups(config, *, say_idle: bool = False) -> tuple[list, list] | None:
  """(rollout devices, learner devices) of RLConfig.rollout_devices = N > 0: the job's first
  N devices, and the RLConfig.mesh's data x expert x model devices after them; None for
  N = 0 (both share the mesh's devices). `say_idle`: warn of the devices neither uses.

  In a job of several processes every process's devices must lie in one group (`group_role`:
  the rollout group is whole processes, the learner's mesh the processes after them).

  Raises:
    ValueError: N leaves the learner no devices or too few for its mesh, or (several
      processes) a process's devices lie in both groups or in neither.
  """
  n = config.rollout_devices
  if not n:
    return None
  devices, need = jax.devices(), math.prod(config.mesh)
  if len(devices) - n < need:
    allowed = f"1..{len(devices) - need}" if len(devices) > need else "none but 0"
    raise ValueError(
      f"RLConfig.rollout_devices={n} leaves the learner {max(0, len(devices) - n)} of this "
      f"job's {len(devices)} devices, and its RLConfig.mesh={config.mesh} needs {need}; "
      f"allowed: rollout_devices {allowed}, or 0 (rollouts share the learner's devices)"
    )
  rollout, learner = list(devices[:n]), list(devices[n : n + need])
  if jax.process_count() > 1:
    _check_whole_processes(config, rollout, learner)
  if say_idle and len(devices) > n + need:
    logging.warning(
      "RLConfig.rollout_devices=%d: the learner's mesh %s uses %d of the %d devices after the "
      "rollout group; devices %s stay idle",
      n,
      config.mesh,
      need,
      len(devices) - n,
      device_ids(devices[n + need :]),
    )
  return rollout, learner


def _check_whole_processes(config, rollout: list, learner: list) -> None:
  """A ValueError unless every process's devices lie all in the rollout group or all in the
  learner's (each group's programs then run on its own processes only)."""
  groups = {"rollout": {d.id for d in rollout}, "learner": {d.id for d in learner}}
  per_process = {}
  for device in jax.devices():
    per_process.setdefault(device.process_index, []).append(device.id)
  for process, ids in sorted(per_process.items()):
    inside = [name for name, group in groups.items() if set(ids) <= group]
    if not inside:
      sizes = sorted({len(v) for v in per_process.values()})
      raise ValueError(
        f"RLConfig.rollout_devices={config.rollout_devices} with RLConfig.mesh={config.mesh} "
        f"puts process {process}'s devices {ids} in both groups or partly in neither; across "
        f"{len(per_process)} processes ({sizes} devices each) each process's devices must "
        f"lie in one group: allowed: rollout_devices and the mesh's size whole multiples of "
        f"the devices per process, covering every process"
      )


def group_role(groups) -> str | None:
  """Which group this process runs with device groups across processes: "rollout" (its
  devices are the rollout group's: it runs `RolloutServer`) or "learner" (the learner's
  mesh: it trains, with `RemoteRollouts`); None in a job of one process, or without groups."""
  if groups is None or jax.process_count() == 1:
    return None
  mine = {d.id for d in jax.local_devices()}
  return "rollout" if mine <= {d.id for d in groups[0]} else "learner"


def learner_process(groups) -> int:
  """The first process of the learner's mesh (it writes the run's metrics and files)."""
  return min(d.process_index for d in groups[1])


def check_across_processes(config, warm_start: bool) -> None:
  """Device groups across processes train from the config's initial weights and keep no
  checkpoints (the checkpoint's save and restore would be collectives of one group only):
  a ValueError naming the field otherwise."""
  if config.schedule.checkpoint_every:
    raise ValueError(
      f"RLConfig.checkpoint_every={config.schedule.checkpoint_every} with "
      f"RLConfig.rollout_devices={config.rollout_devices} across {jax.process_count()} "
      "processes: device groups across processes keep no checkpoints; allowed: "
      "checkpoint_every=0, or one process"
    )
  if warm_start:
    raise ValueError(
      f"RLConfig.sft_warm_start={config.source.sft_warm_start} (a warm start is made) with "
      f"RLConfig.rollout_devices={config.rollout_devices} across {jax.process_count()} "
      "processes: device groups across processes start from the initial weights; allowed: "
      "sft_warm_start=false, or one process"
    )


def device_ids(devices) -> str:
  """Device ids as metrics.jsonl logs them: "0,1"."""
  return ",".join(str(d.id) for d in devices)


def copy_state(policy) -> nnx.State:
  """The policy's whole state in buffers of its own (an update donates the policy's)."""
  return jax.tree.map(jnp.copy, nnx.state(policy))


def slot_names(max_staleness: int) -> tuple[str, ...]:
  """The checkpoint entries of the ring's older versions."""
  return tuple(f"ring_{i}" for i in range(max_staleness))


def slot_version(slot: int, version: int, max_staleness: int) -> int:
  """The weight version checkpoint slot `slot` holds at policy version `version`."""
  return max(0, version - max_staleness + slot)


def initial_slots(policy, max_staleness: int) -> dict[str, nnx.State]:
  """Slots for a fresh run (every one version 0: the policy as it starts), also what a
  restore fills in place."""
  return {name: copy_state(policy) for name in slot_names(max_staleness)}


class AsyncRollouts:
  """The ring, the worker and the worker's engine of one run.

  Args:
    spec: the run's StepSpec (max_staleness > 0, or device groups); its mesh the learner's.
    policy: the policy at `version` (restored or fresh); the ring takes a copy.
    version: the policy's version (updates done).
    slots: `initial_slots` after the restore: the older versions' states.
    rollout_config: the arm's RolloutConfig (the trainer's engine's).
    task, tokenizer: what `collect` plays.
    stop_batch: the worker generates batches below this index only (default: the run's
      steps).
    groups: `device_groups`: (rollout devices, learner devices), or None (shared devices).
    timeout: seconds the learner waits for a batch before it stops the run (a hung rollout
      side); None: no limit.
  """

  def __init__(
    self,
    spec: StepSpec,
    policy,
    version: int,
    slots: dict[str, nnx.State],
    rollout_config,
    task,
    tokenizer,
    *,
    stop_batch: int | None = None,
    groups: tuple[list, list] | None = None,
    timeout: float | None = None,
  ):
    k = spec.config.schedule.max_staleness
    stop_batch = spec.config.schedule.steps if stop_batch is None else stop_batch
    self.spec, self.task, self.tokenizer, self.stop_batch = spec, task, tokenizer, stop_batch
    self.groups, self.timeout = groups, timeout
    self.graphdef = nnx.graphdef(policy)
    self.ring = WeightRing(max_staleness=k)  # master weights, where the policy lives
    names = slot_names(k)
    for v in range(max(0, version - k), version):
      self.ring.put(v, slots[names[v - (version - k)]])
    self.ring.put(version, copy_state(policy))
    # Its own engine: the trainer's engines sync in the learner's thread.
    self.rollout_mesh = None
    if groups is not None:  # data-parallel replicas, weights whole on each
      self.rollout_mesh = make_mesh(len(groups[0]), 1, 1, devices=groups[0])
      self.rollout_spec = dataclasses.replace(spec, mesh=self.rollout_mesh)
    self.engine = RolloutEngine(policy, rollout_config, mesh=self.rollout_mesh or spec.mesh)
    self._engine_version = None  # made from the policy, not from a ring version: sync first
    # What the worker reads: the master ring, or (groups) the published rollout weights.
    self.rollout_ring = self.ring
    self.publish_seconds = None  # the last publish's (groups)
    if groups is not None:
      self.rollout_ring = WeightRing(max_staleness=k)
      for v in self.ring.versions:  # the engine was just made with the latest's
        latest = (self.engine.graphdef, self.engine.params) if v == version else None
        self.rollout_ring.put(v, latest or self.engine.weights(self.policy_at(v)))
    self.worker: RolloutWorker | None = None

  @property
  def metrics(self) -> dict:
    """The device groups' ids (logged with every step's metrics; none without groups)."""
    if self.groups is None:
      return {}
    return {
      "async/rollout_devices": device_ids(self.groups[0]),
      "async/learner_devices": device_ids(self.groups[1]),
    }

  def _generate(self, batch_index: int, version: int, params) -> tuple:
    """(Collected, seconds) of batch `batch_index` (step batch_index + 1) at `version`."""
    start = time.time()
    mesh = self.rollout_mesh or self.spec.mesh
    spec = self.spec if self.groups is None else self.rollout_spec
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      if self._engine_version != version:
        if self.groups is None:
          self.engine.sync(nnx.merge(self.graphdef, params))
        else:  # published on the rollout group
          self.engine.graphdef, self.engine.params = params
        self._engine_version = version
      collected = step_lib.collect(
        spec, self.engine, self.task, self.tokenizer, batch_index + 1, version
      )
    return collected, time.time() - start

  def next(self) -> PipelinedRollout:
    """The next batch (value: (Collected, generate seconds)); starts the worker if none
    runs (first use, or after `close`: it continues from the ring's latest version)."""
    if self.worker is None:
      self.worker = RolloutWorker(self._generate, self.rollout_ring, stop_batch=self.stop_batch)
    try:
      return self.worker.next(timeout=self.timeout)
    except TimeoutError as error:
      raise TimeoutError(
        f"rollout worker: no batch for step {self.worker.next_batch + 1} within "
        f"{self.timeout:g} s; the run stops"
      ) from error

  def receive(self, version: int) -> tuple:
    """The batch for the learner at `version`: (Collected, its generate seconds, its
    async/* metrics), on the learner's mesh; a RolloutWorkerError if its generation
    failed, a TimeoutError if nothing came within `timeout`."""
    start = time.time()
    received = self.next()
    wait_seconds = time.time() - start
    if received.batch_index != version:  # cannot happen: one batch per version
      raise AssertionError(f"batch {received.batch_index} at version {version}")
    self._received = received
    collected, rollout_seconds = received.value
    if self.groups is not None:
      collected = step_lib.on_mesh(collected, self.spec.mesh)
    gap = received.version_gap  # one version per batch: every sequence's gap
    return (
      collected,
      rollout_seconds,
      {
        "async/version_gap": gap,
        "async/version_gap_mean": float(gap),
        "async/version_gap_max": gap,
        "async/rollout_version": received.version,
        "async/wait_seconds": wait_seconds,
        **(
          {"async/rollout_wait_seconds": received.worker_wait_seconds}
          if self.spec.config.schedule.max_staleness
          else {}
        ),
        **self.metrics,
      },
    )

  def version_split(self, step: int, collected) -> dict:
    """`rl.step.version_split` of the batch just received, every
    `evaluation.version_diag_every` steps (before the update is published: the ring then
    holds both the rollout's version and this update's start)."""
    every = self.spec.config.evaluation.version_diag_every
    if not every or step % every:
      return {}
    received = self._received
    stale = self.policy_at(received.version)
    current = self.policy_at(received.batch_index)  # this update's start
    return step_lib.version_split(self.spec, stale, current, collected)

  def publish(self, policy) -> int:
    """Publish the policy just updated (a copy) as the next version; with device groups
    also its rollout weights, made on the learner's mesh and put onto the rollout group
    (`publish_seconds`: their making and transfer, waited for)."""
    if self.groups is None:
      return self.worker.publish(copy_state(policy))
    start = time.time()
    weights = self.engine.weights(policy)
    jax.block_until_ready(weights[1])
    self.publish_seconds = time.time() - start
    version = self.worker.publish(weights)
    self.ring.put(version, copy_state(policy))
    return version

  def policy_at(self, version: int):
    """The policy of a version the ring holds (its buffers shared with the ring's)."""
    return nnx.merge(self.graphdef, self.ring.get(version))

  def slots(self) -> dict[str, nnx.State]:
    """The checkpoint slots at the ring's latest version (`initial_slots`' names)."""
    k, latest = self.ring.max_staleness, self.ring.latest_version
    return {name: self.ring.get(slot_version(i, latest, k)) for i, name in enumerate(slot_names(k))}

  def failed(self, line: str) -> None:
    """The learner failed (`line` says so); across processes the rollout side is told."""

  def close(self) -> None:
    """Stop the worker (idempotent); queued batches are dropped, the ring is kept."""
    if self.worker is not None:
      self.worker.close()
      self.worker = None


# Device groups across processes (`group_role`): the rollout processes run `RolloutServer`,
# the learner's run the trainer with `RemoteRollouts`; they meet only through `GroupLink`.

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

  def receive(self, name: str, *, waiting: str, error):
    """The value sent as `name`: raises `error(the other side's line)` if it failed first, a
    TimeoutError (said to the other side too) after `timeout` seconds; `waiting` names
    the wait in that line."""
    deadline = time.monotonic() + self.timeout
    while True:
      line = self.failure()
      if line is not None:
        raise error(line)
      try:
        data = self.client.blocking_key_value_get_bytes(f"{_KEYS}/{name}", _POLL_MS)
        return pickle.loads(data)
      except JaxRuntimeError as e:  # a deadline: the other side is still working
        if "DEADLINE_EXCEEDED" not in str(e):
          raise
      if time.monotonic() > deadline:
        line = f"{waiting} within {self.timeout:g} s; the run stops"
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
    self._next_batch, self._finished, self._closed = version, False, False
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

  def _wait(self, name: str, what: str):
    return self.link.receive(
      name,
      waiting=f"learner (devices {device_ids(self.groups[1])}): no {what}",
      error=LearnerError,
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
          message = str(error).splitlines()[0] if str(error) else ""
          line = (
            f"rollout worker (devices {device_ids(self.groups[0])}) failed generating batch "
            f"{j}: {type(error).__name__}: {message}"
          )
          self.link.fail(line)
          logging.error("%s", line)
          raise RolloutWorkerError(line) from error
        self.link.send(f"batch/{j}", (version, collected, seconds, waited))
      self._wait("done", "end of the run")
    except LearnerError as error:
      logging.error("%s", error)
      raise
    except TimeoutError as error:
      logging.error("%s", error)
      raise
    return []

  def close(self) -> None:
    pass
