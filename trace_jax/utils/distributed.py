"""Multi-host runs: one process per host, joined by `jax.distributed`.

Every process runs the same program on the global mesh (`jax.devices()` is global once
initialized). What differs per process:
  - each process feeds its own shard of every global batch (`global_array`: it
    materialises only the rows its devices hold, `jax.make_array_from_callback`);
  - host-side code that needs whole arrays (decoding completions, scoring, metrics) reads
    them with `host_array`, which gathers across processes only when it must;
  - files: checkpoints go through orbax, which writes each array once across processes (a
    process writes the shards it owns, process 0 the metadata); metrics, plots and summaries
    are written by process 0 only (`is_main_process`).

Initialization, in order of precedence:
  1. flags: --coordinator_address=HOST:PORT --num_processes=N --process_id=I (all three);
  2. the environment JAX already detects (SLURM, Open MPI, Kubernetes via its env, TPU pods),
     or JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID;
  3. neither: a single process (nothing to initialize).
On CPU the collectives across processes use gloo.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")  # process counts JAX detects


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
) -> bool:
  """Join the other processes of a multi-host run; returns whether it is one.

  Must run before any other JAX call. Raises a ValueError naming what is missing when only
  some of the three flags are given, or when they are inconsistent.
  """
  given = {
    "coordinator_address": coordinator_address,
    "num_processes": num_processes,
    "process_id": process_id,
  }
  if any(v not in (None, "") for v in given.values()):
    missing = [k for k, v in given.items() if v in (None, "")]
    if missing:
      raise ValueError(
        f"multi-host flags need all of --coordinator_address, --num_processes "
        f"and --process_id; missing {missing}"
      )
    if int(num_processes) < 1 or not 0 <= int(process_id) < int(num_processes):
      raise ValueError(
        f"--process_id={process_id} must lie in [0, --num_processes={num_processes})"
      )
    if int(num_processes) == 1:
      return False
    kwargs = dict(
      coordinator_address=coordinator_address,
      num_processes=int(num_processes),
      process_id=int(process_id),
    )
  elif all(os.environ.get(k) for k in _ENV):
    kwargs = dict(
      coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
      num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
      process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
    if kwargs["num_processes"] == 1:
      return False
  elif any(int(os.environ.get(k, "1") or 1) > 1 for k in _CLUSTER_ENV):
    kwargs = {}  # JAX's own cluster detection (SLURM, Open MPI)
  else:
    return False
  # CPU collectives across processes (tests, CPU clusters); accelerators use their own.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**kwargs)
  return jax.process_count() > 1


_MAIN_PROCESS = [0]  # the process that writes (`set_main_process`)


def is_main_process() -> bool:
  """Process 0 (or `set_main_process`'s) writes metrics, plots and summaries (checkpoints:
  orbax coordinates)."""
  return jax.process_index() == _MAIN_PROCESS[0]


def set_main_process(index: int) -> None:
  """Make process `index` the one that writes (a job whose process 0 does not train:
  device groups across processes, the learner's first process)."""
  if not 0 <= index < jax.process_count():
    raise ValueError(f"process index {index} must lie in [0, {jax.process_count()})")
  _MAIN_PROCESS[0] = index


def global_array(host: np.ndarray, sharding) -> jax.Array:
  """A global array of `host` (the same value on every process) under `sharding`: each
  process transfers only the slices its own devices hold."""
  host = np.asarray(host)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def host_array(x) -> np.ndarray:
  """The whole value of `x` on this host: a plain read when this process holds all of it,
  else an all-gather across processes (every process must call it)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)
