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

Device groups across processes: `run.remote_rollouts`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.model.sharding import make_mesh
from trace_jax.rl import step as step_lib
from trace_jax.rl.pipeline import (
  PipelinedRollout,
  RolloutWorker,
  WeightRing,
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
      f"(the rollouts on a process of their own), or max_staleness=0"
    )
  return staleness


def device_groups(config, *, say_idle: bool = False) -> tuple[list, list] | None:
  """(rollout devices, learner devices) of RLConfig.rollout_devices = N > 0: the job's first
  N devices, and the RLConfig.mesh's data x expert x model devices after them; None for
  N = 0 (both share the mesh's devices). `say_idle`: warn of the devices neither uses.

  In a job of several processes each group is one whole process (`group_role`: the rollout
  group one process's devices, the learner's mesh the next one's).

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
  """A ValueError unless the rollout group is one process's devices and the learner's mesh
  another's, and no process is left out: each group's programs then run on its own process
  only, and the batches and weights between them are one process's messages."""
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
        f"lie in one group: allowed: rollout_devices and the mesh's size each one process's "
        f"devices, covering every process"
      )
  processes = {
    name: sorted({d.process_index for d in group})
    for name, group in (("rollout", rollout), ("learner", learner))
  }
  wide = {name: procs for name, procs in processes.items() if len(procs) > 1}
  if wide:
    raise ValueError(
      f"RLConfig.rollout_devices={config.rollout_devices} with RLConfig.mesh={config.mesh} "
      f"gives the {' and the '.join(wide)} group processes "
      f"{' and '.join(str(p) for p in wide.values())}; across processes each group is one "
      f"process (its batches and weights are messages of one process); allowed: "
      f"rollout_devices and the mesh's size each equal to one process's "
      f"{len(per_process[rollout[0].process_index])} devices"
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
      lingering = getattr(self, "_closed_worker", None)
      if lingering is not None and lingering.running:  # it would share the engine
        raise RuntimeError(
          f"rollout worker: the worker closed at step {lingering.next_batch + 1} is still in "
          "generate(); a new one would share its engine and weights, so the run stops"
        )
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
      self._closed_worker, self.worker = self.worker, None
