"""Independent NumPy + ml_dtypes definitions of NVFP4 and MXFP4, for the tests.

Written from DESIGN.md section 1 and the OCP MX v1.0 spec, using ml_dtypes casts for the
element (E2M1) and scale (E4M3) rounding, so they share no code with trace_jax.fp4.
"""

import ml_dtypes
import numpy as np

F32 = np.float32


def e2m1_codes(v: np.ndarray) -> np.ndarray:
  """E2M1 codes of float32 values via ml_dtypes (RNE, saturating); zero is always code 0."""
  codes = np.asarray(v, F32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
  return np.where((codes & 7) == 0, 0, codes).astype(np.uint8)


def e2m1_values(codes: np.ndarray) -> np.ndarray:
  return np.asarray(codes, np.uint8).view(ml_dtypes.float4_e2m1fn).astype(F32)


def nvfp4(x: np.ndarray, group_axes=()):
  """NVFP4 along the last axis. Returns (codes, scale_bits, global_scale keepdims)."""
  x = np.asarray(x, F32)
  reduce_axes = tuple(a for a in range(x.ndim) if a not in group_axes)
  amax = np.max(np.abs(x), axis=reduce_axes, keepdims=True)
  with np.errstate(divide="ignore"):
    gs = np.where(amax > 0, F32(448 * 6) / amax, F32(1)).astype(F32)
  blocks = x.reshape(*x.shape[:-1], -1, 16)
  amax_b = np.max(np.abs(blocks), axis=-1)
  ideal = np.minimum(amax_b / F32(6) * gs, F32(448)).astype(F32)
  scale_e4m3 = ideal.astype(ml_dtypes.float8_e4m3fn)
  step = (scale_e4m3.astype(F32) / gs)[..., None]
  with np.errstate(divide="ignore", invalid="ignore"):
    v = np.where(step > 0, blocks / step, F32(0)).astype(F32)
  codes = e2m1_codes(v).reshape(x.shape)
  return codes, scale_e4m3.view(np.uint8), gs


def mxfp4(x: np.ndarray):
  """MXFP4 along the last axis (OCP MX v1.0). Returns (codes, e8m0 bits)."""
  x = np.asarray(x, F32)
  blocks = x.reshape(*x.shape[:-1], -1, 32)
  amax_b = np.max(np.abs(blocks), axis=-1)
  with np.errstate(divide="ignore"):
    exponent = np.where(amax_b > 0, np.floor(np.log2(amax_b.astype(np.float64))), -127) - 2
  exponent = np.clip(exponent, -127, 127).astype(np.int32)
  v = (blocks / np.ldexp(F32(1), exponent)[..., None]).astype(F32)
  return e2m1_codes(v).reshape(x.shape), (exponent + 127).astype(np.uint8)
