"""Element and scale formats: the E2M1 grid, E4M3 and E8M0 scales, nibble and bit packing.

Everything here is elementwise and format-level; block structure lives in `quantize.py`.
Codes are uint8 holding 4 bits: bits 0-2 the magnitude code (0..7), bit 3 the sign.
Adjacent magnitudes always differ in bit 0 of their code, which is why bit 0 (the
"mantissa bit") is enough to pick between the two grid neighbours of a value.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir

from trace_jax import _jax_private  # the private JAX hooks, isolated and tested there

# E2M1 magnitudes by code 0..7 (OCP MX v1.0, table 5; ml_dtypes float4_e2m1fn).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# NVFP4's range at global scale 1: the largest block scale (E4M3's 448) times E2M1's 6.
NVFP4_RANGE = E4M3_MAX * E2M1_MAX
_F32_MAX = float(np.finfo(np.float32).max)
SIGN_BIT = np.uint8(8)
E8M0_BIAS = 127
E8M0_NAN = 255


def _xla_true_divide(numerator, denominator):
  return numerator / (denominator + numerator * 0.0)


def _gpu_true_divide(ctx, numerator, denominator):
  """XLA on a GPU: the float32 operands widened to float64, divided there, and the
  quotient rounded once to float32 (correctly rounded: see `true_divide`)."""
  ir = _jax_private.mlir_ir
  hlo = _jax_private.hlo
  aval = ctx.avals_out[0]
  wide = ir.RankedTensorType.get(aval.shape, ir.F64Type.get())
  narrow = ir.RankedTensorType.get(aval.shape, mlir.dtype_to_ir_type(jnp.dtype(aval.dtype)))
  quotient = hlo.divide(hlo.convert(wide, numerator), hlo.convert(wide, denominator))
  return [hlo.convert(narrow, quotient)]


# One primitive, so each backend gets a division it cannot weaken (see `true_divide`):
# XLA on CPU `a / (b + 0 * a)`, XLA on a GPU a float64 division rounded once to float32,
# Pallas' Triton lowering the PTX instruction div.rn.f32 as inline assembly (registered by
# `trace_jax.kernels.triton_divide`, where the kernels are: these numerics import no Pallas).
true_divide_p = _jax_private.Primitive("fp4_ieee_div")
true_divide_p.def_impl(functools.partial(_jax_private.apply_primitive, true_divide_p))
true_divide_p.def_abstract_eval(lambda a, b: jax.core.ShapedArray(a.shape, a.dtype))
mlir.register_lowering(true_divide_p, mlir.lower_fun(_xla_true_divide, multiple_results=False))
for _platform in ("cuda", "rocm"):
  mlir.register_lowering(true_divide_p, _gpu_true_divide, platform=_platform)
ad.defjvp(true_divide_p, lambda g, a, b: g / b, lambda g, a, b: -g * a / (b * b))

# The GPU formulation on any backend: what `true_divide` computes on a GPU, for the tests
# (on CPU they check it against IEEE float32 division, ties included).
_f64_div_p = _jax_private.Primitive("fp4_f64_div")
_f64_div_p.def_impl(functools.partial(_jax_private.apply_primitive, _f64_div_p))
_f64_div_p.def_abstract_eval(lambda a, b: jax.core.ShapedArray(a.shape, a.dtype))
mlir.register_lowering(_f64_div_p, _gpu_true_divide)


def _batch_true_divide(args, dims):
  # Operands have one shape (true_divide broadcasts them); vmap may batch either or both:
  # put the batch axis first on both.
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  front = [
    jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
    for x, d in zip(args, dims)
  ]
  return true_divide_p.bind(*front), 0


batching.primitive_batchers[true_divide_p] = _batch_true_divide


def true_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  """IEEE float32 division, numerator / denominator, correctly rounded on every path.

  FP4 rounding turns one ulp of a quotient into a flipped tie (v exactly 1.75 becomes code
  3 instead of 4; an ideal block scale of exactly 336 becomes E4M3 352 instead of 320), so
  the spec's divisions (and compressed-tensors') must be exact wherever they run, and the
  same on the training path (XLA) and the rollout (Pallas kernels on a GPU):
  - XLA on CPU: `a / (b + 0 * a)`. XLA's algebraic simplifier turns `a / b` with a
    constant or broadcast `b` into `a * (1 / b)`; `b + 0 * a` is the same value for finite
    `a` (adding a zero to a nonzero `b` is exact) but not a broadcast or a constant, and no
    compiler may fold `0 * a` (NaN for non-finite `a`: such a numerator gives NaN).
  - XLA on a GPU: XLA's NVPTX backend compiles every float32 division to div.full.f32 (it
    passes -nvptx-prec-divf32=1 to LLVM; up to 2 ulp off), and its own Triton fusions
    divide with div.full.f32 too. The GPU lowering divides in float64 and rounds the
    quotient once to float32 (LLVM and Triton divide float64 with div.rn.f64 whatever
    that flag says). That is the correctly rounded float32 quotient: for float32 a, b
    (b != 0) whose quotient Q = a / b is not a float32, its distance to any float32
    midpoint mu (the rounding boundaries) is at least |mu| * 2^-49, because a - mu * b is
    a nonzero multiple of 2^(e + e_b - 47) (mu has 25 significant bits, b 24; it cannot be
    0, as mu * b would need more odd bits than a has); the float64 quotient is within
    |Q| * 2^-53 of Q (within 2^-52 if XLA rewrites it as a * (1 / b) in float64), so it
    lies on the same side of every float32 midpoint as Q and rounds to the same float32;
    an exact Q stays exact. (Figueroa's theorem in one line: 53 >= 2 * 24 + 2 makes double
    rounding innocuous for division.) Non-finite operands divide per IEEE.
  - Pallas' Triton lowering (CUDA): inline PTX `div.rn.f32` (IEEE, round to nearest even),
    registered by `trace_jax.kernels.triton_divide` (see there why no other form is exact).
  Tests check the float64 formulation (`true_divide_via_f64`, on CPU) against NumPy's IEEE
  division on tie oracles, and the CUDA lowerings for their division instructions.
  """
  numerator, denominator = jnp.broadcast_arrays(
    jnp.asarray(numerator, jnp.float32), jnp.asarray(denominator, jnp.float32)
  )
  return true_divide_p.bind(numerator, denominator)


def nvfp4_global_scale(amax: jax.Array) -> jax.Array:
  """NVFP4's encode scale of a global group, gs = (448 * 6) / amax (DESIGN.md section 1).

  A true division (`true_divide`), as the spec divides; gs = 1 where amax is 0, and at most
  float32's largest value where amax is f32-subnormal (the quotient would overflow)."""
  return jnp.minimum(true_divide(NVFP4_RANGE, jnp.where(amax > 0, amax, NVFP4_RANGE)), _F32_MAX)


