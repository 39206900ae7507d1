"""MXFP8 E4M3 activations (W4A8) against an independent NumPy / ml_dtypes definition of the
OCP MX v1.0 rule, exact ties included; NaN rows; the straight-through gradient."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trace_jax import fp4


def reference(x: np.ndarray) -> np.ndarray:
  """OCP MX v1.0 MXFP8 (E4M3): X = 2^(floor(log2 amax) - 8) per 32 elements, elements cast
  to E4M3 by ml_dtypes (round half to even) after clipping to +-448."""
  x = np.asarray(x, np.float64)
  blocks = x.reshape(*x.shape[:-1], -1, 32)
  amax = np.abs(blocks).max(-1, keepdims=True)
  exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 8, 0)
  scale = 2.0 ** np.clip(exponent, -126, 127)
  elements = np.clip(blocks / scale, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
  return (elements.astype(np.float64) * scale).reshape(x.shape).astype(np.float32)


def _rand(seed, shape):
  k1, k2 = jax.random.split(jax.random.key(seed))
  rows = jnp.exp(3.0 * jax.random.normal(k2, (*shape[:-1], 1)))
  return np.array(rows * jax.random.normal(k1, shape), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_matches_the_ocp_definition(dtype):
  x = _rand(0, (7, 5, 96)).astype(dtype)
  got = np.asarray(jax.jit(fp4.fp8_values)(jnp.asarray(x)))
  np.testing.assert_array_equal(got, reference(np.asarray(x, np.float32)))
  # Values really are on the E4M3 grid times a power of two, not the input.
  assert not np.array_equal(got, np.asarray(x, np.float32))


def test_exact_ties_round_half_to_even_and_saturate():
  # A block with amax 256 (scale 2^0): E4M3 spacing is 1/8 in [1, 2), 16 in [128, 256).
  # Midpoints 1.0625 (-> 1.0, even) and 1.1875 (-> 1.25, even), 136 (-> 128), 152 (-> 160).
  row = np.zeros(32, np.float32)
  row[:6] = [256.0, 1.0625, 1.1875, 136.0, 152.0, -1.0625]
  # amax 500 -> scale 2^0 too (floor(log2 500) = 8): 500 saturates to 448.
  row2 = np.full(32, 3.0, np.float32)
  row2[0] = 500.0
  x = np.stack([row, row2])
  got = np.asarray(fp4.fp8_values(jnp.asarray(x)))
  np.testing.assert_array_equal(got[0, :6], [256.0, 1.0, 1.25, 128.0, 160.0, -1.0])
  assert got[1, 0] == 448.0 and got[1, 1] == 3.0
  np.testing.assert_array_equal(got, reference(x))


def test_non_finite_rows_stay_visible_and_zero_rows_stay_zero():
  x = _rand(1, (4, 64))
  x[1, 40] = np.nan
  x[2, 3] = np.inf
  x[3] = 0.0
  got = np.asarray(fp4.fp8_values(jnp.asarray(x)))
  assert np.isnan(got[1]).all() and np.isnan(got[2]).all()
  np.testing.assert_array_equal(got[0], reference(x[:1])[0])
  np.testing.assert_array_equal(got[3], np.zeros(64, np.float32))


def test_straight_through_gradient_and_bad_width():
  x = jnp.asarray(_rand(2, (3, 32)))
  grad = jax.grad(lambda v: jnp.sum(fp4.fake_quant_fp8(v) * 3.0))(x)
  np.testing.assert_array_equal(np.asarray(grad), np.full((3, 32), 3.0, np.float32))
  assert fp4.fake_quant_fp8(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="multiple of 32; got 48"):
    fp4.fp8_values(jnp.ones((2, 48)))
