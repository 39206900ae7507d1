"""NVFP4 / MXFP4 quantization against the spec: golden examples, a NumPy reference, modes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.fp4 import reference
from trace_jax import fp4


def _row(*blocks, block=16):
  """A 1-row tensor made of blocks given by their leading elements (rest zero)."""
  row = np.zeros(len(blocks) * block, np.float32)
  for i, lead in enumerate(blocks):
    row[i * block : i * block + len(lead)] = lead
  return jnp.asarray(row[None])


# --- Golden examples, derived by hand from DESIGN.md section 1 -------------------------


def test_golden_nvfp4_tie_scale_saturates():
  # Block 1 holds the tensor amax 2688 = 448 * 6, so gs = 2688 / 2688 = 1 exactly and
  # its scale is 2688 / 6 = 448 (E4M3 0x7E). Block 0 has amax 1.59375: ideal scale
  # 1.59375 / 6 = 0.265625, the exact midpoint of E4M3 0.25 (0x28: exponent field 5, even mantissa) and
  # 0.28125 (0x29): ties go to even, 0.25. Then 1.59375 / 0.25 = 6.375 saturates to 6.
  x = _row([1.59375, -0.8, 0.3, 0.125], [2688.0, 1000.0, -1120.0, 224.0])
  q = fp4.quantize(x)
  np.testing.assert_array_equal(q.global_scale, [[1.0]])
  np.testing.assert_array_equal(q.scales, [[0x28, 0x7E]])
  codes = np.asarray(fp4.codes(q))[0]
  # v = x / 0.25 = 6.375 -> 6 (7); -3.2 -> -3 (8|5); 1.2 -> 1 (2); 0.5 -> 0.5 (1)
  np.testing.assert_array_equal(codes[:4], [7, 13, 2, 1])
  # v = x / 448 = 6 (7); 2.23 -> 2 (4); -2.5 ties to even 2 (8|4); 0.5 (1)
  np.testing.assert_array_equal(codes[16:20], [7, 4, 12, 1])
  assert not codes[4:16].any() and not codes[20:].any()
  np.testing.assert_array_equal(
    np.asarray(fp4.dequantize(q))[0, [0, 1, 2, 3, 16, 17, 18, 19]],
    [1.5, -0.75, 0.25, 0.125, 2688.0, 896.0, -896.0, 224.0],
  )


def test_golden_nvfp4_huge_value_flushes_small_blocks():
  # amax 1e6: gs = 2688 / 1e6, block 0 scale = min(1e6 / 6 * gs, 448) -> 448.
  # Block 1 (amax 1.0): 1 / 6 * 0.002688 = 0.000448, below half the smallest E4M3
  # subnormal (2^-10 = 0.000977), so its scale is 0 and the whole block is 0.
  x = _row([1e6, 1000.0, -3e5, 5e5], [1.0, 0.5, -0.25])
  q = fp4.quantize(x)
  np.testing.assert_allclose(q.global_scale, [[2688.0 / 1e6]], rtol=1e-7)
  np.testing.assert_array_equal(q.scales, [[0x7E, 0x00]])
  codes = np.asarray(fp4.codes(q))[0]
  # step = 448 / gs = 1e6 / 6: v = 6 (7), 0.006 -> 0, -1.8 -> -2 (12), 3 (5)
  np.testing.assert_array_equal(codes[:4], [7, 0, 12, 5])
  assert not codes[16:].any()
  x_hat = np.asarray(fp4.dequantize(q))[0]
  np.testing.assert_allclose(x_hat[:4], [1e6, 0.0, -1e6 / 3, 5e5], rtol=1e-6)
  assert not x_hat[16:].any()


def test_golden_nvfp4_all_zero_block_and_all_zero_tensor():
  q = fp4.quantize(_row([2688.0], []))
  np.testing.assert_array_equal(q.scales, [[0x7E, 0x00]])
  assert not np.asarray(fp4.codes(q))[0, 16:].any()
  q0 = fp4.quantize(jnp.zeros((2, 32)))
  np.testing.assert_array_equal(q0.global_scale, [[1.0]])
  assert not np.asarray(q0.scales).any() and not np.asarray(q0.packed).any()
  assert not np.asarray(fp4.dequantize(q0)).any()


def test_golden_nvfp4_subnormal_block_scale():
  # gs = 1 (tensor amax 2688). Block 0 amax 0.03: ideal scale 0.005 = 2.56 * 2^-9, an
  # E4M3 subnormal, rounds to 3 * 2^-9 = 0.005859375 (0x03).
  x = _row([0.03, 0.01, -0.02], [2688.0])
  q = fp4.quantize(x)
  np.testing.assert_array_equal(q.scales, [[0x03, 0x7E]])
  # v = 5.12 -> 6 (7); 1.7067 -> 1.5 (3); -3.413 -> -3 (13)
  np.testing.assert_array_equal(np.asarray(fp4.codes(q))[0, :3], [7, 3, 13])
  np.testing.assert_array_equal(
    np.asarray(fp4.dequantize(q))[0, :3], [0.03515625, 0.0087890625, -0.017578125]
  )


def test_golden_mxfp4():
  # Block 0: amax 7.5 = 1.875 * 2^2, mantissa above 1.5: exponent 2 - 2 = 0, scale 1,
  #   7.5 and 6.5 saturate to 6; 2.5 ties to 2 (even); -0.25 ties to 0; 0.75 ties to 1.
  # Block 1: amax 8 = 2^3 exactly: exponent 1, scale 2: 8 -> 4 (6), 3 -> 1.5 (3),
  #   -1 -> -0.5 (9), 7 -> 3.5 ties to 4 (6).
  # Block 2: all zero: exponent clamps to -127 (E8M0 0x00), codes 0.
  x = _row([7.5, 6.5, 2.5, -0.25, 0.75], [8.0, 3.0, -1.0, 7.0], [], block=32)
  q = fp4.quantize(x, "mxfp4")
  np.testing.assert_array_equal(q.scales, [[127, 128, 0]])
  np.testing.assert_array_equal(q.global_scale, [[1.0]])
  codes = np.asarray(fp4.codes(q))[0]
  np.testing.assert_array_equal(codes[:5], [7, 7, 4, 0, 2])
  np.testing.assert_array_equal(codes[32:36], [6, 3, 9, 6])
  assert not codes[64:].any()
  np.testing.assert_array_equal(
    np.asarray(fp4.dequantize(q))[0, [0, 2, 4, 32, 33, 34, 35]],
    [6.0, 2.0, 1.0, 8.0, 3.0, -1.0, 8.0],
  )


# --- Against the NumPy reference on random tensors -------------------------------------


def _random(rng, shape, kind):
  if kind == "gaussian":
    return rng.standard_normal(shape).astype(np.float32)
  if kind == "heavy":
    return rng.standard_t(2, shape).astype(np.float32)
  x = rng.standard_normal(shape).astype(np.float32)
  x.flat[rng.choice(x.size, 5, replace=False)] *= 300.0  # outliers
  return x


@pytest.mark.parametrize("kind", ["gaussian", "heavy", "outliers"])
@pytest.mark.parametrize("global_group", ["tensor", "row"])
def test_nvfp4_matches_reference_bit_for_bit(kind, global_group):
  rng = np.random.default_rng(10)
  x = _random(rng, (6, 8, 64), kind)
  q = fp4.quantize(jnp.asarray(x), global_group=global_group)
  group_axes = () if global_group == "tensor" else (0, 1)
  codes, scale_bits, gs = reference.nvfp4(x, group_axes)
  np.testing.assert_array_equal(fp4.codes(q), codes)
  np.testing.assert_array_equal(q.scales, scale_bits)
  np.testing.assert_array_equal(q.global_scale, gs)
  # NumPy divides truly (a jnp division by a broadcast would be a reciprocal multiply).
  expected = (
    reference.e2m1_values(codes).reshape(6, 8, 4, 16)
    * (np.asarray(fp4.e4m3_decode(jnp.asarray(scale_bits))) / gs)[..., None]
  )
  np.testing.assert_array_equal(fp4.dequantize(q), np.asarray(expected).reshape(x.shape))


def test_nvfp4_per_expert_global_scale_on_a_middle_axis():
  # Stacked expert weights [E, K, N] quantized along K (axis 1), one global scale per expert.
  rng = np.random.default_rng(11)
  w = rng.standard_normal((3, 32, 5)).astype(np.float32) * np.asarray([1, 10, 100])[:, None, None]
  q = fp4.quantize(jnp.asarray(w), axis=1, global_group=0)
  assert q.packed.shape == (3, 16, 5) and q.scales.shape == (3, 2, 5)
  assert q.global_scale.shape == (3, 1, 1) and q.axis == -2
  codes, scale_bits, gs = reference.nvfp4(np.moveaxis(w, 1, -1), group_axes=(0,))
  np.testing.assert_array_equal(np.moveaxis(np.asarray(fp4.codes(q)), 1, -1), codes)
  np.testing.assert_array_equal(np.moveaxis(np.asarray(q.scales), 1, -1), scale_bits)
  np.testing.assert_array_equal(q.global_scale.reshape(3), gs.reshape(3))


@pytest.mark.parametrize("kind", ["gaussian", "heavy", "outliers"])
def test_mxfp4_matches_reference_bit_for_bit(kind):
  rng = np.random.default_rng(12)
  x = _random(rng, (16, 96), kind)
  q = fp4.quantize(jnp.asarray(x), "mxfp4")
  codes, scale_bits = reference.mxfp4(x)
  np.testing.assert_array_equal(fp4.codes(q), codes)
  np.testing.assert_array_equal(q.scales, scale_bits)


def test_row_groups_equal_quantizing_each_row_alone():
  rng = np.random.default_rng(13)
  x = jnp.asarray(rng.standard_normal((5, 48)).astype(np.float32) * np.arange(1, 6)[:, None])
  q = fp4.quantize(x, global_group="row")
  assert q.global_scale.shape == (5, 1)
  for i in range(5):
    qi = fp4.quantize(x[i])
    np.testing.assert_array_equal(q.packed[i], qi.packed)
    np.testing.assert_array_equal(q.scales[i], qi.scales)
    np.testing.assert_array_equal(q.global_scale[i], qi.global_scale)


def test_codes_and_dequantize_agree_with_ml_dtypes_values():
  rng = np.random.default_rng(14)
  x = jnp.asarray(rng.standard_normal((4, 64)).astype(np.float32))
  for fmt in ("nvfp4", "mxfp4"):
    q = fp4.quantize(x, fmt, global_group="row")
    block = q.format.block_size
    step = np.asarray(q.format.decode_scales(q.scales)) / np.asarray(q.global_scale)
    expected = reference.e2m1_values(np.asarray(fp4.codes(q))) * np.repeat(
      np.asarray(step), block, -1
    )
    np.testing.assert_array_equal(fp4.dequantize(q), expected)
    assert fp4.dequantize(q, jnp.bfloat16).dtype == jnp.bfloat16


def test_mantissa_bits_are_the_code_lowest_bits():
  rng = np.random.default_rng(15)
  q = fp4.quantize(jnp.asarray(rng.standard_normal((3, 32)).astype(np.float32)))
  bits = np.unpackbits(np.asarray(fp4.mantissa_bits(q)), axis=-1, bitorder="little")
  np.testing.assert_array_equal(bits, np.asarray(fp4.codes(q)) & 1)
  g = fp4.compact_guidance(q)
  assert g.nbytes == 3 * 4 + 3 * 2 + 4 and q.nbytes == 3 * 16 + 3 * 2 + 4


# --- Non-finite input -------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_non_finite_row_dequantizes_to_nan_and_leaves_other_rows(bad, fmt):
  rng = np.random.default_rng(16)
  x = rng.standard_normal((4, 64)).astype(np.float32)
  x[2, 7] = bad
  q = fp4.quantize(jnp.asarray(x), fmt, global_group="row")
  x_hat = np.asarray(fp4.dequantize(q))
  assert np.isnan(x_hat[2]).all()
  clean = fp4.dequantize(fp4.quantize(jnp.asarray(x[[0, 1, 3]]), fmt, global_group="row"))
  np.testing.assert_array_equal(x_hat[[0, 1, 3]], clean)
  whole = np.asarray(fp4.dequantize(fp4.quantize(jnp.asarray(x), fmt)))
  assert np.isnan(whole).all()


# --- Stochastic rounding ----------------------------------------------------------------


def _unit_step_tensor(rng, rows):
  """Rows whose every block contains 6.0 and whose amax is 6: gs = 448, s_b = 448, step 1."""
  x = rng.uniform(-6, 6, (rows, 32)).astype(np.float32)
  x[:, 0] = 6.0
  x[:, 16] = -6.0
  return jnp.asarray(x)


def test_stochastic_rounding_is_unbiased_and_stays_on_neighbours():
  rng = np.random.default_rng(17)
  x = _unit_step_tensor(rng, 4)
  q_near = fp4.quantize(x)
  np.testing.assert_array_equal(q_near.scales, np.full((4, 2), 0x7E))
  samples = 4000
  keys = jax.random.split(jax.random.key(0), samples)
  draws = jax.jit(jax.vmap(lambda k: fp4.fake_quant(x, rounding="stochastic", key=k)))(keys)
  grid = np.asarray(fp4.E2M1_GRID)
  ax = np.abs(np.asarray(x))
  lo = grid[np.searchsorted(grid, ax, side="right") - 1]
  hi = grid[np.minimum(np.searchsorted(grid, ax, side="left"), 7)]
  mags = np.abs(np.asarray(draws))
  assert np.all((mags == lo) | (mags == hi))
  assert np.all(np.sign(draws) * np.sign(x) >= 0)
  # Each draw is lo or hi: per-element variance <= (hi - lo)^2 / 4, so the mean of N
  # draws has std <= (hi - lo) / (2 sqrt(N)). Allow 5 of those (128 elements: a false
  # alarm has probability ~1e-4).
  tol = 5 * (hi - lo) / (2 * np.sqrt(samples)) + 1e-6
  assert np.all(np.abs(np.asarray(draws).mean(0) - np.asarray(x)) <= tol)
  assert not np.array_equal(draws[0], draws[1])


def test_stochastic_same_key_same_result():
  x = jax.random.normal(jax.random.key(3), (2, 32))
  a = fp4.quantize(x, rounding="stochastic", key=jax.random.key(5))
  b = fp4.quantize(x, rounding="stochastic", key=jax.random.key(5))
  np.testing.assert_array_equal(a.packed, b.packed)


def test_dequantize_refuses_fields_that_do_not_fit_together():
  """Block scales of the wrong shape used to broadcast (scaling other blocks), and a float
  `packed` array decoded as if it held codes: both are refused, naming the field, its shape
  or dtype and what is allowed; a valid QArray dequantizes as ml_dtypes decodes it."""
  import dataclasses

  rng = np.random.default_rng()
  x = jnp.asarray(rng.standard_normal((4, 64)) * 2, jnp.float32)
  q = fp4.quantize(x, global_group="row")  # packed [4, 32], scales [4, 4], global_scale [4, 1]
  # x_hat = code value * (s_b / gs), decoded by ml_dtypes
  block_scales = np.asarray(q.scales).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  step = np.repeat(block_scales / np.asarray(q.global_scale), 16, axis=-1)
  expected = reference.e2m1_values(np.asarray(fp4.codes(q))) * step
  np.testing.assert_array_equal(fp4.dequantize(q), expected)
  bad = {
    "scales": (dict(scales=q.scales[:, :1]), r"q.scales has shape \(4, 1\); .* \(4, 4\)"),
    "scales rows": (dict(scales=q.scales[:1]), r"q.scales has shape \(1, 4\)"),
    "float packed": (dict(packed=q.packed.astype(jnp.float32)), "q.packed has dtype float32"),
    "int scales": (dict(scales=q.scales.astype(jnp.int32)), "q.scales has dtype int32"),
    "global_scale": (dict(global_scale=q.global_scale[:2]), r"q.global_scale has shape \(2, 1\)"),
    "global axis": (
      dict(global_scale=jnp.ones((4, 64), jnp.float32)),
      "size 1 along the quantized axis",
    ),
  }
  for fields, message in bad.values():
    broken = dataclasses.replace(q, **fields)
    for call in (fp4.dequantize, fp4.block_scaled_values):
      with pytest.raises(ValueError, match=message):
        call(broken)
  with pytest.raises(ValueError, match="q.packed has dtype float32"):
    fp4.codes(dataclasses.replace(q, packed=q.packed.astype(jnp.float32)))
