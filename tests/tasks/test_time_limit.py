"""tasks.time_limit: a wall-clock limit on a call, on the main thread and on a worker."""

import threading
import time

from trace_jax.tasks import time_limit


def _spin(seconds: float, swallow: bool = False) -> str:
  """Busy Python code for `seconds`; swallow: catches everything, as a bare except would."""
  end = time.monotonic() + seconds
  while time.monotonic() < end:
    try:
      sum(range(1000))
    except BaseException:  # noqa: BLE001 - what a careless library does
      if not swallow:
        raise
    sum(range(1000))
  return "ran to its end"


def _limited(seconds: float, fn, *args):
  try:
    return time_limit.call(seconds, fn, *args)
  except time_limit.TimeLimitExceeded:
    return "stopped"


def _on_a_worker(fn, *args):
  out = {}
  thread = threading.Thread(target=lambda: out.setdefault("value", fn(*args)))
  thread.start()
  thread.join(timeout=60)
  assert not thread.is_alive()
  return out["value"]


def test_a_call_past_its_limit_is_stopped_on_the_main_thread():
  assert _limited(0.05, _spin, 30) == "stopped"
  assert _limited(30, _spin, 0.01) == "ran to its end"
  assert _limited(0.05, _spin, 30, True) == "stopped"  # raised again until it is left
  _spin(0.5)  # nothing is left armed


def test_a_call_past_its_limit_is_stopped_on_a_worker_thread():
  assert _on_a_worker(_limited, 0.05, _spin, 30) == "stopped"
  assert _on_a_worker(_limited, 30, _spin, 0.01) == "ran to its end"
  assert _on_a_worker(_limited, 0.05, _spin, 30, True) == "stopped"
  assert _on_a_worker(_spin, 0.5) == "ran to its end"


def test_many_short_calls_leave_nothing_behind():
  def calls():
    for _ in range(2000):
      try:  # each may reach its limit as it returns, or on a loaded machine while it runs
        time_limit.call(0.001, int, "1")
      except time_limit.TimeLimitExceeded:
        pass
    return _spin(0.5)  # no alarm of theirs is left to interrupt it

  assert calls() == "ran to its end"
  assert _on_a_worker(calls) == "ran to its end"


def test_an_inner_call_runs_under_the_outer_limit():
  assert _limited(0.05, time_limit.call, 30, _spin, 30) == "stopped"
  assert time_limit.call(30, time_limit.call, 0.01, _spin, 0.2) == "ran to its end"
