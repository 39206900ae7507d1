"""The "4over6" NVFP4 block-scale rule, against a hand derivation and an ml_dtypes reference."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trace_jax import fp4
from tests.fp4 import reference

F32 = np.float32


def test_hand_derivation():
  # One tensor, three blocks of 16. Block 0 holds the tensor amax 2688 = 448 * 6, so gs = 1.
  #  block 0: [2688, 0...]: amax -> 4 would need the scale 672, clipped to 448 (0x7E) = the
  #    standard scale: a tie, the standard scale stays; exact.
  #  block 1: [4, 3, 0...]: standard scale e4m3(4 / 6) = 0.6875 (0x33): 4 / 0.6875 = 5.82 -> 6
  #    (4.125), 3 / 0.6875 = 4.36 -> 4 (2.75): error 0.125^2 + 0.25^2. amax -> 4: scale
  #    e4m3(1) = 1 (0x38): 4 and 3 are on the grid, error 0: 4over6 takes 0x38.
  #  block 2: [6, 1, 0...]: standard scale 1 (0x38), exact. amax -> 4: scale 1.5 (0x3C),
  #    1 / 1.5 = 0.67 -> 0.5 (0.75): error 0.0625 > 0: the standard scale stays.
  x = np.zeros((1, 48), F32)
  x[0, 0] = 2688.0
  x[0, 16:18] = [4.0, 3.0]
  x[0, 32:34] = [6.0, 1.0]
  standard = fp4.quantize(jnp.asarray(x), "nvfp4")
  chosen = fp4.quantize(jnp.asarray(x), "nvfp4", scale_rule="4over6")
  np.testing.assert_array_equal(np.asarray(standard.scales), [[0x7E, 0x33, 0x38]])
  np.testing.assert_array_equal(np.asarray(chosen.scales), [[0x7E, 0x38, 0x38]])
  np.testing.assert_array_equal(np.asarray(chosen.global_scale), [[1.0]])
  np.testing.assert_array_equal(np.asarray(fp4.dequantize(standard))[0, 16:18], [4.125, 2.75])
  np.testing.assert_array_equal(np.asarray(fp4.dequantize(chosen)), x)  # all exact
  # fake_quant follows the same rule, with a straight-through gradient.
  fake = fp4.fake_quant(jnp.asarray(x), "nvfp4", scale_rule="4over6")
  np.testing.assert_array_equal(np.asarray(fake), x)
  grad = jax.grad(lambda v: jnp.sum(fp4.fake_quant(v, "nvfp4", scale_rule="4over6") * 3.0))(
    jnp.asarray(x)
  )
  np.testing.assert_array_equal(np.asarray(grad), np.full_like(x, 3.0))


def _reference_four_over_six(x):
  """Per block, reconstruct under both E4M3 scales (ml_dtypes) and keep the better one."""
  _, standard_bits, gs = reference.nvfp4(x, group_axes=(0,))
  blocks = x.reshape(x.shape[0], -1, 16)
  amax_b = np.max(np.abs(blocks), axis=-1)
  four_bits = (
    np.minimum(amax_b / F32(4) * gs, F32(448))
    .astype(F32)
    .astype(ml_dtypes.float8_e4m3fn)
    .view(np.uint8)
  )

  def error(bits):
    step = (bits.view(ml_dtypes.float8_e4m3fn).astype(F32) / gs)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
      v = np.where(step > 0, blocks / step, F32(0)).astype(F32)
    decoded = reference.e2m1_values(reference.e2m1_codes(v)) * step
    return np.sum(np.square(decoded - blocks, dtype=F32), axis=-1), decoded

  err6, dec6 = error(standard_bits)
  err4, dec4 = error(four_bits)
  take4 = err4 < err6
  return (
    np.where(take4, four_bits, standard_bits),
    np.where(take4[..., None], dec4, dec6),
    np.minimum(err4, err6),
    err6,
  )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_reference_on_random_rows(dtype):
  rng = np.random.default_rng(46)
  x = (rng.standard_normal((12, 64)) * rng.uniform(0.01, 50, (12, 1))).astype(F32)
  x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
  bits, decoded, err, err6 = _reference_four_over_six(x)
  q = fp4.quantize(jnp.asarray(x, dtype), "nvfp4", global_group="row", scale_rule="4over6")
  np.testing.assert_array_equal(np.asarray(q.scales), bits)
  chex.assert_trees_all_close(
    np.asarray(fp4.dequantize(q)), decoded.reshape(x.shape), rtol=0, atol=0
  )
  assert np.all(err <= err6)  # never worse than the standard rule, block by block
  assert np.any(err < err6)  # and some blocks do take the amax -> 4 scale on random data


def test_refusals():
  x = jnp.ones((2, 32))
  with pytest.raises(ValueError, match="scale_rule='5over6'"):
    fp4.quantize(x, "nvfp4", scale_rule="5over6")
  with pytest.raises(ValueError, match="fmt='mxfp4'"):
    fp4.quantize(x, "mxfp4", scale_rule="4over6")
  with pytest.raises(ValueError, match="rounding='stochastic'"):
    fp4.fake_quant(x, "nvfp4", rounding="stochastic", key=jax.random.key(0), scale_rule="4over6")
