"""Exact ties (DESIGN.md section 1): every division the spec writes is a true IEEE division.

XLA rewrites `a / b` with a constant or broadcast `b` into `a * (1 / b)`, up to 1 ulp off,
which flips exact ties: element values exactly at an E2M1 midpoint and ideal block scales
exactly at an E4M3 midpoint. bf16 inputs hit both often. The inputs here are built to sit
on those ties, and each construction checks (with NumPy) that a reciprocal multiply would
round some of them the other way, so these tests can fail.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tests.fp4 import reference
from trace_jax import fp4, kernels
from trace_jax.fp4 import numerics

F32 = np.float32
BF16 = ml_dtypes.bfloat16
E2M1_MIDPOINTS = np.asarray([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)


def _e4m3_values():
  values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)
  return np.unique(values[np.isfinite(values) & (values > 0)])


def _e4m3_midpoints():
  values = _e4m3_values().astype(np.float64)
  mids = ((values[:-1] + values[1:]) / 2).astype(F32)
  return mids[(mids > 2.0**-6) & (mids < 448)]  # normal range, below the clip


def _ulps(x, n):
  for _ in range(abs(n)):
    x = np.nextafter(x, F32(np.inf) if n > 0 else F32(-np.inf)).astype(F32)
  return x


def _reference_step(codes_scales_gs):
  _, scale_bits, gs = codes_scales_gs
  return (scale_bits.view(ml_dtypes.float8_e4m3fn).astype(F32) / gs)[..., None]


def _assert_matches_reference(x, group_axes=(0,)):
  """fp4.quantize(x, per row) equals the NumPy reference bit for bit, and so does decode."""
  x32 = np.asarray(x, F32)
  codes, scale_bits, gs = reference.nvfp4(x32, group_axes)
  q = fp4.quantize(jnp.asarray(x), global_group="row")
  np.testing.assert_array_equal(q.global_scale, gs)
  np.testing.assert_array_equal(q.scales, scale_bits)
  np.testing.assert_array_equal(fp4.codes(q), codes)
  step = np.repeat(_reference_step((codes, scale_bits, gs))[..., 0], 16, axis=-1)
  x_hat = reference.e2m1_values(codes) * step
  np.testing.assert_array_equal(fp4.dequantize(q), x_hat)
  np.testing.assert_array_equal(fp4.fake_quant(jnp.asarray(x32), global_group="row"), x_hat)


def test_true_divide_stays_a_division_and_is_ieee():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((256, 16)).astype(F32) * 100
  b = rng.uniform(0.1, 10, (256, 1)).astype(F32)
  text = jax.jit(numerics.true_divide).lower(a, b).compile().as_text()
  assert re.search(r"f32\[256,16\]\S* divide\(", text), text
  np.testing.assert_array_equal(numerics.true_divide(a, b), a / b)
  assert (a * (F32(1) / b) != a / b).any()  # the rewrite would have been visible here
  np.testing.assert_array_equal(numerics.true_divide(a, F32(6)), a / F32(6))
  assert (a * F32(1 / 6) != a / F32(6)).any()
  # The whole quantizer divides elementwise, not by a reciprocal.
  text = jax.jit(lambda x: fp4.quantize(x, global_group="row").packed).lower(a).compile().as_text()
  assert re.search(r"f32\[256,1,16\]\S* divide\(", text), text


def test_element_ties_at_e2m1_midpoints_round_half_to_even():
  """Float32 values at E2M1 midpoints times non-power-of-two steps."""
  rng = np.random.default_rng(1)
  rows, n = 512, 64
  row_amax = rng.uniform(1, 100, rows).astype(BF16).astype(F32)
  block_amax = (row_amax[:, None] * rng.uniform(0.05, 1, (rows, n // 16))).astype(F32)
  block_amax[:, 0] = row_amax
  x = np.zeros((rows, n // 16, 16), F32)
  x[:, :, 0] = block_amax * rng.choice([-1, 1], block_amax.shape)
  step = _reference_step(reference.nvfp4(x.reshape(rows, n), (0,)))  # [rows, nb, 1]
  m = rng.choice(E2M1_MIDPOINTS, (rows, n // 16, 15)) * rng.choice([-1, 1], (rows, n // 16, 15))
  candidates = _ulps((m * step).astype(F32), 0)
  offset = rng.integers(-1, 2, candidates.shape)
  x[:, :, 1:] = np.where(
    offset < 0, _ulps(candidates, -1), np.where(offset > 0, _ulps(candidates, 1), candidates)
  )
  x = x.reshape(rows, n)
  v = (x.reshape(rows, n // 16, 16) / step).astype(F32)
  ties = np.isin(np.abs(v), E2M1_MIDPOINTS)
  assert ties.sum() > 5000
  flipped = reference.e2m1_codes(
    x.reshape(rows, n // 16, 16) * (F32(1) / step)
  ) != reference.e2m1_codes(v)
  assert (flipped & ties).sum() > 50  # a reciprocal multiply gets these wrong
  _assert_matches_reference(x)


def _bf16_ties(rng, rows, nb):
  """bf16 rows [rows, nb * 16] whose non-max elements sit exactly at E2M1 midpoints times
  steps s_b / 256 with s_b an E4M3 value that is not a power of two. Block 0 holds the row
  amax 448 * 6 / 256 = 10.5, so gs = 2688 / 10.5 = 256 exactly and every tie is bf16-exact."""
  scales = _e4m3_values()
  scales = scales[(scales >= 2) & (scales <= 448)]
  scales = scales[(scales / 2.0 ** np.floor(np.log2(scales))) != 1]  # not powers of two
  s_b = rng.choice(scales, (rows, nb)).astype(F32)
  s_b[:, 0] = 448
  step = s_b / F32(256)
  x = np.zeros((rows, nb, 16), F32)
  x[:, :, 0] = s_b * 6 / 256 * rng.choice([-1, 1], (rows, nb))  # ideal scale exactly s_b
  m = rng.choice(E2M1_MIDPOINTS, (rows, nb, 15)) * rng.choice([-1, 1], (rows, nb, 15))
  x[:, :, 1:] = m * step[..., None]
  x = x.reshape(rows, nb * 16)
  assert np.array_equal(x.astype(BF16).astype(F32), x)  # bf16-exact
  return x


def test_bf16_element_ties():
  """bf16 values exactly at E2M1 midpoints times non-power-of-two steps."""
  rows, nb = 256, 4
  x = _bf16_ties(np.random.default_rng(2), rows, nb)
  codes, scale_bits, gs = reference.nvfp4(x, (0,))
  assert (gs == 256).all()
  ref_step = _reference_step((codes, scale_bits, gs))
  blocks = x.reshape(rows, nb, 16)
  v = blocks / ref_step
  assert np.isin(np.abs(v[..., 1:]), E2M1_MIDPOINTS).all()
  assert (reference.e2m1_codes(blocks * (F32(1) / ref_step)) != reference.e2m1_codes(v)).any()
  _assert_matches_reference(x.astype(BF16))


def test_block_scale_ties_at_e4m3_midpoints():
  """Blocks whose ideal scale amax_b / 6 * gs is exactly an E4M3 midpoint (336 lies
  between 320 and 352: ties go to the even mantissa, 320)."""
  rng = np.random.default_rng(3)
  rows, nb = 4096, 4
  row_amax = rng.uniform(0.5, 100, rows).astype(BF16).astype(F32)
  gs = (F32(2688) / row_amax).astype(F32)[:, None]
  target = rng.choice(_e4m3_midpoints(), (rows, nb)).astype(F32)
  base = ((target / gs).astype(F32) * F32(6)).astype(F32)
  block_amax = base.copy()
  for shift in (-1, 1, 2):  # the f32 neighbours that also hit the midpoint
    ideal = ((block_amax / F32(6)).astype(F32) * gs).astype(F32)
    shifted = _ulps(base, shift)
    block_amax = np.where(ideal != target, shifted, block_amax)
  ideal = ((block_amax / F32(6)).astype(F32) * gs).astype(F32)
  tie = (ideal == target) & (block_amax <= row_amax[:, None])
  block_amax = np.where(tie, block_amax, row_amax[:, None] / 3)
  x = rng.uniform(-0.5, 0.5, (rows, nb, 16)).astype(F32) * block_amax[..., None]
  x[:, :, 3] = block_amax * rng.choice([-1, 1], (rows, nb))
  x[:, 0, 7] = row_amax
  x = x.reshape(rows, nb * 16)
  assert tie.sum() > 8000
  recip = ((block_amax * F32(1 / 6)).astype(F32) * gs).astype(F32)
  assert (tie & (recip != target)).sum() > 500  # a reciprocal multiply misses these
  codes, scale_bits, _ = reference.nvfp4(x, (0,))
  decoded = scale_bits.view(ml_dtypes.float8_e4m3fn).astype(F32)
  even = (scale_bits & 1) == 0
  assert even[tie].all() and (decoded[tie] != target[tie]).all()
  _assert_matches_reference(x)


def test_bf16_rows_with_random_row_factors_match_the_spec():
  """Ties at scale: bf16 data, a random factor per row; the old reciprocal
  formulation differed from the spec in ~0.06% of codes and ~0.1% of block scales."""
  rng = np.random.default_rng(4)
  x = rng.standard_normal((4096, 128)).astype(BF16)
  x = (x.astype(F32) * rng.uniform(0.01, 100, (4096, 1)).astype(F32)).astype(BF16)
  _assert_matches_reference(x)


def test_fused_quantize_kernel_keeps_ties():
  """The Pallas quantize kernel (interpret mode) shares `fp4.tiles.quantize_rows`, so it
  holds the same ties."""
  x = _bf16_ties(np.random.default_rng(5), 128, 4).astype(BF16)
  q, bits = kernels.fused_quantize(jnp.asarray(x), interpret=True)
  codes, scale_bits, gs = reference.nvfp4(np.asarray(x, F32), (0,))
  np.testing.assert_array_equal(fp4.codes(q), codes)
  np.testing.assert_array_equal(q.scales, scale_bits)
  np.testing.assert_array_equal(q.global_scale, gs)
  np.testing.assert_array_equal(
    bits, fp4.mantissa_bits(fp4.quantize(jnp.asarray(x), global_group="row"))
  )


def test_true_divide_lowers_for_cuda_through_pallas_triton():
  """Inside a Pallas kernel lowered for CUDA, `true_divide` is Triton's precise division
  (a plain one there lowers to the approximate div.full.f32)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pl_triton
  from trace_jax import _jax_private

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = numerics.true_divide(a_ref[...], b_ref[...])

  def f(a, b):
    return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
      compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1),
    )(a, b)

  a, b = jnp.ones((16, 16)), jnp.ones((16, 1))
  text = jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  assert numerics.true_divide_p in _jax_private.pallas_triton().lowering_rules  # (kernels')
