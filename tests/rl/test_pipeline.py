"""Bounded-staleness pipeline: schedule, admission, weight ring, rollout worker.

A toy learner stands in for the trainer: parameters are a numpy vector, a batch is a
seeded function of (batch index, the generating version's parameters), an update mixes the
batch in. A plain loop that follows the fixed-lag schedule by hand is the reference every
threaded run must match bit for bit. Every wait has a timeout, so a deadlock fails a test
instead of hanging it.
"""

import copy
import threading
import time
import traceback
import types

import numpy as np
import pytest

from trace_jax.rl import pipeline
from trace_jax.rl.pipeline import (
  RolloutWorker,
  RolloutWorkerError,
  VersionUnavailableError,
  WeightRing,
  schedule_version,
)

SEED = 20260
WAIT_S = 5.0  # any single wait in these tests; a deadlock fails after this


def _generate(batch_index, version, params):
  """A batch: depends only on (seed, batch index, the version's parameters)."""
  del version  # the parameters are the version's; the schedule fixed which one
  rng = np.random.default_rng([SEED, batch_index])
  return 0.5 * params + rng.normal(size=params.shape)


def _update(params, batch):
  return params + 0.1 * batch


def _initial():
  return np.random.default_rng([SEED, 99]).normal(size=6)


def _reference(max_staleness, steps):
  """The fixed-lag schedule written out by hand, no thread: batch j uses version
  max(0, j - k) of the parameter history."""
  history, batches = [_initial()], []
  for j in range(steps):
    batch = _generate(j, None, history[max(0, j - max_staleness)])
    batches.append(batch)
    history.append(_update(history[-1], batch))
  return batches, history[-1]


def _drive(worker, params, steps, on_receive=None):
  """The learner: receive, update, publish."""
  received = []
  for _ in range(steps):
    rollout = worker.next(timeout=WAIT_S)
    received.append(rollout)
    if on_receive is not None:
      on_receive()
    params = _update(params, rollout.value)
    worker.publish(params)
  return received, params


def _wait_until(predicate, what):
  deadline = time.monotonic() + WAIT_S
  while not predicate():
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out waiting for {what}")
    time.sleep(0.002)


def _ring(max_staleness, params=None):
  ring = WeightRing(max_staleness=max_staleness)
  ring.put(0, _initial() if params is None else params)
  return ring


def test_schedule_is_fixed_lag():
  assert [schedule_version(j, 3) for j in range(8)] == [0, 0, 0, 0, 1, 2, 3, 4]
  assert [schedule_version(j, 0) for j in range(4)] == [0, 1, 2, 3]
  assert [j - schedule_version(j, 3) for j in range(8)] == [0, 1, 2, 3, 3, 3, 3, 3]
  with pytest.raises(ValueError, match="batch_index=-1 must be an integer >= 0"):
    schedule_version(-1, 3)


def test_ring_keeps_last_versions():
  ring = WeightRing(max_staleness=2)
  trees = {v: {"w": np.full(3, float(v)), "b": np.arange(v + 1.0)} for v in range(6)}
  for v in range(6):
    ring.put(v, trees[v])
    assert ring.versions == tuple(range(max(0, v - 2), v + 1))
  assert ring.latest_version == 5 and ring.get(4) is trees[4]
  with pytest.raises(VersionUnavailableError, match="version 2 was dropped.*holds versions 3..5"):
    ring.get(2)
  with pytest.raises(VersionUnavailableError, match="version 6 is not published yet"):
    ring.get(6)
  with pytest.raises(ValueError, match="version=7 cannot follow version 5.*next is 6"):
    ring.put(7, trees[0])


