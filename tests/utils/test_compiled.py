"""utils.compiled: the process's memory maps, and JAX's compiled programs released before
the kernel's limit on them is reached."""

import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.utils import compiled

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _compile_distinct_programs(n: int) -> list:
  """n programs that no cache shares (a fresh constant each), each called once."""
  outs = []
  for i in np.random.default_rng().integers(1, 1 << 30, n):
    fn = jax.jit(lambda x, i=int(i): jnp.sin(x) * i + jnp.cos(x * i))
    outs.append(fn(jnp.ones((4,))))
  return outs


@linux
def test_the_count_is_the_maps_file_and_grows_with_compiled_programs():
  with open("/proc/self/maps") as f:
    before_lines = len(f.readlines())
  before = compiled.memory_map_count()
  assert abs(before - before_lines) < 16  # the same file, read a moment apart
  _compile_distinct_programs(8)
  assert compiled.memory_map_count() > before
  with open("/proc/sys/vm/max_map_count") as f:
    assert compiled.memory_map_limit() == int(f.read())


@linux
def test_release_clears_the_caches_only_past_the_fraction(monkeypatch):
  _compile_distinct_programs(8)
  count = compiled.memory_map_count()
  monkeypatch.setattr(compiled, "memory_map_limit", lambda: 4 * count)
  assert not compiled.release_compiled_near_map_limit(0.5)  # a quarter of the limit
  cleared = []
  monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
  monkeypatch.setattr(compiled, "memory_map_limit", lambda: count)
  assert compiled.release_compiled_near_map_limit(0.5) and cleared == [True]


@linux
def test_released_programs_give_their_maps_back(monkeypatch):
  _compile_distinct_programs(16)
  gc.collect()
  before = compiled.memory_map_count()
  monkeypatch.setattr(compiled, "memory_map_limit", lambda: 1)
  assert compiled.release_compiled_near_map_limit()
  gc.collect()
  assert compiled.memory_map_count() < before


def test_a_fraction_outside_0_1_is_refused():
  for bad in (0.0, -0.5, 1.5):
    with pytest.raises(ValueError, match=r"fraction=.*\(0, 1\]"):
      compiled.release_compiled_near_map_limit(bad)


def test_without_proc_nothing_is_released(monkeypatch):
  monkeypatch.setattr(compiled, "_MAPS", "/nonexistent/maps")
  assert compiled.memory_map_count() is None
  assert not compiled.release_compiled_near_map_limit()
