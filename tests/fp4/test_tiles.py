"""The kernels' FP4 tile math (`fp4.tiles`) against the format's own definitions: the bf16
decode every kernel uses for weights and cache entries, and the GEMM prologue's
quantization of a row given as its even and odd elements."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax.fp4 import numerics, ties, tiles


def test_e2m1_bf16_decodes_every_code_exactly():
  codes = jnp.arange(16, dtype=jnp.uint8)
  got = np.asarray(numerics.e2m1_bf16(codes), np.float32)
  want = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
  np.testing.assert_array_equal(got, want)  # ml_dtypes' E2M1, signs and -0 -> +0 aside
  assert np.asarray(numerics.e2m1_bf16(codes)).dtype == jnp.bfloat16


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_scaled_pairs_bf16_equal_the_float32_decode_for_every_byte_and_scale(fmt):
  """Every packed byte (both nibbles) times every finite block scale: the bf16 decode is the
  exact float32 product (c * s_b has at most 6 significant bits)."""
  block = fp4.get_format(fmt).block_size
  scales = np.arange(256, dtype=np.uint8)
  if fmt == "nvfp4":
    scales = scales[(scales & 0x7F) != 0x7F]  # NaN
  else:
    scales = scales[(scales >= 100) & (scales <= 150)]  # products stay in range
  bits = jnp.broadcast_to(jnp.asarray(scales)[None], (256, len(scales)))
  packed = jnp.repeat(jnp.arange(256, dtype=jnp.uint8)[:, None], block // 2, axis=0)
  packed = jnp.broadcast_to(packed, (256 * block // 2, len(scales)))
  want = tiles.scaled_pairs(packed, bits, fmt, axis=0)
  got = tiles.scaled_pairs_bf16(packed, bits, fmt, axis=0)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantize_pairs_is_fp4_quantize(fmt):
  """The prologue's quantization of (even, odd) halves, with the row's global scale from its
  amax, gives `fp4.quantize` per row bit for bit: codes, scales, global scales, guidance
  bits, and the values the dot multiplies; on the tie oracle and on rows with a zero, a
  NaN, an Inf and a tiny element."""
  rng = np.random.default_rng(3)
  x = np.concatenate(
    [ties.tie_rows(rows=16), rng.standard_normal((4, 128)).astype(ml_dtypes.bfloat16)]
  )
  x[-4] = 0
  x[-3, 7], x[-2, 9], x[-1, 3] = np.nan, np.inf, 1e-30
  xf = jnp.asarray(x, jnp.float32)
  q = fp4.quantize(xf, fmt, global_group="row")
  finite = jnp.all(jnp.isfinite(xf), axis=-1, keepdims=True)  # (a max may drop NaN)
  amax = jnp.where(finite, jnp.max(jnp.abs(xf), axis=-1, keepdims=True), jnp.nan)
  gs = tiles.row_global_scale(amax, fmt)
  np.testing.assert_array_equal(gs, q.global_scale)
  (even, odd), scale_bits, (v_even, v_odd), packed, bits = tiles.quantize_pairs(
    xf[:, 0::2], xf[:, 1::2], gs, fmt
  )
  np.testing.assert_array_equal(packed, q.packed)
  np.testing.assert_array_equal(scale_bits, q.scales)
  np.testing.assert_array_equal(bits, fp4.mantissa_bits(q))
  np.testing.assert_array_equal(even | (odd << 4), q.packed)
  values = fp4.block_scaled_values(q)
  np.testing.assert_array_equal(np.asarray(v_even, np.float32), values[:, 0::2])
  np.testing.assert_array_equal(np.asarray(v_odd, np.float32), values[:, 1::2])