@pytest.mark.parametrize("jitter_seed", [0, 1])
def test_k3_gaps_bounded_positive_and_deterministic(jitter_seed):
  """Whatever the threads' timing, every batch is generated with version max(0, j - 3):
  gaps 0, 1, 2, 3, 3, ... (<= 3, > 0 after the first batch), admission holds at every
  generate call, and the run equals the hand-written schedule bit for bit."""
  k, steps = 3, 12
  jitter = np.random.default_rng(jitter_seed)
  ring = _ring(k)
  calls = []  # (batch, version, the learner's latest version, batches received) per call
  received_count = [0]

  def generate(j, version, params):
    calls.append((j, version, ring.latest_version, received_count[0]))
    time.sleep(jitter.uniform(0, 0.004))
    return _generate(j, version, params)

  def on_receive():
    received_count[0] += 1
    time.sleep(jitter.uniform(0, 0.004))

  with RolloutWorker(generate, ring, stop_batch=steps) as worker:
    received, params = _drive(worker, _initial(), steps, on_receive)
  gaps = [r.version_gap for r in received]
  assert gaps == [min(j, k) for j in range(steps)]
  assert max(gaps) <= k and all(g > 0 for g in gaps[1:])
  assert [r.version for r in received] == [max(0, j - k) for j in range(steps)]
  assert [c[0] for c in calls] == list(range(steps))  # each batch generated once, in order
  for j, version, latest, received_count in calls:
    # AReaL's admission: (k + version + 1) * batch - issued rollouts may start, here whole
    # batches of 8 with 8 * j issued before batch j
    assert (k + latest + 1) * 8 - 8 * j >= 8
    assert j + 1 - received_count <= k + 1  # in flight, this batch included
  want_batches, want_params = _reference(k, steps)
  for r, want in zip(received, want_batches, strict=True):
    np.testing.assert_array_equal(r.value, want)
  np.testing.assert_array_equal(params, want_params)


def test_worker_runs_exactly_k_plus_one_batches_ahead():
  """Before the learner takes anything, the worker generates batches 0..k from version 0
  and then waits for version 1 (admission), not a batch more."""
  k = 2
  ring = _ring(k)
  generated = []
  worker = RolloutWorker(lambda j, v, p: generated.append(j) or _generate(j, v, p), ring)
  try:
    _wait_until(lambda: len(generated) == k + 1, "k + 1 batches")
    time.sleep(0.2)  # time enough for a (wrong) further batch
    assert generated == [0, 1, 2] and worker._queue.qsize() == k + 1
    rollout = worker.next(timeout=WAIT_S)
    assert (rollout.batch_index, rollout.version, rollout.version_gap) == (0, 0, 0)
    worker.publish(_update(_initial(), rollout.value))  # version 1 admits batch 3
    _wait_until(lambda: len(generated) == k + 2, "batch 3")
  finally:
    assert worker.close(timeout=WAIT_S)


class _Clock:
  """The pipeline's clock, moved only by the test: a pause is an advance of this clock, so
  what the worker counts as blocked is what advanced while it was blocked, not wall time."""

  def __init__(self):
    self._now, self._lock = 0.0, threading.Lock()

  def monotonic(self) -> float:
    with self._lock:
      return self._now

  def advance(self, seconds: float) -> None:
    with self._lock:
      self._now += seconds


@pytest.mark.parametrize("slow", ["learner", "rollout"])
def test_worker_wait_is_the_time_the_worker_is_blocked(slow, monkeypatch):
  """worker_wait_seconds, on a clock the test moves: a slow learner leaves the worker
  blocked (on weights, or a full queue) through its pauses once the worker is ahead; a
  slow rollout's time passes while the worker generates, never while it is blocked, so its
  waits are exactly 0. The batches' waits add up to at most the worker's blocked_seconds."""
  k, steps, pause = 1, 6, 0.25
  clock = _Clock()
  monkeypatch.setattr(pipeline, "time", types.SimpleNamespace(monotonic=clock.monotonic))

  def generate(j, version, params):
    if slow == "rollout":
      clock.advance(pause)
    return _generate(j, version, params)

  def learner_pause():
    if slow == "learner":
      time.sleep(0.05)  # real time for the worker to run ahead and block
      clock.advance(pause)

  worker = RolloutWorker(generate, _ring(k))
  try:
    received, _ = _drive(worker, _initial(), steps, on_receive=learner_pause)
    waits = [r.worker_wait_seconds for r in received]
    assert min(waits) >= 0.0 and sum(waits) <= worker.blocked_seconds
    if slow == "learner":  # every pause after the first k + 1 batches, and no other time
      assert pause * (steps - k - 1) <= sum(waits) <= pause * steps
    else:
      assert waits == [0.0] * steps
  finally:
    assert worker.close(timeout=WAIT_S)
  inline = RolloutWorker(_generate, _ring(0))
  assert [r.worker_wait_seconds for r in _drive(inline, _initial(), 3)[0]] == [0.0] * 3


