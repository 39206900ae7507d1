"""Timing of jitted functions and markdown tables, for the experiments/bench_*.py scripts."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping, Sequence

import jax


def time_jitted(fn: Callable, *args, repeats: int = 10, warmup: int = 2) -> float:
  """Median wall seconds of `fn(*args)`, compiled and warmed up, results waited for."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - start)
  return statistics.median(samples)


def time_interleaved(
  fns: Mapping[str, Callable[[], object]], *, repeats: int = 10, warmup: int = 2
) -> dict[str, list[float]]:
  """Wall seconds of each `fns[name]()` (results waited for), timed round robin: every
  round calls each function once, in order, so a load that comes and goes on a shared
  machine falls on every function alike (timed one after another, a later function can
  meet another load than an earlier one). Each is called `warmup` times first.

  Returns:
    {name: [seconds of round 0, round 1, ...]}; sample i of every name is from round i, so
    per-round ratios (`median_ratio`) compare calls made moments apart.
  """
  if repeats < 1:
    raise ValueError(f"repeats={repeats} must be >= 1")
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  samples = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      samples[name].append(time.perf_counter() - start)
  return samples


def median_ratio(samples: Mapping[str, Sequence[float]], name: str, base: str) -> float:
  """The median over rounds of samples[name][i] / samples[base][i] (`time_interleaved`)."""
  return statistics.median(a / b for a, b in zip(samples[name], samples[base], strict=True))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
  """A GitHub markdown table; floats printed with 4 significant digits."""

  def cell(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)

  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)
