"""A tie oracle: bf16 activations whose FP4 quantization an inexact division gets wrong,
with their NVFP4 / MXFP4 codes and scales computed on the host (NumPy's IEEE float32).

Every division of the spec must be correctly rounded on every path (`numerics.true_divide`):
a quotient one ulp off flips an exact tie. `kernels.probe` quantizes these rows
on the device on every path (XLA, and each Pallas kernel that quantizes) and compares them
bit for bit with `host_quantize`; a GPU compiler that divides approximately fails it.

Rows (each a token of `width` elements, blocks of 16):
  element ties  row amax 10.5, so gs = 2688 / 10.5 = 256 exactly; the other elements sit
                exactly at E2M1 midpoints times steps s_b / 256 with s_b an E4M3 value
                that is not a power of two (bf16-exact): x / step must be the midpoint;
  scale ties    the same row amax, blocks whose amax_b = m * 6 / 256 for an E4M3 midpoint
                m: the ideal block scale amax_b / 6 * gs must be exactly m (ties to even);
  random rows   bf16 normals times a random factor per row: quotients land anywhere, and a
                reciprocal multiply differs from the spec in ~0.06% of codes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_F32 = np.float32
_BF16 = ml_dtypes.bfloat16
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _e4m3_values() -> np.ndarray:
  values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(_F32)
  return np.unique(values[np.isfinite(values) & (values > 0)])


def tie_rows(seed: int = 0, rows: int = 96, width: int = 128) -> np.ndarray:
  """bf16 rows [3 * rows, width] (element ties, scale ties, random rows)."""
  rng = np.random.default_rng(seed)
  nb = width // 16
  e4m3 = _e4m3_values()
  scales = e4m3[(e4m3 >= 2) & (e4m3 <= 448)]
  scales = scales[scales / 2.0 ** np.floor(np.log2(scales)) != 1]  # not powers of two
  s_b = rng.choice(scales, (rows, nb)).astype(_F32)
  s_b[:, 0] = 448
  element = np.zeros((rows, nb, 16), _F32)
  element[:, :, 0] = s_b * 6 / 256 * rng.choice([-1, 1], (rows, nb))  # ideal scale is s_b
  midpoints = rng.choice(E2M1_MIDPOINTS, (rows, nb, 15)) * rng.choice([-1, 1], (rows, nb, 15))
  element[:, :, 1:] = midpoints * (s_b / 256)[..., None]
  mids = ((e4m3[:-1].astype(np.float64) + e4m3[1:]) / 2).astype(_F32)
  mids = mids[(mids > 2.0**-6) & (mids < 448)]
  block_amax = rng.choice(mids, (rows, nb)).astype(_F32) * 6 / 256
  block_amax[:, 0] = 10.5
  scale = rng.uniform(-1, 1, (rows, nb, 16)).astype(_F32) * block_amax[..., None]
  scale[:, :, 5] = block_amax * rng.choice([-1, 1], (rows, nb))
  noise = rng.standard_normal((rows, width)) * rng.uniform(0.01, 100, (rows, 1))
  x = np.concatenate([element.reshape(rows, width), scale.reshape(rows, width), noise])
  x = x.astype(_BF16)
  # The ties themselves are bf16-exact (only the scale rows' other elements were rounded,
  # never above their block's amax).
  assert np.array_equal(x[:rows].astype(_F32), element.reshape(rows, width))
  amax = np.max(np.abs(x[rows : 2 * rows].astype(_F32).reshape(rows, nb, 16)), axis=-1)
  assert np.array_equal(amax, block_amax)
  return x


def host_codes(v: np.ndarray) -> np.ndarray:
  """E2M1 codes of float32 values (ml_dtypes: round half to even, saturating; 0 is code 0)."""
  codes = np.asarray(v, _F32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
  return np.where((codes & 7) == 0, 0, codes).astype(np.uint8)


def host_quantize(x: np.ndarray, fmt: str = "nvfp4"):
  """Per-row quantization of x [rows, n] on the host, from the spec (ml_dtypes casts).

  Returns (codes uint8 [rows, n], scale bits uint8 [rows, n/block], global scale float32
  [rows, 1], dequantized values float32 [rows, n])."""
  x = np.asarray(x, _F32)
  rows, n = x.shape
  with np.errstate(divide="ignore", invalid="ignore"):
    if fmt == "nvfp4":
      blocks = x.reshape(rows, -1, 16)
      amax = np.max(np.abs(x), axis=1, keepdims=True)
      gs = np.where(amax > 0, _F32(448 * 6) / amax, _F32(1)).astype(_F32)
      ideal = np.minimum(np.max(np.abs(blocks), axis=-1) / _F32(6) * gs, _F32(448)).astype(_F32)
      bits = ideal.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
      step = (bits.view(ml_dtypes.float8_e4m3fn).astype(_F32) / gs)[..., None]
    else:
      blocks = x.reshape(rows, -1, 32)
      amax_b = np.max(np.abs(blocks), axis=-1).astype(np.float64)
      exponent = np.where(amax_b > 0, np.floor(np.log2(amax_b)), -127) - 2
      exponent = np.clip(exponent, -127, 127).astype(np.int32)
      bits = (exponent + 127).astype(np.uint8)
      gs = np.ones((rows, 1), _F32)
      step = np.ldexp(_F32(1), exponent).astype(_F32)[..., None]
    v = np.where(step > 0, blocks / step, _F32(0)).astype(_F32)
  codes = host_codes(v)
  values = (codes.view(ml_dtypes.float4_e2m1fn).astype(_F32) * step).reshape(rows, n)
  return codes.reshape(rows, n), bits, gs, values


def pack_host(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(packed codes [.., n/2], mantissa bits [.., n/8]) of codes [.., n], as the kernels and
  `fp4.QArray` store them."""
  codes = np.asarray(codes, np.uint8)
  packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
  bits = np.packbits(codes & 1, axis=-1, bitorder="little")
  return packed.astype(np.uint8), bits.astype(np.uint8)
