"""FP8 E4M3 activations for W4A8 (FP4 weights, FP8 activations): the OCP MXFP8 layout.

The method also reports W4A8: FP4 (MXFP4) weights with FP8 E4M3 activations. Activations
are quantized per token along the contraction axis in the OCP MX v1.0 block layout, the one
MXFP4 uses, with E4M3 elements instead of E2M1:
  1. blocks of 32 consecutive elements share a power-of-two scale X = 2^e (E8M0),
     e = floor(log2(amax_b)) - 8 (8 = the largest exponent of E4M3), clamped to E8M0's
     range (and to >= -126: a float32-subnormal scale flushes to zero on CPU);
  2. each element becomes e4m3(x / X): round half to even, saturating at +-448 (the largest
     block element is below 2^9 = 512 after scaling, so only [448, 512) saturates);
  3. the training path uses X * e4m3(x / X), with a straight-through gradient.
A row (token) holding NaN or Inf comes out all NaN, so the fault stays visible (as FP4's
NaN global scale does). Rounding is to nearest only: FP8 sites take no guidance (see
`model.quant.QuantConfig.activations` for why).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.fp4 import numerics

FP8_BLOCK_SIZE = 32  # elements per E8M0 scale (OCP MX v1.0)
E4M3_EMAX = 8  # exponent of E4M3's largest normal power of two (448 = 1.75 * 2^8)


def fp8_values(x: jax.Array) -> jax.Array:
  """x [..., n] (n a multiple of 32) rounded to MXFP8 E4M3 along its last axis, float32."""
  n = x.shape[-1]
  if n % FP8_BLOCK_SIZE:
    raise ValueError(
      f"FP8 (MXFP8) activations need the quantized axis to be a multiple of "
      f"{FP8_BLOCK_SIZE}; got {n} (shape {x.shape})"
    )
  x32 = x.astype(jnp.float32)
  blocks = x32.reshape(*x.shape[:-1], n // FP8_BLOCK_SIZE, FP8_BLOCK_SIZE)
  amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
  exponent = jnp.clip(numerics.floor_log2(amax) - E4M3_EMAX, -126, 127)
  scale = numerics.e8m0_decode(numerics.e8m0_encode(exponent))  # 2^e, exact
  scaled = jnp.clip(numerics.true_divide(blocks, scale), -numerics.E4M3_MAX, numerics.E4M3_MAX)
  values = (scaled.astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale).reshape(x.shape)
  finite = jnp.all(jnp.isfinite(x32), axis=-1, keepdims=True)
  return jnp.where(finite, values, jnp.nan)


@jax.custom_vjp
def fake_quant_fp8(x: jax.Array) -> jax.Array:
  """`fp8_values(x)` in x's dtype, with a straight-through gradient (training path)."""
  return fp8_values(x).astype(x.dtype)


def _fwd(x):
  return fake_quant_fp8(x), None


def _bwd(_, g):
  return (g,)


fake_quant_fp8.defvjp(_fwd, _bwd)
