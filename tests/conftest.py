"""Shared test setup: float32 matmuls at full precision so reference comparisons are exact,
and one XLA compilation cache per test session.

The suite is compile-bound: many tests build the same tiny policies and trace the same
functions at the same shapes in different files and xdist workers (and in subprocesses).
A persistent compilation cache in a directory made for this session lets each executable
compile once per session; the directory is removed at the end, so every session (CI's
clean clone too) starts cold and nothing leaks between runs. Set TRACE_JAX_TEST_XLA_CACHE
to a directory to keep the cache across sessions instead, or to "off" to disable it.
"""

import os
import shutil
import tempfile

_CACHE_ENV = "TRACE_JAX_TEST_XLA_CACHE"
_OWNED = "_TRACE_JAX_TEST_XLA_CACHE_OWNED"  # set by the session that made (and removes) it
if os.environ.get(_CACHE_ENV, "") != "off" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  if os.environ.get(_CACHE_ENV):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_CACHE_ENV]
  else:  # xdist workers and subprocesses inherit the controller's directory
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="trace_jax-xla-cache-")
    os.environ[_OWNED] = str(os.getpid())
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Tiny shapes run in microseconds; compiling them is the suite's cost. XLA's cheapest CPU
# backend optimisation halves that (floating-point semantics are unchanged: no fast math).
# TRACE_JAX_TEST_XLA_OPT=1 keeps XLA's default optimisation.
if os.environ.get("TRACE_JAX_TEST_XLA_OPT") != "1":
  _fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _fast).strip()

import jax  # noqa: E402 - after the cache settings, which jax reads at import
import pytest  # noqa: E402

from tests.xdist_crash import pytest_xdist_make_scheduler  # noqa: E402, F401 - a crash fails one test

jax.config.update("jax_default_matmul_precision", "highest")
if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # also when a plugin imported jax first
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
  )


# Files that run one long subprocess each: first, so that under `--dist loadfile` neither
# worker is left running one of them alone at the end of the run.
_FIRST = ("tests/test_gpu_window.py", "tests/test_notebooks.py", "tests/run/test_multihost.py")


def pytest_collection_modifyitems(items):
  """Put the long subprocess files first (a stable sort: the rest keep their order)."""
  rank = {path: i for i, path in enumerate(_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(_FIRST)))


def pytest_runtest_teardown(item):
  """A worker compiles thousands of distinct programs; JAX keeps them all, and past the
  kernel's limit on memory maps XLA segfaults. Release them before that."""
  from trace_jax.utils.compiled import release_compiled_near_map_limit  # noqa: PLC0415

  release_compiled_near_map_limit()


def pytest_unconfigure(config):
  """The session that made the cache directory removes it (not the xdist workers)."""
  if os.environ.get(_OWNED) == str(os.getpid()) and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ.get("JAX_COMPILATION_CACHE_DIR", ""), ignore_errors=True)


@pytest.fixture(scope="module")
def policy():
  """A freshly initialised tiny MoE policy (seed 0), one per test module that asks for it
  (a module may override it with its own preset)."""
  from flax import nnx  # noqa: PLC0415 - keeps collection of unrelated tests light
  from trace_jax import model as M  # noqa: PLC0415

  return M.Transformer(M.tiny(), rngs=nnx.Rngs(0))
