"""utils.compiled: the process's memory maps, and JAX's compiled programs released before
the kernel's limit on them is reached."""

import json
import subprocess
import sys

import jax
import pytest

from trace_jax.utils import compiled

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


# In a fresh process: a warm one may place new code in regions it freed before.
_GROW_AND_RELEASE = """
import json
import jax, jax.numpy as jnp, numpy as np
from trace_jax.utils import compiled
with open("/proc/self/maps") as f:
  lines = len(f.readlines())
start = compiled.memory_map_count()
keep = []
for i in np.random.default_rng().integers(1, 1 << 30, 16):  # a fresh constant: no cache shares it
  keep.append(jax.jit(lambda x, i=int(i): jnp.sin(x) * i + jnp.cos(x * i))(jnp.ones((4,))))
grown = compiled.memory_map_count()
compiled.memory_map_limit = lambda: 1
released = compiled.release_compiled_near_map_limit()
print(json.dumps(dict(lines=lines, start=start, grown=grown, released=released,
                      after=compiled.memory_map_count())))
"""


@linux
def test_compiled_programs_add_maps_and_release_gives_them_back():
  run = subprocess.run(
    [sys.executable, "-c", _GROW_AND_RELEASE], capture_output=True, text=True, timeout=300
  )
  assert run.returncode == 0, run.stderr[-2000:]
  got = json.loads(run.stdout.strip().splitlines()[-1])
  assert abs(got["start"] - got["lines"]) < 16  # the same file, read a moment apart
  assert got["grown"] > got["start"] and got["released"]
  assert got["after"] < got["grown"]
  with open("/proc/sys/vm/max_map_count") as f:
    assert compiled.memory_map_limit() == int(f.read())


@linux
def test_release_clears_the_caches_only_past_the_fraction(monkeypatch):
  count = compiled.memory_map_count()
  monkeypatch.setattr(compiled, "memory_map_limit", lambda: 4 * count)
  assert not compiled.release_compiled_near_map_limit(0.5)  # a quarter of the limit
  cleared = []
  monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
  monkeypatch.setattr(compiled, "memory_map_limit", lambda: count)
  assert compiled.release_compiled_near_map_limit(0.5) and cleared == [True]


def test_a_fraction_outside_0_1_is_refused():
  for bad in (0.0, -0.5, 1.5):
    with pytest.raises(ValueError, match=r"fraction=.*\(0, 1\]"):
      compiled.release_compiled_near_map_limit(bad)


def test_without_proc_nothing_is_released(monkeypatch):
  monkeypatch.setattr(compiled, "_MAPS", "/nonexistent/maps")
  assert compiled.memory_map_count() is None
  assert not compiled.release_compiled_near_map_limit()
