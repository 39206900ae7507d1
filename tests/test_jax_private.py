"""The private JAX hooks of `trace_jax._jax_private` on the installed JAX: each one exists
and does what trace_jax uses it for. A JAX upgrade that moves or changes one fails here,
by name, rather than as a wrong division deep inside a kernel lowering."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from trace_jax import _jax_private
from trace_jax.fp4 import numerics


def test_installed_jax_is_the_verified_version():
  version = tuple(int(p) for p in jax.__version__.split(".")[:2])
  assert version == _jax_private.TESTED_JAX, (
    f"jax {jax.__version__} is not the version whose internals trace_jax/_jax_private.py was "
    f"verified with ({_jax_private.TESTED_JAX}): run this file, check each hook, then update "
    "TESTED_JAX"
  )


def test_eager_true_divide_runs_through_apply_primitive():
  # Eager (no jit): the primitive's impl is _jax_private.apply_primitive.
  a = np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32)
  b = np.random.default_rng(1).uniform(0.5, 3.0, size=(5, 7)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(numerics.true_divide(a, b)), a / b)  # numpy divides


def test_triton_lowering_rule_emits_precise_division():
  assert numerics._ieee_div_p in _jax_private.triton_lowering_rules  # noqa: SLF001

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
  assert "tt.precise_divf" in text and "arith.divf" not in text, text
