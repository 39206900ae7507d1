"""Guided rounding (DESIGN.md section 3): recorded scales, mantissa bits or codes."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.fp4 import reference
from trace_jax import fp4

GRID = np.asarray(fp4.E2M1_GRID, np.float32)


def _neighbour_codes(magnitude):
  """Independent bracket: lo = largest grid code <= |v|, hi = smallest >= |v| (clamped)."""
  magnitude = np.minimum(magnitude, 6.0)
  lo = np.searchsorted(GRID, magnitude, side="right") - 1
  hi = np.searchsorted(GRID, magnitude, side="left")
  return lo.astype(np.uint8), hi.astype(np.uint8)


def _step(q):
  block = q.format.block_size
  step = np.asarray(q.format.decode_scales(q.scales)) / np.asarray(q.global_scale)  # true division
  return np.repeat(step, block, -1)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_guidance_reproduces_codes_when_values_stay_between_the_same_neighbours(fmt):
  rng = np.random.default_rng(20)
  x = rng.standard_normal((8, 64)).astype(np.float32)
  q_ref = fp4.quantize(jnp.asarray(x), fmt, global_group="row")
  step = _step(q_ref)
  v = x / step
  lo, hi = _neighbour_codes(np.abs(v))
  u = rng.uniform(0.02, 0.98, x.shape).astype(np.float32)
  moved = GRID[lo] + u * (GRID[hi] - GRID[lo])
  x_new = np.where(lo < hi, np.sign(x) * moved * step, x).astype(np.float32)
  lo_new, hi_new = _neighbour_codes(np.abs(x_new / step))
  assert np.array_equal(lo_new, lo) and np.array_equal(hi_new, hi)  # construction holds

  ref_codes = np.asarray(fp4.codes(q_ref))
  for guidance in (q_ref, fp4.compact_guidance(q_ref)):
    q, fell_back = fp4.quantize_with_fallbacks(
      jnp.asarray(x_new), fmt, rounding="guided", guidance=guidance
    )
    np.testing.assert_array_equal(fp4.codes(q), ref_codes)
    np.testing.assert_array_equal(q.scales, q_ref.scales)
    np.testing.assert_array_equal(q.global_scale, q_ref.global_scale)
    assert not np.asarray(fell_back).any()
  # Nearest rounding of the moved values, even with the same scales, does not.
  nearest_codes = reference.e2m1_codes(x_new / step)
  assert (nearest_codes != ref_codes).mean() > 0.2
  q_near = fp4.quantize(jnp.asarray(x_new), fmt, global_group="row")
  assert (np.asarray(fp4.codes(q_near)) != ref_codes).mean() > 0.2


def test_values_that_cross_a_neighbour_fall_back_as_designed():
  rng = np.random.default_rng(21)
  x = rng.standard_normal((8, 64)).astype(np.float32)
  q_ref = fp4.quantize(jnp.asarray(x), global_group="row")
  step = _step(q_ref)
  ref_codes = np.asarray(fp4.codes(q_ref))
  # Scale a third of the elements by 1.3 to 3x: many leave their old bracket.
  factor = np.where(rng.uniform(size=x.shape) < 0.33, rng.uniform(1.3, 3.0, x.shape), 1.0)
  x_new = (x * factor).astype(np.float32)
  v_new = x_new / step
  lo, hi = _neighbour_codes(np.abs(v_new))
  recorded = ref_codes & 7
  nearest = reference.e2m1_codes(v_new)

  q_full, fell_back = fp4.quantize_with_fallbacks(
    jnp.asarray(x_new), rounding="guided", guidance=q_ref
  )
  usable = (recorded == lo) | (recorded == hi)
  assert (~usable).sum() > 20
  np.testing.assert_array_equal(fell_back, ~usable)
  sign = np.where((x_new < 0) & (recorded != 0), 8, 0)
  expected_full = np.where(usable, recorded | sign, nearest)
  np.testing.assert_array_equal(fp4.codes(q_full), expected_full)

  q_compact, compact_fell_back = fp4.quantize_with_fallbacks(
    jnp.asarray(x_new), rounding="guided", guidance=fp4.compact_guidance(q_ref)
  )
  chosen = np.where((hi & 1) == (recorded & 1), hi, lo)
  expected_compact = chosen | np.where((x_new < 0) & (chosen != 0), 8, 0)
  np.testing.assert_array_equal(fp4.codes(q_compact), expected_compact)
  # Compact falls back only where the single neighbour (on the grid / saturated) has the
  # other lowest bit.
  np.testing.assert_array_equal(compact_fell_back, (lo == hi) & ((lo & 1) != (recorded & 1)))
  assert np.asarray(compact_fell_back).any()


def test_guided_keeps_recorded_scales_even_when_the_input_changes_scale():
  rng = np.random.default_rng(22)
  x = rng.standard_normal((4, 32)).astype(np.float32)
  q_ref = fp4.quantize(jnp.asarray(x), global_group="row")
  q = fp4.quantize(jnp.asarray(100 * x), rounding="guided", guidance=fp4.compact_guidance(q_ref))
  np.testing.assert_array_equal(q.scales, q_ref.scales)
  np.testing.assert_array_equal(q.global_scale, q_ref.global_scale)
  # 100x the values saturate against the old scales.
  assert (np.abs(np.asarray(fp4.dequantize(q))) <= np.abs(_step(q_ref)) * 6).all()


def test_guided_nan_input_row_stays_nan():
  rng = np.random.default_rng(23)
  x = rng.standard_normal((3, 32)).astype(np.float32)
  q_ref = fp4.quantize(jnp.asarray(x), global_group="row")
  x[1, 3] = np.nan
  q = fp4.quantize(jnp.asarray(x), rounding="guided", guidance=q_ref)
  x_hat = np.asarray(fp4.dequantize(q))
  assert np.isnan(x_hat[1]).all() and np.isfinite(x_hat[[0, 2]]).all()


def test_guided_rejects_mismatched_guidance():
  x = jnp.ones((4, 32))
  q_row = fp4.quantize(x, global_group="row")
  with pytest.raises(ValueError, match="needs guidance"):
    fp4.quantize(x, rounding="guided")
  with pytest.raises(ValueError, match="shape"):
    fp4.quantize(jnp.ones((4, 48)), rounding="guided", guidance=q_row)
  with pytest.raises(ValueError, match="fmt='nvfp4'"):
    fp4.quantize(jnp.ones((4, 32)), "mxfp4", rounding="guided", guidance=q_row)
  with pytest.raises(ValueError, match="axis"):
    fp4.quantize(
      jnp.ones((32, 32)),
      axis=0,
      rounding="guided",
      guidance=fp4.quantize(jnp.ones((32, 32)), global_group="row"),
    )
  with pytest.raises(ValueError, match="QArray"):
    fp4.quantize(x, rounding="guided", guidance={"scales": 1})
  with pytest.raises(ValueError, match="only used with rounding='guided'"):
    fp4.quantize(x, guidance=q_row)


def test_mantissa_bits_decide_exact_ties():
  """At an exact E2M1 midpoint nearest rounding takes the even code; compact guidance takes
  whichever neighbour has the recorded bit, ties included. bf16 inputs: block 0 holds the
  row amax 10.5 (gs = 2688 / 10.5 = 256, s_b = 448), block 1 the amax 6 * s_b / 256 for an
  E4M3 s_b that is not a power of two, so every other element, a midpoint times the step
  s_b / 256, is an exact tie."""
  rng = np.random.default_rng(24)
  rows = 256
  mids = np.asarray([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
  scales = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  scales = scales[(scales >= 2) & (scales < 448)]
  scales = scales[scales / 2.0 ** np.floor(np.log2(scales)) != 1]  # not powers of two
  s_b = np.stack([np.full(rows, 448.0), rng.choice(scales, rows)], 1)
  step = (s_b / 256).astype(np.float32)  # [rows, 2]
  x = np.zeros((rows, 2, 16), np.float32)
  x[:, :, 0] = step * 6
  x[:, :, 1:] = (
    rng.choice(mids, (rows, 2, 15)) * rng.choice([-1, 1], (rows, 2, 15)) * step[..., None]
  )
  x = jnp.asarray(x.reshape(rows, 32), jnp.bfloat16)
  v = np.asarray(x, np.float32).reshape(rows, 2, 16) / step[..., None]
  lo, hi = _neighbour_codes(np.abs(v))
  assert ((lo != hi)[:, :, 1:]).all()  # every element but the block maxima is a tie
  reciprocal = np.asarray(x, np.float32).reshape(rows, 2, 16) * (1 / step[..., None])
  assert (reference.e2m1_codes(reciprocal) != reference.e2m1_codes(v)).any()  # can fail

  q = fp4.quantize(x, global_group="row")
  np.testing.assert_array_equal(q.scales, s_b.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
  nearest = np.where((lo & 1) == 0, lo, hi)  # the even neighbour
  sign = np.where(v < 0, 8, 0)
  np.testing.assert_array_equal(np.asarray(fp4.codes(q)).reshape(rows, 2, 16) & 7, nearest)

  # Record random mantissa bits (a rollout whose values sat on either side of the tie).
  bits = rng.integers(0, 2, (rows, 2, 16)).astype(np.uint8)
  bits[:, :, 0] = 1  # the block maxima (code 7) keep their own bit
  recorded = fp4.CompactGuidance(
    global_scale=q.global_scale,
    scales=q.scales,
    mantissa_bits=fp4.pack_bits(jnp.asarray(bits.reshape(rows, 32))),
    fmt="nvfp4",
    axis=-1,
  )
  guided, fell_back = fp4.quantize_with_fallbacks(x, rounding="guided", guidance=recorded)
  chosen = np.where((hi & 1) == bits, hi, lo)
  sign = np.where(chosen != 0, sign, 0)  # zero stays +0
  np.testing.assert_array_equal(fp4.codes(guided), (chosen | sign).reshape(rows, 32))
  assert not np.asarray(fell_back).any()
  odd = ((chosen & 1) == 1)[:, :, 1:]
  assert odd.mean() > 0.3  # the bit, not round-half-to-even, decided those ties
