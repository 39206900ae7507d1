"""Device time from a profiler trace: what the accelerator spent, without host overheads.

Wall time with a sync after every call puts the launch and sync latency (~0.1 ms) under
every figure, which is most of a decode kernel's time. Instead `device_time` runs a
function n times back to back under `jax.profiler`, reads the trace's device planes (one
event per kernel on the GPU's streams), and reports per-kernel durations and the busy time
of the device (the union of its kernels' intervals, so overlapping streams count once).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import tempfile
import time
from typing import Callable

import jax


@dataclasses.dataclass(frozen=True)
class DeviceTime:
  """Seconds per call of a profiled function."""

  busy: float  # the device's busy time (union of kernel intervals) per call
  wall: float  # wall time per call of the profiled loop (one sync at the end)
  kernels: dict[str, float]  # seconds per call, by kernel name (numbers stripped)
  source: str  # where the events came from ("device streams", "xla ops", "none: wall")

  def matching(self, *prefixes: str) -> float:
    """Seconds per call of the kernels whose names start with any of `prefixes`."""
    return sum(t for name, t in self.kernels.items() if name.startswith(prefixes))


def _kernel_name(name: str) -> str:
  """A kernel's name without XLA's uniquifying suffixes (fp4_gemm_3 -> fp4_gemm)."""
  base = name.split("(")[0].strip()
  while base and (base[-1].isdigit() or base[-1] in "._"):
    base = base[:-1]
  return base or name


def _events(data) -> tuple[list[tuple[str, int, int]], str]:
  """(name, start_ns, duration_ns) of the device's kernels in a `jax.profiler.ProfileData`:
  the GPU streams' events (one per kernel launch), else XLA's op line."""
  streams, ops = [], []
  for plane in data.planes:
    if not plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      events = [(e.name, int(e.start_ns), int(e.duration_ns)) for e in line.events]
      if line.name.startswith("Stream") or "stream" in line.name.lower():
        streams.extend(events)
      elif line.name == "XLA Ops":
        ops.extend(events)
  if streams:
    return streams, "device streams"
  return ops, ("xla ops" if ops else "none: wall")


def _union(intervals: list[tuple[int, int]]) -> int:
  total, end = 0, None
  for start, stop in sorted(intervals):
    if end is None or start > end:
      total += stop - start
      end = stop
    elif stop > end:
      total += stop - end
      end = stop
  return total


def device_time(fn: Callable, *args, calls: int = 10, warmup: int = 2) -> DeviceTime:
  """Profile `calls` back-to-back calls of `fn(*args)` (after `warmup`, which compiles)."""
  return _profile(lambda _: fn(*args), None, calls, warmup)


def device_time_carried(step: Callable, state, *, calls: int = 10, warmup: int = 2) -> DeviceTime:
  """Profile `calls` steps state = step(state) (a decode step that donates its cache and
  gets the updated one back: no copy of the cache per call)."""
  return _profile(step, state, calls, warmup)


def _profile(step, state, calls, warmup) -> DeviceTime:
  for _ in range(warmup):
    state = jax.block_until_ready(step(state))
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    start = time.perf_counter()
    for _ in range(calls):
      state = step(state)
    jax.block_until_ready(state)
    wall = (time.perf_counter() - start) / calls
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(files[0]) if files else None
  return summarize(data, calls, wall)


def summarize(data, calls: int, wall: float) -> DeviceTime:
  """A `DeviceTime` per call from a profile of `calls` calls (None: no profile)."""
  events, source = _events(data) if data is not None else ([], "none: wall")
  if not events:
    return DeviceTime(busy=wall, wall=wall, kernels={}, source="none: wall")
  kernels = collections.Counter()
  for name, _, duration in events:
    kernels[_kernel_name(name)] += duration * 1e-9 / calls
  busy = _union([(start, start + duration) for _, start, duration in events]) * 1e-9 / calls
  return DeviceTime(busy=busy, wall=wall, kernels=dict(kernels), source=source)