def test_k0_generates_inline_in_the_callers_thread():
  threads_before = threading.active_count()
  callers = []

  def generate(j, version, params):
    callers.append(threading.get_ident())
    return _generate(j, version, params)

  worker = RolloutWorker(generate, _ring(0))
  assert threading.active_count() == threads_before  # no thread started
  received, params = _drive(worker, _initial(), 5)
  assert callers == [threading.get_ident()] * 5
  assert [(r.version, r.version_gap) for r in received] == [(j, 0) for j in range(5)]
  want_batches, want_params = _reference(0, 5)
  np.testing.assert_array_equal(params, want_params)
  np.testing.assert_array_equal(received[-1].value, want_batches[-1])
  assert worker.close()

  def failing(j, version, params):
    raise ZeroDivisionError("inline")

  with pytest.raises(ZeroDivisionError, match="inline"):  # propagates as it is, unwrapped
    RolloutWorker(failing, _ring(0)).next()


def _failing_generate(j, version, params):
  if j == 5:
    raise ValueError("bad rollout at batch 5")
  return _generate(j, version, params)


def test_worker_exception_surfaces_and_run_stops_cleanly():
  worker = RolloutWorker(_failing_generate, _ring(3))
  received, params = _drive(worker, _initial(), 5)  # batches made before the error arrive
  assert [r.batch_index for r in received] == [0, 1, 2, 3, 4]
  with pytest.raises(RolloutWorkerError, match="batch 5: ValueError: bad rollout") as caught:
    worker.next(timeout=WAIT_S)
  cause = caught.value.__cause__
  assert isinstance(cause, ValueError)
  worker_trace = "".join(traceback.format_exception(caught.value))
  assert "_failing_generate" in worker_trace  # the worker's own frames are chained
  with pytest.raises(RolloutWorkerError):  # and again: the worker does not come back
    worker.next(timeout=WAIT_S)
  assert worker.close(timeout=WAIT_S) and not worker._thread.is_alive()


def test_error_while_the_learner_is_away_then_close():
  """The worker fails while the learner is busy: the batches it made before failing are
  still delivered in order, then the error; close() returns."""
  worker = RolloutWorker(_failing_generate, _ring(3))
  received, params = _drive(worker, _initial(), 2)  # version 2 admits batch 5, which fails
  _wait_until(lambda: not worker._thread.is_alive(), "the worker to fail")
  assert worker._queue.qsize() == 3  # batches 2, 3, 4
  received, _ = _drive(worker, params, 3)
  assert [r.batch_index for r in received] == [2, 3, 4]
  with pytest.raises(RolloutWorkerError, match="batch 5"):
    worker.next(timeout=WAIT_S)
  assert worker.close(timeout=WAIT_S)
  with pytest.raises(ValueError, match="after close"):
    worker.next()


