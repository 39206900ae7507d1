"""Timing of jitted functions and markdown tables, for the experiments/bench_*.py scripts."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

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


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
  """A GitHub markdown table; floats printed with 4 significant digits."""

  def cell(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)

  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)
