"""The private JAX hooks of `trace_jax._jax_private` on the installed JAX: each one exists
and does what trace_jax uses it for. A JAX upgrade that moves or changes one fails here,
by name, rather than as a wrong division deep inside a kernel lowering."""

import importlib.metadata
import os
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from trace_jax import _jax_private
from trace_jax.fp4 import numerics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_installed_jax_is_a_verified_version():
  version = tuple(int(p) for p in jax.__version__.split(".")[:2])
  assert version in _jax_private.TESTED_JAX, (
    f"jax {jax.__version__} is not a version whose internals trace_jax/_jax_private.py was "
    f"verified with ({_jax_private.TESTED_JAX}): run this file, check each hook, then update "
    "TESTED_JAX and the jax bound in pyproject.toml"
  )


def _requirements(extra: str | None = None) -> dict:
  """{distribution name: its specifier} of pyproject.toml's runtime dependencies (or of
  the optional dependencies `extra`)."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  dependencies = project["optional-dependencies"][extra] if extra else project["dependencies"]
  requirements = [Requirement(d) for d in dependencies]
  return {canonicalize_name(r.name): r.specifier for r in requirements}


def test_pyproject_bounds_jax_to_the_verified_minors():
  """A fresh install gets a JAX whose internals were verified: from the oldest verified
  minor's release the suite runs on, below the minor after the newest verified one."""
  spec = _requirements()["jax"]
  lowest, newest = min(_jax_private.TESTED_JAX), max(_jax_private.TESTED_JAX)
  lower = [s for s in spec if s.operator == ">="]
  upper = [s for s in spec if s.operator == "<"]
  assert len(lower) == 1 and len(upper) == 1, spec
  assert Version(lower[0].version).release[:2] == lowest, spec
  assert Version(upper[0].version).release[:2] == (newest[0], newest[1] + 1), spec
  # Every minor in between was verified (none skipped).
  assert [m for _, m in sorted(_jax_private.TESTED_JAX)] == list(range(lowest[1], newest[1] + 1))


def test_installed_versions_lie_within_pyproject_bounds():
  """The suite runs on versions pyproject.toml admits (its lower bounds are this suite's)."""
  bounded = {**_requirements(), "chex": _requirements("dev")["chex"]}  # chex: the tests'
  for name in ("jax", "flax", "orbax-checkpoint", "optax", "chex", "ml-dtypes"):
    spec = bounded[name]
    assert str(spec), f"{name} is unbounded in pyproject.toml"
    installed = importlib.metadata.version(name)
    assert spec.contains(installed, prereleases=True), (name, installed, str(spec))


def test_eager_true_divide_runs_through_apply_primitive():
  # Eager (no jit): the primitive's impl is _jax_private.apply_primitive.
  a = np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32)
  b = np.random.default_rng(1).uniform(0.5, 3.0, size=(5, 7)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(numerics.true_divide(a, b)), a / b)  # numpy divides


def test_primitive_is_the_public_extend_class():
  import jax.extend.core

  assert _jax_private.Primitive is jax.extend.core.Primitive


def test_triton_lowering_rule_emits_an_inline_div_rn():
  from trace_jax.kernels import triton_divide  # registers the Pallas Triton lowering

  assert numerics.true_divide_p in _jax_private.pallas_triton().lowering_rules

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = numerics.true_divide(a_ref[...], b_ref[...])

  def f(a, b):
    return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
      compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1),
    )(a, b)

  from trace_jax.kernels import cuda_lowering  # reads the module back through the hooks

  lowered = cuda_lowering.lower(f, jnp.ones((16, 16)), jnp.ones((16, 16)))
  calls = cuda_lowering.triton_calls(lowered)
  assert len(calls) == 1
  text = calls[0].ttir_text()
  assert "tt.elementwise_inline_asm" in text and triton_divide.DIV_RN_F32 in text, text
  assert "arith.divf" not in text and "precise_divf" not in text, text


def test_gpu_xla_lowering_divides_in_float64():
  """The primitive's XLA lowering for CUDA (the `hlo` hook): float64, one rounding."""
  a = np.float32([1.0, 2.0, 3.0])
  text = jax.jit(numerics.true_divide).trace(a, a).lower(lowering_platforms=("cuda",)).as_text()
  assert "xf64>" in text and "stablehlo.divide" in text, text
  np.testing.assert_array_equal(numerics.true_divide_via_f64(a, np.float32(3)), a / np.float32(3))
