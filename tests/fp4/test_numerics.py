"""E2M1 / E4M3 / E8M0 element and scale numerics against ml_dtypes and the format specs."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.fp4 import reference
from trace_jax import fp4
from trace_jax.fp4 import numerics


def _round_nearest_values(v):
  v = jnp.asarray(v, jnp.float32)
  magnitude = jnp.abs(v)
  code = numerics.e2m1_sign(numerics.e2m1_round_nearest(magnitude), v < 0)
  return np.asarray(code), np.asarray(fp4.e2m1_decode(code))


def test_e2m1_grid_is_the_spec_grid():
  # OCP MX v1.0 table: code -> magnitude for E2M1 (bias 1, one mantissa bit).
  spec = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
  all_codes = np.arange(16, dtype=np.uint8)
  decoded = np.asarray(fp4.e2m1_decode(jnp.asarray(all_codes)))
  np.testing.assert_array_equal(decoded[:8], spec)
  np.testing.assert_array_equal(decoded[8:], -np.asarray(spec))
  np.testing.assert_array_equal(decoded, reference.e2m1_values(all_codes))


def test_e2m1_rounding_matches_ml_dtypes_at_every_midpoint_and_neighbours():
  grid = np.asarray(fp4.E2M1_GRID, np.float32)
  points = list(grid) + list((grid[:-1] + grid[1:]) / 2) + [6.5, 7.0, 100.0, 3e38]
  values = []
  for p in np.asarray(points, np.float32):
    values += [p, np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(-np.inf))]
  values = np.asarray(values, np.float32)
  values = np.concatenate([values, -values])
  codes, decoded = _round_nearest_values(values)
  expected = values.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  np.testing.assert_array_equal(decoded, expected)
  np.testing.assert_array_equal(codes, reference.e2m1_codes(values))


def test_e2m1_rounding_random_values_match_ml_dtypes():
  rng = np.random.default_rng(0)
  values = (rng.standard_normal(20000) * rng.choice([0.3, 2.0, 8.0], 20000)).astype(np.float32)
  codes, decoded = _round_nearest_values(values)
  np.testing.assert_array_equal(decoded, values.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
  np.testing.assert_array_equal(codes, reference.e2m1_codes(values))


def test_e2m1_saturates_at_six():
  codes, decoded = _round_nearest_values([6.0, 6.01, 1e6, -1e30, -7.0])
  np.testing.assert_array_equal(decoded, [6, 6, 6, -6, -6])
  np.testing.assert_array_equal(codes, [7, 7, 7, 15, 15])


def test_neighbours_bracket_and_differ_in_lowest_bit():
  rng = np.random.default_rng(1)
  magnitude = jnp.asarray(np.abs(rng.standard_normal(5000) * 3).astype(np.float32))
  lo, hi = numerics.e2m1_neighbours(magnitude)
  lo_v, hi_v = fp4.e2m1_decode(lo), fp4.e2m1_decode(hi)
  clamped = jnp.minimum(magnitude, 6.0)
  assert bool(jnp.all(lo_v <= clamped)) and bool(jnp.all(clamped <= hi_v))
  distinct = lo != hi
  assert bool(jnp.all(jnp.where(distinct, hi == lo + 1, True)))
  assert bool(jnp.all(jnp.where(distinct, (lo & 1) != (hi & 1), True)))


def _e4m3_spec(bits: int) -> float:
  sign = -1.0 if bits & 0x80 else 1.0
  exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
  if exponent == 0xF and mantissa == 0x7:
    return float("nan")
  if exponent == 0:
    return sign * mantissa / 8 * 2.0**-6
  return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def test_all_256_e4m3_patterns_decode_per_spec():
  bits = np.arange(256, dtype=np.uint8)
  decoded = np.asarray(fp4.e4m3_decode(jnp.asarray(bits)))
  spec = np.asarray([_e4m3_spec(int(b)) for b in bits], np.float32)
  np.testing.assert_array_equal(decoded, spec)
  np.testing.assert_array_equal(decoded, bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
  assert spec[0x7E] == 448.0 and spec[0x01] == 2.0**-9


def test_all_256_e8m0_patterns_decode_per_spec():
  bits = np.arange(256, dtype=np.uint8)
  decoded = np.asarray(fp4.e8m0_decode(jnp.asarray(bits)))
  spec = np.asarray([2.0 ** (int(b) - 127) for b in bits[:255]] + [np.nan], np.float32)
  np.testing.assert_array_equal(decoded, spec)
  np.testing.assert_array_equal(decoded, bits.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))


def test_e4m3_encode_matches_ml_dtypes_including_subnormals_and_ties():
  rng = np.random.default_rng(2)
  exact = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  exact = np.abs(exact[np.isfinite(exact) & (exact >= 0)])  # +0, not -0
  ties = (np.sort(exact)[:-1] + np.sort(exact)[1:]) / 2
  random = np.exp(rng.uniform(np.log(1e-4), np.log(500.0), 5000)).astype(np.float32)
  values = np.concatenate([exact, ties.astype(np.float32), random, [0.0, 448.0, 460.0, 1e6]])
  values = values.astype(np.float32)
  bits = np.asarray(fp4.e4m3_encode(jnp.asarray(values)))
  expected = np.minimum(values, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  np.testing.assert_array_equal(bits, expected)


def test_e8m0_encode_clamps():
  exponents = jnp.asarray([-300, -127, -1, 0, 5, 127, 200])
  np.testing.assert_array_equal(
    np.asarray(fp4.e8m0_encode(exponents)), [0, 0, 126, 127, 132, 254, 254]
  )


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_pack_unpack_round_trip(axis):
  rng = np.random.default_rng(3)
  codes = jnp.asarray(rng.integers(0, 16, (8, 16, 6), dtype=np.uint8))
  packed = fp4.pack_codes(codes, axis)
  expected_shape = list(codes.shape)
  expected_shape[axis] //= 2
  assert packed.shape == tuple(expected_shape) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(fp4.unpack_codes(packed, axis), codes)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_unpack_codes_against_numpy_nibbles_every_byte(axis):
  # Every byte value, at a random place on each axis: element 2i is the low nibble, 2i + 1
  # the high one (NumPy shifts and masks, independent of the packing code).
  rng = np.random.default_rng(11)
  packed = rng.permutation(np.tile(np.arange(256, dtype=np.uint8), 6)).reshape(8, 16, 12)
  last = np.moveaxis(packed, axis, -1)
  want = np.stack([last & 0xF, last >> 4], axis=-1).reshape(*last.shape[:-1], -1)
  want = np.moveaxis(want, -1, axis)
  np.testing.assert_array_equal(fp4.unpack_codes(jnp.asarray(packed), axis), want)
  # Fused into a consumer under jit (how guided rounding reads full guidance).
  fused = jax.jit(lambda p: fp4.e2m1_decode(fp4.unpack_codes(p, axis)) * 3.0)
  np.testing.assert_array_equal(fused(jnp.asarray(packed)), np.asarray(fp4.e2m1_decode(want)) * 3)


def test_pack_codes_puts_even_elements_in_the_low_nibble():
  packed = fp4.pack_codes(jnp.asarray([0x3, 0xA, 0xF, 0x1], jnp.uint8))
  np.testing.assert_array_equal(packed, [0xA3, 0x1F])


def test_pack_bits_round_trip_and_layout():
  rng = np.random.default_rng(4)
  bits = jnp.asarray(rng.integers(0, 2, (5, 32), dtype=np.uint8))
  packed = fp4.pack_bits(bits)
  assert packed.shape == (5, 4)
  np.testing.assert_array_equal(fp4.unpack_bits(packed), bits)
  np.testing.assert_array_equal(
    fp4.pack_bits(jnp.asarray([1, 0, 0, 0, 0, 0, 0, 1], jnp.uint8)), [0x81]
  )


def test_pack_rejects_odd_lengths():
  with pytest.raises(ValueError, match="multiple of 2"):
    fp4.pack_codes(jnp.zeros((3,), jnp.uint8))
  with pytest.raises(ValueError, match="multiple of 8"):
    fp4.pack_bits(jnp.zeros((12,), jnp.uint8))


def _f32_neighbours(x, n):
  """x and its n float32 neighbours on each side."""
  bits = np.asarray(x, np.float32).view(np.int32)[..., None] + np.arange(-n, n + 1, dtype=np.int32)
  return bits.view(np.float32).reshape(-1)


def test_gpu_division_through_float64_is_ieee_float32_division():
  """What `true_divide` compiles to under XLA on a GPU (the float64 quotient rounded once,
  `numerics.true_divide_via_f64`), checked on CPU against NumPy's IEEE float32 division:
  every pair of E4M3 scales, 2688 over every positive finite bf16 amax, the tie oracle's
  x / step, and quotients within a few ulps of float32 midpoints (the hard cases); the
  reciprocal multiply XLA would otherwise use gets some of these wrong."""
  e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  e4m3 = np.unique(e4m3[np.isfinite(e4m3) & (e4m3 > 0)])
  bf16 = np.arange(1 << 15, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
  bf16 = bf16[np.isfinite(bf16) & (bf16 > 2.0**-126)]
  rng = np.random.default_rng(0)
  b = rng.uniform(1, 2, 4096).astype(np.float32) * np.exp2(rng.integers(-20, 20, 4096))
  mids = (rng.integers(1 << 23, 1 << 24, 4096) * 2 + 1).astype(np.float64) * 2.0**-24
  near = _f32_neighbours((mids * b).astype(np.float32), 3)  # a ~ mid * b
  cases = [
    (np.repeat(e4m3, len(e4m3)), np.tile(e4m3, len(e4m3))),
    (np.full(bf16.shape, 2688, np.float32), bf16),
    (near, np.repeat(b, 7)),
    (
      rng.standard_normal(1 << 16).astype(np.float32) * 1e3,
      rng.uniform(1e-3, 1e3, 1 << 16).astype(np.float32),
    ),
  ]
  misses = 0
  for a, d in cases:
    a, d = a.astype(np.float32), d.astype(np.float32)
    got = np.asarray(numerics.true_divide_via_f64(a, d))
    np.testing.assert_array_equal(got.view(np.int32), (a / d).view(np.int32))
    misses += int(np.sum(a * (np.float32(1) / d) != a / d))
  assert misses > 1000  # the oracle has teeth


def test_importing_fp4_imports_no_pallas_or_triton_module():
  """The FP4 numerics stand below the kernels: `import trace_jax.fp4` (in a fresh process)
  adds no Pallas or Triton module to what `import jax` itself loads (jaxlib's
  `gpu_triton` plugin stub is jax's own); the kernels' Triton lowering of `true_divide` is
  registered by `trace_jax.kernels`."""
  script = (
    "import sys, jax\n"
    "before = set(sys.modules)\n"
    "import trace_jax.fp4\n"
    "print([m for m in sorted(set(sys.modules) - before) if 'pallas' in m or 'triton' in m])\n"
    "import trace_jax.kernels\n"
    "from trace_jax import _jax_private\n"
    "print(trace_jax.fp4.numerics.true_divide_p in _jax_private.pallas_triton().lowering_rules)\n"
  )
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  out = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
  ).stdout.splitlines()
  assert out == ["[]", "True"], out