def test_close_never_deadlocks():
  # a full queue, the worker blocked on weights the learner will never publish
  worker = RolloutWorker(_generate, _ring(2))
  _wait_until(lambda: worker._queue.qsize() == 3, "a full queue")
  assert worker.close(timeout=WAIT_S) and not worker._thread.is_alive()
  assert worker.close(timeout=WAIT_S)  # twice is fine

  # inside a slow generate(): close waits for it, then the thread ends
  started = threading.Event()

  def slow(j, version, params):
    started.set()
    time.sleep(0.2)
    return _generate(j, version, params)

  worker = RolloutWorker(slow, _ring(1))
  assert started.wait(WAIT_S)
  assert worker.close(timeout=WAIT_S) and not worker._thread.is_alive()

  # a generate() that does not return in time: close gives up after its timeout
  release = threading.Event()
  worker = RolloutWorker(lambda j, v, p: release.wait(WAIT_S), _ring(1))
  assert worker.close(timeout=0.1) is False
  release.set()
  worker._thread.join(WAIT_S)
  assert not worker._thread.is_alive()

  # the learner fails mid-run: leaving the with block stops the worker
  with pytest.raises(KeyError):
    with RolloutWorker(_generate, _ring(3)) as worker:
      _drive(worker, _initial(), 2)
      raise KeyError("learner failed")
  worker._thread.join(WAIT_S)
  assert not worker._thread.is_alive()


def test_resume_mid_pipeline_regenerates_in_flight_batches():
  """A crash with batches in flight, then a resume from the checkpointed ring: the in-flight
  batches are generated again and the run equals an uninterrupted one bit for bit."""
  k, steps, crash_at = 3, 10, 6
  generated = []

  def generate(j, version, params):
    generated.append(j)
    return _generate(j, version, params)

  worker = RolloutWorker(generate, _ring(k), stop_batch=steps)
  first, params = _drive(worker, _initial(), crash_at)
  # checkpoint: the learner's parameters and the ring's versions v - k .. v (deep copies:
  # what a restore returns), as `run.async_rollouts` saves them
  saved_params = params.copy()
  saved_ring = {v: copy.deepcopy(worker._ring.get(v)) for v in worker._ring.versions}
  _wait_until(lambda: worker._queue.qsize() == k + 1, "batches 6..9 in flight")
  worker.close(timeout=WAIT_S)  # the crash: the queued batches are lost

  ring = WeightRing(max_staleness=k)
  for v in sorted(saved_ring):  # refilled in order, as the trainer does
    ring.put(v, saved_ring[v])
  assert ring.latest_version == crash_at and ring.versions == (3, 4, 5, 6)
  with RolloutWorker(generate, ring, stop_batch=steps) as resumed:
    assert resumed.next_batch == crash_at
    second, params = _drive(resumed, saved_params, steps - crash_at)
  assert sorted(j for j in generated if generated.count(j) == 2) == [6, 6, 7, 7, 8, 8, 9, 9]
  want_batches, want_params = _reference(k, steps)
  received = first + second
  assert [r.version for r in received] == [max(0, j - k) for j in range(steps)]
  for r, want in zip(received, want_batches, strict=True):
    np.testing.assert_array_equal(r.value, want)
  np.testing.assert_array_equal(params, want_params)


def test_misuse_fails_at_once_instead_of_waiting():
  worker = RolloutWorker(_generate, _ring(1), stop_batch=2)
  try:
    rollout = worker.next(timeout=WAIT_S)
    with pytest.raises(ValueError, match="latest published version is 0: publish the update"):
      worker.next(timeout=WAIT_S)  # batch 1 before the update of batch 0 is published
    assert worker.publish(_update(_initial(), rollout.value)) == 1
    with pytest.raises(ValueError, match="publishing version 2 needs batch 1 received first"):
      worker.publish(_initial())
    worker.publish(_update(_initial(), worker.next(timeout=WAIT_S).value))
    with pytest.raises(ValueError, match="batch 2 is past stop_batch=2"):
      worker.next(timeout=WAIT_S)
    worker._thread.join(WAIT_S)
    assert not worker._thread.is_alive()  # it stopped after batch 1 by itself
  finally:
    worker.close(timeout=WAIT_S)
  with pytest.raises(ValueError, match="put version 0 first"):
    RolloutWorker(_generate, WeightRing(max_staleness=1))
