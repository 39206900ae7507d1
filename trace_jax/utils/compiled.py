"""A process's compiled programs against the kernel's limit on memory maps.

Each XLA:CPU executable maps its machine code as a few memory regions per compiled kernel
(about 3,500-5,000 for the programs of one small RL run), and JAX keeps every executable
its jitted functions compiled for as long as the process lives. A process that compiles
many distinct programs (a test session, a notebook or study running one architecture or
arm after another) reaches Linux's `vm.max_map_count` (65,530 by default); the next mmap
fails and XLA crashes with a segmentation fault while compiling or serializing.
`release_compiled_near_map_limit` drops JAX's compiled-program caches before that.
"""

import gc

import jax

_MAPS = "/proc/self/maps"
_LIMIT = "/proc/sys/vm/max_map_count"


def memory_map_count() -> int | None:
  """The number of memory regions this process maps (None where /proc is not readable)."""
  try:
    with open(_MAPS, "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def memory_map_limit() -> int | None:
  """The kernel's limit on a process's memory regions (None where unknown)."""
  try:
    with open(_LIMIT) as f:
      return int(f.read().strip())
  except (OSError, ValueError):
    return None


def release_compiled_near_map_limit(fraction: float = 0.5) -> bool:
  """`jax.clear_caches()` when this process maps more than `fraction` of the kernel's limit
  on memory regions, then a garbage collection (an executable held in a reference cycle
  unmaps its code only then); returns whether it did. The programs still in use compile
  again on their next call (or load from the persistent compilation cache, where one is
  set)."""
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"fraction={fraction!r}; it must lie in (0, 1]")
  count, limit = memory_map_count(), memory_map_limit()
  if count is None or limit is None or count <= fraction * limit:
    return False
  jax.clear_caches()
  gc.collect()
  return True
