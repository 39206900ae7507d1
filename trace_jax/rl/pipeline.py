"""Bounded-staleness rollout pipeline: which weights generate which batch, and a worker that
generates ahead of the learner (DESIGN.md section 4). No model code: generation is a
callable, parameters are opaque pytrees.

Versions: version v is the parameters after v learner updates (0: the initial ones). The
learner consumes one batch per update: it consumes batch j at version j and then publishes
version j + 1. With max_staleness k:

1. Admission (AReaL's rule): with `issued` rollouts started so far and the learner at
   `version`, capacity = (k + version + 1) * batch - issued more may start. For whole
   batches (issued = j * batch) batch j is admitted iff version >= j - k, so at most k + 1
   batches are ever in flight (generated or generating, not yet consumed).
2. Fixed lag: batch j is generated with version max(0, j - k), the oldest version admission
   allows, not the newest one published. Each batch's weights are then fixed by its index,
   not by thread timing, so a run is deterministic and its version gaps (consumer version -
   generator version) are min(j, k): 0, 1, ..., k, then k. (AReaL uses the newest weights at
   issue time; its gaps vary with timing.)
3. `WeightRing` keeps the last k + 1 versions: exactly what batches v .. v + k need.
4. `RolloutWorker` runs `generate(batch_index, version, params)` in a background thread into
   a bounded queue that the learner reads in batch order. k = 0 generates inline, in the
   caller's thread at the caller's call: the synchronous loop, with no thread at all.

Crash and resume: rollouts in flight at a crash (queued or being generated) are not saved;
a resume regenerates them. `generate` must depend only on (seed, batch index, version)
through its arguments (the trainer's PRNG key is already fold_in(seed, step)), and the
caller's checkpoint must hold the ring's versions v - k .. v (`run.async_rollouts` saves
the policy, at v, and k slots beside it, the older versions, and refills a fresh ring from
them), so the regenerated batches are bit for bit those the crashed run would have
consumed and a resumed run continues exactly as an uninterrupted one. The price: up to
k + 1 batches generated twice, and k + 1 parameter versions per checkpoint.

Multi-turn episodes: one `generate` call plays a whole batch with one version, so an
episode never continues across a weight change.

The ring holds references to what is published. A learner whose update donates its
parameter buffers (the trainer's `rl.programs.train_step` does) must publish buffers of their own: a
copy, or the rollout-ready weights (`quantize_params` makes new arrays), placed on the
rollout devices if those are a separate group.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_POLL_S = 0.05  # how often a blocked wait rechecks for a stop or a worker failure


def _check_count(name: str, value, minimum: int = 0) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def schedule_version(batch_index: int, max_staleness: int) -> int:
  """The weight version that generates batch `batch_index`: max(0, j - k), fixed lag."""
  _check_count("batch_index", batch_index)
  _check_count("max_staleness", max_staleness)
  return max(0, batch_index - max_staleness)


class VersionUnavailableError(LookupError):
  """A weight version the ring no longer (or does not yet) hold."""


class WeightRing:
  """The last k + 1 published parameter versions, keyed by version; thread-safe.

  Versions arrive in order (v, v + 1, ...); putting v + 1 drops v - k.
  """

  def __init__(self, *, max_staleness: int):
    _check_count("max_staleness", max_staleness)
    self.max_staleness = max_staleness
    self._params: dict[int, Any] = {}
    self._latest: int | None = None
    self._changed = threading.Condition()

  @property
  def capacity(self) -> int:
    return self.max_staleness + 1

  @property
  def latest_version(self) -> int | None:
    with self._changed:
      return self._latest

  @property
  def versions(self) -> tuple[int, ...]:
    with self._changed:
      return tuple(sorted(self._params))

  def put(self, version: int, params) -> None:
    """Publish `version` (the first may be any version, later ones count up by one)."""
    _check_count("version", version)
    with self._changed:
      if self._latest is not None and version != self._latest + 1:
        raise ValueError(
          f"version={version} cannot follow version {self._latest}: versions are published "
          f"in order, the next is {self._latest + 1}"
        )
      self._params[version] = params
      self._latest = version
      for old in [v for v in self._params if v < version - self.max_staleness]:
        del self._params[old]
      self._changed.notify_all()

  def get(self, version: int):
    """The parameters of `version`.

    Raises:
      VersionUnavailableError: the version was dropped (older than latest - k) or is not
        published yet.
    """
    with self._changed:
      if version in self._params:
        return self._params[version]
      held = f"versions {min(self._params)}..{self._latest}" if self._params else "no version"
      if self._latest is not None and version < self._latest:
        why = f"was dropped: the ring keeps the last {self.capacity} (max_staleness="
        why += f"{self.max_staleness}) and holds {held}"
      else:
        why = f"is not published yet (the ring holds {held})"
      raise VersionUnavailableError(f"weight version {version} {why}")

  def wait_for(self, version: int, timeout: float) -> bool:
    """Block until `version` is published (True) or `timeout` seconds pass (False)."""
    with self._changed:
      return self._changed.wait_for(
        lambda: self._latest is not None and self._latest >= version, timeout
      )


@dataclasses.dataclass(frozen=True)
class PipelinedRollout:
  """One generated batch, as the learner receives it."""

  batch_index: int
  version: int  # the weight version that generated it
  version_gap: int  # the learner's version when it received it, minus `version`
  value: Any  # what generate() returned
  # Seconds the worker thread spent blocked since the previous batch was received: waiting
  # for weights (admission) or for room in the full queue (0.0 with k = 0: no thread).
  worker_wait_seconds: float = 0.0


class RolloutWorkerError(RuntimeError):
  """The rollout worker's generate() raised; the original error is the __cause__."""


