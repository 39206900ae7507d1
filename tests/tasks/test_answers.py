"""tasks.answers: one time limit over a score's whole math-verify call, on any thread."""

import threading
import time

import pytest

pytest.importorskip("math_verify")

import math_verify  # noqa: E402

from trace_jax.tasks import answers  # noqa: E402


def _slow_verify(*args, **kwargs):
  """A comparison that takes 10 s, then says "equal"."""
  del args, kwargs
  end = time.monotonic() + 10
  while time.monotonic() < end:
    time.sleep(0.005)
  return True


def _on_a_worker(fn, *args):
  out = {}
  thread = threading.Thread(target=lambda: out.setdefault("value", fn(*args)))
  thread.start()
  thread.join(timeout=60)
  assert not thread.is_alive()
  return out["value"]


def test_the_whole_math_verify_call_is_limited(monkeypatch):
  """Past the limit the answer is compared exactly (here: not equal), on any thread."""
  assert answers.score("#0.5", ("\\frac{1}{2}",), "math") == 1.0  # math-verify's first use
  monkeypatch.setattr(answers, "TIME_LIMIT_S", 0.2)
  monkeypatch.setattr(math_verify, "verify", _slow_verify)
  references = ("\\frac{1}{2}", "0.5", "1/2")  # one limit for all three comparisons
  assert answers.score("#0.25", references, "math") == 0.0
  assert _on_a_worker(answers.score, "#0.25", references, "math") == 0.0
  assert answers.score("#1/2", references, "math") == 1.0  # exactly equal to one


def test_a_power_is_compared_by_value_on_the_main_thread_only():
  """Off the main thread the limit cannot stop a long integer power in C: exact there."""
  assert answers.score("#1024", ("2^{10}",), "math") == 1.0
  assert answers.score("#$9^{9^{9^9}}$", ("1",), "math") == 0.0  # stopped at the limit
  assert _on_a_worker(answers.score, "#1024", ("2^{10}",), "math") == 0.0
  assert _on_a_worker(answers.score, "#0.5", ("\\frac{1}{2}",), "math") == 1.0


def test_too_slow_measures_what_costly_flags(monkeypatch):
  monkeypatch.setattr(answers, "TIME_LIMIT_S", 0.3)
  assert answers.costly("9^{9^{9^9}}") and answers.too_slow("9^{9^{9^9}}")
  assert answers.costly("2^{2^3}") and not answers.too_slow("2^{2^3}")
  assert answers.costly("10!") and not answers.too_slow("10!")
  assert not answers.costly("x^2+y^2") and not answers.costly("\\frac{1}{2}")
  # off the main thread a power is not measured (its score is exact there)
  assert _on_a_worker(answers.too_slow, "9^{9^{9^9}}") is False


def test_a_reference_is_read_whole():
  long = "so " + "x" * 5_000 + " #### 42"
  assert answers.extract_answer(long, hash_mark=False, max_chars=None) == "42"
  tail = "#### 7 " + "y" * 5_000
  assert answers.extract_answer(tail, hash_mark=False, max_chars=None).startswith("7 y")
  assert answers.extract_answer(tail) == "y" * 4_000  # a completion's last 4,000
