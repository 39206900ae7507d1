"""Fused per-token FP4 quantization of activations, with the compact guidance bits.

One pass over x [M, K]: each program loads a tile of rows, takes the row and block amax,
encodes the block scales, rounds to the nearest E2M1 code and writes the packed codes, the
block scales, the per-row global scales and the mantissa bits (TRACE's compact guidance)
together. Bit for bit `fp4.quantize(x, fmt, axis=-1, global_group="row")` and
`fp4.mantissa_bits` of it; the format math is `fp4.tiles.quantize_rows`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax import fp4
from trace_jax.fp4 import tiles
from trace_jax.kernels import dispatch


def _check(x: jax.Array, fmt: str) -> int:
  block = fp4.get_format(fmt).block_size
  if x.ndim < 1 or x.shape[-1] % max(block, 8):
    raise ValueError(f"quantize: the last axis of x ({x.shape}) must be a multiple of "
                     f"{max(block, 8)} for {fmt}")
  return block


def _kernel(x_ref, p_ref, s_ref, g_ref, b_ref, *, fmt):
  packed, scales, global_scale, bits = tiles.quantize_rows(x_ref[...], fmt)
  p_ref[...], s_ref[...], g_ref[...], b_ref[...] = packed, scales, global_scale, bits


@functools.partial(jax.jit, static_argnames=("fmt", "interpret", "poison", "block_m"))
def quantize(x: jax.Array, fmt: str = "nvfp4", *, interpret: bool | None = None,
             poison: bool = False, block_m: int | None = None
             ) -> tuple[fp4.QArray, jax.Array]:
  """x [..., K] -> (QArray per row along the last axis, mantissa bits uint8 [..., K/8]).

  `interpret`, `poison`: as in `fp4_matmul`; block_m: rows per program (default a power
  of two up to 64).
  """
  block = _check(x, fmt)
  lead, k = x.shape[:-1], x.shape[-1]
  m = math.prod(lead)
  block_m, rows = dispatch.row_tiling(m, block_m)
  x2 = dispatch.pad_rows(x.reshape(m, k), rows)
  widths = (k // 2, k // block, 1, k // 8)
  dtypes = (jnp.uint8, jnp.uint8, jnp.float32, jnp.uint8)
  packed, scales, global_scale, bits = dispatch.pallas_call(
      functools.partial(_kernel, fmt=fmt),
      out_shape=[jax.ShapeDtypeStruct((rows, w), d) for w, d in zip(widths, dtypes)],
      grid=(rows // block_m,), in_specs=[pl.BlockSpec((block_m, k), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((block_m, w), lambda i: (i, 0)) for w in widths],
      inputs=(x2,), interpret=dispatch.interpret_default(interpret), poison=poison,
      name="fp4_quantize")
  unpad = lambda a: a[:m].reshape(*lead, a.shape[-1])  # noqa: E731
  q = fp4.QArray(packed=unpad(packed), scales=unpad(scales), global_scale=unpad(global_scale),
                 fmt=fmt, axis=-1)
  return q, unpad(bits)


def reference(x: jax.Array, fmt: str = "nvfp4") -> tuple[fp4.QArray, jax.Array]:
  """The same outputs from `fp4.quantize` and `fp4.mantissa_bits` (two passes)."""
  _check(x, fmt)
  q = fp4.quantize(x, fmt, axis=-1, global_group="row")
  return q, fp4.mantissa_bits(q)