class RolloutWorker:
  """Generates batches ahead of the learner with bounded staleness.

  The learner alternates `next()` (batch j, generated with version max(0, j - k)) and
  `publish(params)` (version j + 1 after its update of batch j). The first batch is the
  ring's latest version: a fresh run puts version 0 into the ring, a resumed one refills
  it with the versions its checkpoint holds, and the worker continues from there.

  With k > 0 a daemon thread generates into a queue of k + 1 batches; an exception in it
  reaches the learner at the `next()` of the batch that failed, as a RolloutWorkerError
  chained to it (earlier batches are still delivered first), and stops the worker. With
  k = 0 `next()` calls generate() itself and its exceptions propagate unchanged.
  `close()` (also on leaving a `with` block) stops the thread within its timeout in every
  state: idle, blocked on weights, with a full queue, after an error.

  Args:
    generate: (batch_index, version, params) -> a batch; called in batch order, once per
      batch (again after a resume for batches that were in flight).
    ring: the published weights; must already hold its latest version.
    stop_batch: generate batches below this index only (None: until closed).
    name: the thread's name.
  """

  def __init__(
    self,
    generate: Callable[[int, int, Any], Any],
    ring: WeightRing,
    *,
    stop_batch: int | None = None,
    name: str = "rollout-worker",
  ):
    start = ring.latest_version
    if start is None:
      raise ValueError("RolloutWorker needs a ring holding a version: put version 0 first")
    if stop_batch is not None:
      _check_count("stop_batch", stop_batch)
    self._generate = generate
    self._ring = ring
    self.max_staleness = ring.max_staleness
    self.stop_batch = stop_batch
    self._next_batch = start  # the batch the learner receives next
    self._error: tuple[int, BaseException] | None = None
    self._failed: RolloutWorkerError | None = None
    self._closed = False
    self._stop = threading.Event()
    # (batch_index, version, value); admission keeps at most k + 1 batches in flight
    self._queue: queue.Queue[tuple[int, int, Any]] = queue.Queue(maxsize=self.max_staleness + 1)
    self._blocked_lock = threading.Lock()
    self._blocked_seconds = 0.0  # the thread's time blocked on weights or a full queue
    self._blocked_reported = 0.0  # the part of it already given to a received batch
    self._thread = None
    if self.max_staleness > 0:
      self._thread = threading.Thread(target=self._run, args=(start,), name=name, daemon=True)
      self._thread.start()

  @property
  def running(self) -> bool:
    """Whether the worker's thread is still alive (after `close()`: still in generate())."""
    return self._thread is not None and self._thread.is_alive()

  @property
  def next_batch(self) -> int:
    """The index of the batch `next()` returns."""
    return self._next_batch

  @property
  def version(self) -> int:
    """The latest published version."""
    return self._ring.latest_version

  @property
  def blocked_seconds(self) -> float:
    """Seconds the worker thread has spent blocked so far: waiting for a batch's weights
    (admission) or for room in the full queue; 0.0 with k = 0."""
    with self._blocked_lock:
      return self._blocked_seconds

  def _add_blocked(self, seconds: float) -> None:
    with self._blocked_lock:
      self._blocked_seconds += seconds

  def _run(self, batch_index: int) -> None:
    try:
      while not self._stop.is_set():
        if self.stop_batch is not None and batch_index >= self.stop_batch:
          return
        version = schedule_version(batch_index, self.max_staleness)
        blocked = time.monotonic()
        while not self._ring.wait_for(version, _POLL_S):  # admission: version >= j - k
          if self._stop.is_set():
            return
        self._add_blocked(time.monotonic() - blocked)
        item = (batch_index, version, self._generate(batch_index, version, self._ring.get(version)))
        blocked = time.monotonic()
        while True:
          try:
            self._queue.put(item, timeout=_POLL_S)
            break
          except queue.Full:
            if self._stop.is_set():
              return
        self._add_blocked(time.monotonic() - blocked)
        batch_index += 1
    except BaseException as error:  # noqa: BLE001 - every failure goes to the learner
      self._error = (batch_index, error)

  def next(self, timeout: float | None = None) -> PipelinedRollout:
    """The next batch, in order.

    Args:
      timeout: seconds to wait (None: as long as it takes).

    Raises:
      RolloutWorkerError: generate() raised in the worker (chained to that error).
      TimeoutError: nothing arrived within `timeout`.
      ValueError: misuse (closed, past stop_batch, or the previous update not published).
    """
    if self._closed:
      raise ValueError("RolloutWorker.next() after close()")
    if self._failed is not None:
      raise self._failed
    j = self._next_batch
    if self.stop_batch is not None and j >= self.stop_batch:
      raise ValueError(f"batch {j} is past stop_batch={self.stop_batch}")
    latest = self._ring.latest_version
    if latest != j:
      raise ValueError(
        f"batch {j} is received at version {j}, but the latest published version is {latest}: "
        "publish the update of each batch before asking for the next"
      )
    if self._thread is None:
      version, value = j, self._generate(j, j, self._ring.get(j))
    else:
      version, value = self._receive(j, timeout)
    self._next_batch = j + 1
    blocked = self.blocked_seconds
    waited, self._blocked_reported = blocked - self._blocked_reported, blocked
    return PipelinedRollout(
      batch_index=j,
      version=version,
      version_gap=j - version,
      value=value,
      worker_wait_seconds=waited,
    )

  def _receive(self, j: int, timeout: float | None) -> tuple[int, Any]:
    """(version, value) of batch j from the queue; raises the worker's failure once the
    batches it generated before failing are delivered."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      wait = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
      try:
        return self._take(j, self._queue.get(timeout=wait))
      except queue.Empty:
        pass
      alive = self._thread.is_alive()  # read before the error: a dead thread's error is final
      if self._error is not None:
        try:  # the worker queues every batch it made before setting its error
          return self._take(j, self._queue.get_nowait())
        except queue.Empty:
          pass
        failed_at, error = self._error
        self._failed = RolloutWorkerError(
          f"rollout worker failed generating batch {failed_at}: {type(error).__name__}: {error}"
        )
        raise self._failed from error
      if not alive:
        raise RolloutWorkerError(f"rollout worker stopped before batch {j}")
      if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"no rollout for batch {j} within {timeout} s")

  @staticmethod
  def _take(j: int, item: tuple[int, int, Any]) -> tuple[int, Any]:
    batch_index, version, value = item
    if batch_index != j:  # cannot happen: one producer, in order
      raise AssertionError(f"rollout queue out of order: batch {batch_index} for batch {j}")
    return version, value

  def publish(self, params) -> int:
    """Publish the weights after the update of the batch just received; returns their version."""
    if self._closed:
      raise ValueError("RolloutWorker.publish() after close()")
    version = self._ring.latest_version + 1
    if version != self._next_batch:
      raise ValueError(
        f"publishing version {version} needs batch {version - 1} received first "
        f"(next batch is {self._next_batch})"
      )
    self._ring.put(version, params)
    return version

  def close(self, timeout: float = 30.0) -> bool:
    """Stop the worker; True when its thread ended within `timeout` seconds (or there is
    none). A generate() call in progress is not interrupted: the thread ends after it, and
    as a daemon it never holds the process open."""
    self._closed = True
    self._stop.set()
    if self._thread is None:
      return True
    while True:  # drop queued batches (they are regenerated if the run resumes)
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break
    self._thread.join(timeout)
    if self._thread.is_alive():
      logging.warning("rollout worker still in generate() %.0f s after close()", timeout)
      return False
    return True

  def __enter__(self) -> RolloutWorker:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
