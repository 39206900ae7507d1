"""The messages between device groups across processes (`run.remote_rollouts.GroupLink`) over
an in-memory stand-in for jax.distributed's key-value store, and the one-process rollout
side's refusal to start a second worker beside one still generating."""

import threading
import types

import pytest
from jax.errors import JaxRuntimeError

from trace_jax.run import remote_rollouts
from trace_jax.run.async_rollouts import AsyncRollouts


class FakeStore:
  """The coordination client's key-value calls GroupLink makes, in memory: a blocking get
  raises DEADLINE_EXCEEDED after its timeout, as the real client does; `broken` makes every
  call fail the way a lost coordination service does."""

  def __init__(self):
    self.values, self.broken = {}, None
    self.changed = threading.Condition()

  def _check(self):
    if self.broken:
      raise JaxRuntimeError(self.broken)

  def key_value_set_bytes(self, key, value):
    self._check()
    with self.changed:
      if key in self.values:
        raise JaxRuntimeError(f"ALREADY_EXISTS: {key}")
      self.values[key] = value
      self.changed.notify_all()

  def key_value_set(self, key, value):
    self.key_value_set_bytes(key, value)

  def key_value_delete(self, key):
    self._check()
    with self.changed:
      self.values.pop(key, None)

  def key_value_try_get(self, key):
    self._check()
    if key not in self.values:
      raise JaxRuntimeError(f"NOT_FOUND: {key}")
    return self.values[key]

  def blocking_key_value_get_bytes(self, key, timeout_ms):
    self._check()
    with self.changed:
      if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
        raise JaxRuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self.values[key]


@pytest.fixture
def store(monkeypatch):
  from jax._src import distributed as jax_distributed

  fake = FakeStore()
  monkeypatch.setattr(jax_distributed.global_state, "client", fake)
  return fake


def test_a_value_sent_is_received_once_and_deleted(store):
  sender, receiver = remote_rollouts.GroupLink(5.0), remote_rollouts.GroupLink(5.0)
  threading.Timer(0.3, lambda: sender.send("batch/3", {"tokens": [1, 2, 3]})).start()
  got = receiver.receive("batch/3", waiting="no batch", error=RuntimeError)
  assert got == {"tokens": [1, 2, 3]}
  receiver.delete("batch/3")
  assert not store.values


def test_a_wait_ends_at_its_own_timeout_and_tells_the_other_side(store):
  link = remote_rollouts.GroupLink(60.0)
  with pytest.raises(TimeoutError, match=r"learner: no end of the run within 0.5 s"):
    link.receive("done", waiting="learner: no end of the run", error=RuntimeError, timeout=0.5)
  assert (
    remote_rollouts.GroupLink(60.0).failure()
    == "learner: no end of the run within 0.5 s; the run stops"
  )


def test_the_other_sides_line_ends_a_wait_at_once(store):
  link = remote_rollouts.GroupLink(60.0)
  threading.Timer(0.3, lambda: link.fail("rollout worker (devices 0,1) failed: OSError")).start()
  with pytest.raises(remote_rollouts.LearnerError, match=r"rollout worker \(devices 0,1\) failed"):
    link.receive("batch/0", waiting="no batch", error=remote_rollouts.LearnerError)  # not 60 s
  link.fail("a second line")  # the first line said stays
  assert link.failure() == "rollout worker (devices 0,1) failed: OSError"


def test_a_lost_coordination_service_is_named_by_the_wait(store):
  link = remote_rollouts.GroupLink(60.0)
  store.broken = "UNAVAILABLE: failed to connect to all addresses"
  with pytest.raises(remote_rollouts.LearnerError) as raised:
    link.receive(
      "weights/1",
      waiting="learner (devices 4): no weights of version 1",
      error=remote_rollouts.LearnerError,
    )
  assert str(raised.value) == (
    "learner (devices 4): no weights of version 1: the job's coordination service failed: "
    "UNAVAILABLE: failed to connect to all addresses"
  )


def test_no_second_worker_while_a_closed_one_still_generates():
  rollouts = AsyncRollouts.__new__(AsyncRollouts)
  rollouts.worker = None
  rollouts._closed_worker = types.SimpleNamespace(running=True, next_batch=4)
  with pytest.raises(RuntimeError, match=r"the worker closed at step 5 is still in generate\(\)"):
    rollouts.next()
