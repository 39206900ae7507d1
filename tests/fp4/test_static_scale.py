"""NVFP4 with a given (static, calibrated) global scale, against an independent definition."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.fp4 import reference
from trace_jax import fp4

F32 = np.float32


def static_reference(x: np.ndarray, gs: np.ndarray):
  """DESIGN.md section 1 with gs given: s_b = e4m3(min(amax_b / 6 * gs, 448)),
  codes = e2m1(x / (s_b / gs)); ml_dtypes casts for both roundings."""
  blocks = x.reshape(*x.shape[:-1], -1, 16)
  amax_b = np.max(np.abs(blocks), axis=-1)
  scale = np.minimum(amax_b / F32(6) * gs, F32(448)).astype(F32).astype(ml_dtypes.float8_e4m3fn)
  step = (scale.astype(F32) / gs)[..., None]
  with np.errstate(divide="ignore", invalid="ignore"):
    v = np.where(step > 0, blocks / step, F32(0)).astype(F32)
  return reference.e2m1_codes(v).reshape(x.shape), scale.view(np.uint8)


@pytest.mark.parametrize("seed", [0, 1])
def test_static_scale_matches_the_reference_and_the_computed_one(seed):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((6, 64)) * rng.uniform(0.1, 5, (6, 1))).astype(F32)
  computed = fp4.quantize(jnp.asarray(x), global_group="row")
  again = fp4.quantize(jnp.asarray(x), global_group="row", global_scale=computed.global_scale)
  chex.assert_trees_all_equal(again, computed)
  # One static scale for all rows, from an amax above every row's: nothing saturates.
  gs = np.full((6, 1), F32(448 * 6) / F32(np.abs(x).max() * 1.7), F32)
  q = fp4.quantize(jnp.asarray(x), global_group="row", global_scale=jnp.asarray(gs))
  codes, scale_bits = static_reference(x, gs)
  np.testing.assert_array_equal(fp4.codes(q), codes)
  np.testing.assert_array_equal(q.scales, scale_bits)
  np.testing.assert_array_equal(q.global_scale, gs)
  # A scale below the data's range: block scales clip at 448 and elements saturate at 6.
  small = gs * F32(8)
  q = fp4.quantize(jnp.asarray(x), global_group="row", global_scale=jnp.asarray(small))
  codes, scale_bits = static_reference(x, small)
  np.testing.assert_array_equal(fp4.codes(q), codes)
  assert (np.asarray(q.scales) == 0x7E).any()  # 448


def test_static_scale_fake_quant_is_dequantize_and_straight_through():
  x = jax.random.normal(jax.random.key(2), (4, 32)) * 3
  gs = jnp.full((4, 1), 448 * 6 / 20.0, jnp.float32)
  values = fp4.fake_quant(x, global_group="row", global_scale=gs)
  np.testing.assert_array_equal(
    values, fp4.dequantize(fp4.quantize(x, global_group="row", global_scale=gs))
  )
  grad = jax.grad(lambda a: jnp.sum(fp4.fake_quant(a, global_group="row", global_scale=gs) * x))(x)
  np.testing.assert_array_equal(grad, x)
  with pytest.raises(ValueError, match="mxfp4"):
    fp4.quantize(x, "mxfp4", global_scale=gs)
  with pytest.raises(ValueError, match="global_scale has shape"):
    fp4.quantize(x, global_group="row", global_scale=jnp.ones((4, 32)))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, 0.0, -2.5])
def test_a_global_scale_that_is_not_finite_and_positive_is_refused(bad):
  # An Inf scale used to quantize every element to 0, a negative one to -0 and sign flips.
  rng = np.random.default_rng()
  x = (rng.standard_normal((3, 32)) * 4).astype(F32)
  gs = np.full((3, 1), F32(448 * 6) / F32(np.abs(x).max()), F32)
  gs[1, 0] = bad
  for call in (fp4.quantize, fp4.fake_quant):
    with pytest.raises(ValueError, match=r"global_scale holds \[.*\] \(first at index \(1, 0\)\)"):
      call(jnp.asarray(x), global_group="row", global_scale=jnp.asarray(gs))
  with pytest.raises(ValueError, match="must be finite and > 0"):
    fp4.quantize(jnp.asarray(x), global_group="row", global_scale=gs)  # numpy, concrete
  # concrete inside jit (a NumPy constant of the traced function): still checked
  with pytest.raises(ValueError, match="must be finite and > 0"):
    jax.jit(lambda a: fp4.quantize(a, global_group="row", global_scale=gs))(x)
  # the valid rows as they are: unchanged, against the reference
  good = np.delete(gs, 1, axis=0)
  q = fp4.quantize(jnp.asarray(x[[0, 2]]), global_group="row", global_scale=jnp.asarray(good))
  codes, scale_bits = static_reference(x[[0, 2]], good)
  np.testing.assert_array_equal(fp4.codes(q), codes)
  np.testing.assert_array_equal(q.scales, scale_bits)


def test_a_traced_global_scale_is_not_read():
  # Under jit a traced scale's values are unknown: no refusal, the same result as eager.
  rng = np.random.default_rng()
  x = (rng.standard_normal((2, 32)) * 3).astype(F32)
  gs = np.full((2, 1), F32(448 * 6) / F32(np.abs(x).max() * 1.3), F32)
  jitted = jax.jit(lambda a, g: fp4.quantize(a, global_group="row", global_scale=g))
  chex.assert_trees_all_equal(
    jitted(x, gs), fp4.quantize(jnp.asarray(x), global_group="row", global_scale=gs)
  )
  codes, _ = static_reference(x, gs)
  np.testing.assert_array_equal(fp4.codes(jitted(x, gs)), codes)
  with pytest.raises(ValueError, match="global_scale must be a real"):
    fp4.quantize(jnp.asarray(x), global_group="row", global_scale=np.ones((2, 1), bool))
