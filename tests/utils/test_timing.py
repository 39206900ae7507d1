"""Round-robin timing (`utils.time_interleaved`): warm-up calls first, then every round calls
each function once in order; the samples are the measured wall times of those calls, and
`median_ratio` is the median of the per-round ratios."""

import statistics

import numpy as np
import pytest

from trace_jax.utils import median_ratio, time_interleaved
from trace_jax.utils import timing


def test_time_interleaved_calls_round_robin_and_times_each_call(monkeypatch):
  rng = np.random.default_rng()
  repeats, warmup = int(rng.integers(2, 6)), int(rng.integers(0, 3))
  names = [f"f{i}" for i in range(int(rng.integers(2, 5)))]
  durations = {name: rng.uniform(0.5, 2.0, repeats) for name in names}
  now = [0.0]  # a fake perf_counter: each timed call advances it by its duration
  monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
  calls = []

  def make(name):
    def fn():
      timed = calls.count(name) - warmup  # index of this timed call
      calls.append(name)
      if timed >= 0:
        now[0] += durations[name][timed]
      return None

    return fn

  samples = time_interleaved({n: make(n) for n in names}, repeats=repeats, warmup=warmup)
  assert calls == [n for n in names for _ in range(warmup)] + names * repeats
  for name in names:
    np.testing.assert_allclose(samples[name], durations[name])
  ratio = median_ratio(samples, names[1], names[0])
  expected = statistics.median(durations[names[1]] / durations[names[0]])
  assert ratio == pytest.approx(expected)


def test_time_interleaved_rejects_no_repeats():
  with pytest.raises(ValueError, match="repeats=0"):
    time_interleaved({"a": lambda: None}, repeats=0)