def true_divide_via_f64(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  """What `true_divide` computes under XLA on a GPU (float64 quotient rounded once to
  float32), on any backend: for tests of that formulation on CPU."""
  numerator, denominator = jnp.broadcast_arrays(
    jnp.asarray(numerator, jnp.float32), jnp.asarray(denominator, jnp.float32)
  )
  return _f64_div_p.bind(numerator, denominator)


def e2m1_decode(codes: jax.Array) -> jax.Array:
  """Unsigned-or-signed 4-bit codes -> float32 values, exactly.

  Built from the bit fields rather than a table gather: for exponent e >= 1 the value is
  2^(e-1) * (1 + m/2), assembled directly as float32 bits; e == 0 is the subnormal m * 0.5.
  """
  codes = codes.astype(jnp.uint32)
  mantissa = codes & 1
  exponent = (codes >> 1) & 3
  normal_bits = ((exponent + 126) << 23) | (mantissa << 22)
  normal = jax.lax.bitcast_convert_type(normal_bits, jnp.float32)
  magnitude = jnp.where(exponent == 0, mantissa.astype(jnp.float32) * 0.5, normal)
  return jnp.where((codes & 8) != 0, -magnitude, magnitude)


def e2m1_bf16(codes: jax.Array) -> jax.Array:
  """4-bit codes (uint8, sign in bit 3) -> their E2M1 values as bfloat16, exactly, in a few
  16-bit integer operations (a kernel decodes every weight element this way).

  The bf16 bits of magnitude code u >= 2 are 0x3F00 + (u << 6): the code's exponent bits
  land in bf16's exponent (biased by 126) and its mantissa bit on bf16's first mantissa
  bit; u = 1 (0.5) is 0x3F00 = 1 * 0x3F00 and u = 0 is 0. No subnormal appears on the way
  (a multiply-by-2^126 trick would pass through one, which flush-to-zero hardware loses).
  """
  nibble = codes.astype(jnp.uint16)
  magnitude = nibble & 7
  bits = jnp.where(magnitude >= 2, (magnitude << 6) + 0x3F00, magnitude * 0x3F00)
  return jax.lax.bitcast_convert_type(bits | ((nibble & 8) << 12), jnp.bfloat16)


def e2m1_grid_units(magnitude: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Express a non-negative magnitude in units of the E2M1 grid spacing around it.

  The grid spacing is 0.5 below 2 and 2^(e - 1) in the binade [2^e, 2^(e + 1)) above, so
  with e' = clip(floor(log2 m), 0, 2), spacing s = 2^(e' - 1) and units t = m / s (exact:
  a power-of-two division), the two grid neighbours are floor(t) and ceil(t) units, and a
  neighbour of n units has code min(2 e' + n, 7) and value min(n s, 6). Rounding t half to
  even is round-half-to-even on the grid, because even units are even codes.

  Returns:
    (e' int32, s float32, t float32); magnitudes above 8 count as 8 (they saturate anyway).
  """
  magnitude = jnp.minimum(magnitude.astype(jnp.float32), 8.0)
  bits = jax.lax.bitcast_convert_type(magnitude, jnp.uint32)
  exponent = jnp.clip((bits >> 23).astype(jnp.int32) - 127, 0, 2)
  spacing = jax.lax.bitcast_convert_type((exponent + 126).astype(jnp.uint32) << 23, jnp.float32)
  # m * 2^(1 - e'), exactly m / s, and no division for a backend to weaken.
  inverse = jax.lax.bitcast_convert_type((128 - exponent).astype(jnp.uint32) << 23, jnp.float32)
  return exponent, spacing, magnitude * inverse


def round_half_even(units: jax.Array) -> jax.Array:
  """Round non-negative float32 half to even, from floor and the fraction.

  Equal to `jnp.round` here, but built from floor and compares, which XLA's CPU backend
  keeps vectorised when the rounding is fused into packing (jnp.round there cost 5x).
  """
  lo = jnp.floor(units)
  frac = units - lo  # exact
  odd = jnp.fmod(lo, 2.0) == 1.0
  return jnp.where((frac > 0.5) | ((frac == 0.5) & odd), lo + 1.0, lo)


def e2m1_unit_code(exponent: jax.Array, units: jax.Array) -> jax.Array:
  """Magnitude code (uint8) of a neighbour `units` spacings from zero (saturating at 7)."""
  return jnp.minimum(2 * exponent + units.astype(jnp.int32), 7).astype(jnp.uint8)


def e2m1_unit_value(units: jax.Array, spacing: jax.Array) -> jax.Array:
  """Magnitude value (float32) of a neighbour `units` spacings from zero (saturating at 6)."""
  return jnp.minimum(units * spacing, E2M1_MAX)


def e2m1_neighbours(magnitude: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Codes (uint8) of the two E2M1 grid neighbours lo <= magnitude <= hi, clamped to 6.

  They coincide when the magnitude is on the grid or saturates; otherwise hi == lo + 1, so
  the two differ in their lowest bit (the "mantissa bit").
  """
  exponent, _, units = e2m1_grid_units(magnitude)
  return e2m1_unit_code(exponent, jnp.floor(units)), e2m1_unit_code(exponent, jnp.ceil(units))


def e2m1_round_nearest(magnitude: jax.Array) -> jax.Array:
  """Magnitude code of round-half-to-even to the E2M1 grid, saturating at 6."""
  exponent, _, units = e2m1_grid_units(magnitude)
  return e2m1_unit_code(exponent, round_half_even(units))


def e2m1_sign(codes_magnitude: jax.Array, negative: jax.Array) -> jax.Array:
  """Attach the sign bit; zero stays code 0 (never -0), as compressed-tensors packs it."""
  sign = jnp.where(negative & (codes_magnitude != 0), SIGN_BIT, np.uint8(0))
  return codes_magnitude | sign


# --- E4M3 block scales (NVFP4) ---------------------------------------------------------


def e4m3_encode(values: jax.Array) -> jax.Array:
  """Non-negative float32 -> E4M3 bits (uint8), RNE, subnormals kept, clipped to 448.

  Integer arithmetic on the float32 bits instead of a convert to float8_e4m3fn: XLA on CPU
  converts float8 in software and, once fused into a per-element loop, that dominates the
  cost of quantization. Tests check it against ml_dtypes for every case.
  """
  values = jnp.minimum(values.astype(jnp.float32), E4M3_MAX)
  # Subnormal range (< 2^-6): multiples of 2^-9; scaling by 2^9 is exact, then RNE (from
  # floor: Pallas' Triton lowering has no round).
  subnormal = round_half_even(values * 512.0).astype(jnp.uint32)  # 0..8 (8 is 2^-6: 0x08)
  bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
  # Keep 3 of the 23 mantissa bits, rounding half to even; a carry bumps the exponent.
  rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
  exponent = (rounded >> 23).astype(jnp.int32) - 127 + 7
  normal = (exponent.astype(jnp.uint32) << 3) | ((rounded >> 20) & 7)
  return jnp.where(values < 2.0**-6, subnormal, normal).astype(jnp.uint8)


def e4m3_decode(bits: jax.Array) -> jax.Array:
  """E4M3 bits (uint8) -> float32 (0x7F / 0xFF are NaN), from the bit fields, exactly."""
  bits = bits.astype(jnp.uint32)
  exponent = (bits >> 3) & 0xF
  mantissa = bits & 7
  normal = jax.lax.bitcast_convert_type(((exponent + 120) << 23) | (mantissa << 20), jnp.float32)
  magnitude = jnp.where(exponent == 0, mantissa.astype(jnp.float32) * 2.0**-9, normal)
  magnitude = jnp.where((bits & 0x7F) == 0x7F, jnp.float32(jnp.nan), magnitude)
  return jnp.where((bits & 0x80) != 0, -magnitude, magnitude)


# --- E8M0 block scales (MXFP4) ---------------------------------------------------------


def floor_log2(values: jax.Array) -> jax.Array:
  """floor(log2(v)) of non-negative float32, exactly, from the exponent field.

  Zero and f32 subnormals give -127 (below any clamp we use); XLA on CPU flushes
  subnormals in arithmetic anyway, so they cannot be told apart from zero.
  """
  bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.uint32)
  return ((bits >> 23) & 0xFF).astype(jnp.int32) - 127


def e8m0_encode(exponent: jax.Array) -> jax.Array:
  """Integer exponent -> E8M0 bits, clamped to [-127, 127] (OCP MX v1.0)."""
  return (jnp.clip(exponent, -127, 127) + E8M0_BIAS).astype(jnp.uint8)


def e8m0_decode(bits: jax.Array) -> jax.Array:
  """E8M0 bits -> float32 2^(bits - 127); 0xFF is NaN. Built from f32 bit fields (exact)."""
  bits = bits.astype(jnp.uint32)
  normal = jax.lax.bitcast_convert_type(bits << 23, jnp.float32)
  value = jnp.where(bits == 0, jnp.float32(2.0**-127), normal)
  return jnp.where(bits == E8M0_NAN, jnp.float32(jnp.nan), value)


# --- Packing ---------------------------------------------------------------------------


def _check_len(n: int, multiple: int, what: str) -> None:
  if n % multiple:
    raise ValueError(f"{what}: axis length {n} is not a multiple of {multiple}")


def _pack_nibble_pairs(nibbles: jax.Array) -> jax.Array:
  """uint8 [..., 2m] holding 4-bit values -> uint8 [..., m], element 2i in the low nibble.

  Done through a uint16 bitcast of each pair (little-endian: element 2i is the low byte)
  rather than strided slices: XLA on CPU fuses a strided pack into the producer of the
  codes and then runs about 10x slower.
  """
  pairs = nibbles.reshape(*nibbles.shape[:-1], nibbles.shape[-1] // 2, 2)
  word = jax.lax.bitcast_convert_type(pairs, jnp.uint16)
  return ((word & 0xF) | ((word >> 4) & 0xF0)).astype(jnp.uint8)


def pack_codes(codes: jax.Array, axis: int = -1) -> jax.Array:
  """4-bit codes [..., n] -> uint8 [..., n/2], element 2i in the low nibble."""
  codes = jnp.moveaxis(jnp.asarray(codes).astype(jnp.uint8), axis, -1)
  _check_len(codes.shape[-1], 2, "pack_codes")
  return jnp.moveaxis(_pack_nibble_pairs(codes & 0xF), -1, axis)


def unpack_codes(packed: jax.Array, axis: int = -1) -> jax.Array:
  """uint8 [..., n/2] -> 4-bit codes uint8 [..., n] (inverse of `pack_codes`).

  Each byte is spread into a uint16 word, low nibble in the low byte and high nibble in the
  high byte, and the words are bitcast to byte pairs (little-endian, as `_pack_nibble_pairs`
  packs them) rather than stacking the two nibbles: fused into its consumer (guided rounding
  with full guidance), a stack is a concatenate, which XLA on CPU does not vectorise; it
  made that quantizer about 3x slower than nearest rounding's.
  """
  packed = jnp.moveaxis(jnp.asarray(packed).astype(jnp.uint8), axis, -1)
  word = packed.astype(jnp.uint16)
  word = (word & 0xF) | ((word & 0xF0) << 4)
  pairs = jax.lax.bitcast_convert_type(word, jnp.uint8)  # [..., n/2, 2]
  codes = pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
  return jnp.moveaxis(codes, -1, axis)


def pack_bits(bits: jax.Array, axis: int = -1) -> jax.Array:
  """Bits (0/1) [..., n] -> uint8 [..., n/8], element 8i + j in bit j."""
  bits = jnp.moveaxis(jnp.asarray(bits).astype(jnp.uint8), axis, -1)
  _check_len(bits.shape[-1], 8, "pack_bits")
  quads = (bits & 1).reshape(*bits.shape[:-1], bits.shape[-1] // 4, 4)
  word = jax.lax.bitcast_convert_type(quads, jnp.uint32)  # bit j of a quad at 8j
  nibbles = (word | (word >> 7) | (word >> 14) | (word >> 21)) & 0xF
  return jnp.moveaxis(_pack_nibble_pairs(nibbles.astype(jnp.uint8)), -1, axis)


def unpack_bits(packed: jax.Array, axis: int = -1) -> jax.Array:
  """uint8 [..., n/8] -> bits uint8 [..., n] (inverse of `pack_bits`)."""
  packed = jnp.moveaxis(jnp.asarray(packed).astype(jnp.uint8), axis, -1)
  shifts = jnp.arange(8, dtype=jnp.uint8)
  bits = (packed[..., None] >> shifts) & 1
  bits = bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8)
  return jnp.moveaxis(bits, -1, axis)


def e4m3_grid_units(values: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Express a non-negative value (clipped to 448) in units of the E4M3 spacing around it.

  The spacing is 2^(e - 3) in the binade [2^e, 2^(e + 1)) for e >= -6 and 2^-9 below
  2^-6 (subnormals), so units t = value / spacing (exact: a power of two) has the two E4M3
  neighbours at floor(t) and ceil(t) units, and its midpoints at half units.

  Returns:
    (spacing float32, t float32).
  """
  values = jnp.minimum(values.astype(jnp.float32), E4M3_MAX)
  exponent = jnp.clip(floor_log2(values), -6, 8)
  spacing = jax.lax.bitcast_convert_type((exponent + 124).astype(jnp.uint32) << 23, jnp.float32)
  inverse = jax.lax.bitcast_convert_type((130 - exponent).astype(jnp.uint32) << 23, jnp.float32)
  return spacing, values * inverse
