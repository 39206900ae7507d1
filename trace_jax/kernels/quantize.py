"""Fused per-token FP4 quantization of activations, with the compact guidance bits.

One pass over x [M, K]: each program loads a tile of rows, takes the row and block amax,
encodes the block scales, rounds to the nearest E2M1 code and writes the packed codes, the
block scales, the per-row global scales and the mantissa bits (TRACE's compact guidance)
together. Bit for bit `fp4.quantize(x, fmt, axis=-1, global_group="row")` and
`fp4.mantissa_bits` of it; the format math is `fp4.tiles.quantize_rows`.

Compiled (Triton), two things keep it bit for bit:
- Triton tiles are powers of two, and a row must stay in one program (its amax sets its
  global scale): a K that is not (768, an expert's ffn width) is zero-padded to the next
  power of two. Zeros change no amax and quantize to code 0 with a zero block scale, and
  the padding is sliced off the outputs.
- Triton divides float32 with `div.full.f32` (about 2 ulp), which moves exact ties; the
  format math divides only through `fp4.numerics.true_divide`, whose Triton lowering is
  the correctly rounded `tt.precise_divf` (PTX `div.rn.f32`): the spec's true division.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax import fp4
from trace_jax.fp4 import tiles
from trace_jax.kernels import launch


def _check(x: jax.Array, fmt: str) -> int:
  block = fp4.get_format(fmt).block_size
  if x.ndim < 1 or x.shape[-1] % max(block, 8):
    raise ValueError(
      f"quantize: the last axis of x ({x.shape}) must be a multiple of {max(block, 8)} for {fmt}"
    )
  return block


def _kernel(x_ref, p_ref, s_ref, g_ref, b_ref, *, fmt):
  p_ref[...], s_ref[...], g_ref[...], b_ref[...] = tiles.quantize_rows(x_ref[...], fmt)


def tiling(k: int) -> dict[str, int]:
  """Default rows per program and Triton params for rows of (padded) width k.

  There is no loop to pipeline (num_stages 1). A program holds block_m x k float32 values
  and a dozen same-shaped temporaries of the format math, so block_m keeps that near 4096
  values, 16 a thread at 8 warps (compiled for sm_90: 80 registers a thread for K = 2048,
  63 for K = 768 padded to 1024, no spills); at least one row (a row is one global group)
  and at most 64.
  """
  block_m = max(1, min(64, 4096 // k))
  return dict(block_m=block_m, num_warps=8 if block_m * k >= 4096 else 4, num_stages=1)


def quantize(
  x: jax.Array,
  fmt: str = "nvfp4",
  *,
  interpret: bool | None = None,
  poison: bool = False,
  block_m: int | None = None,
  num_warps: int | None = None,
  num_stages: int | None = None,
) -> tuple[fp4.QArray, jax.Array]:
  """x [..., K] -> (QArray per row along the last axis, mantissa bits uint8 [..., K/8]).

  `interpret`, `poison`: as in `fp4_gemm`; block_m: rows per program, a power of two;
  num_warps, num_stages: Triton params (compiled only). Defaults: `tiling`.
  """
  _check(x, fmt)
  interpret = launch.interpret_default(interpret)  # outside the jit: part of its key
  return _quantize(
    x,
    fmt=fmt,
    interpret=interpret,
    poison=poison,
    block_m=block_m,
    num_warps=num_warps,
    num_stages=num_stages,
  )


@functools.partial(
  jax.jit,
  static_argnames=("fmt", "interpret", "poison", "block_m", "num_warps", "num_stages"),
)
def _quantize(x, *, fmt, interpret, poison, block_m, num_warps, num_stages):
  block = _check(x, fmt)
  lead, k = x.shape[:-1], x.shape[-1]
  width = 1 << (k - 1).bit_length()  # Triton tiles are powers of two: pad K with zeros
  defaults = tiling(width)
  block_m = block_m or defaults["block_m"]
  if block_m & (block_m - 1):
    raise ValueError(f"quantize: block_m={block_m} must be a power of two")
  m = math.prod(lead)
  rows = -(-m // block_m) * block_m
  x2 = jnp.pad(x.reshape(m, k), ((0, rows - m), (0, width - k)))
  widths = (width // 2, width // block, 1, width // 8)
  dtypes = (jnp.uint8, jnp.uint8, jnp.float32, jnp.uint8)
  packed, scales, global_scale, bits = launch.pallas_call(
    functools.partial(_kernel, fmt=fmt),
    out_shape=[jax.ShapeDtypeStruct((rows, w), d) for w, d in zip(widths, dtypes)],
    grid=(rows // block_m,),
    in_specs=[pl.BlockSpec((block_m, width), lambda i: (i, 0))],
    out_specs=[pl.BlockSpec((block_m, w), lambda i: (i, 0)) for w in widths],
    inputs=(x2,),
    interpret=interpret,
    poison=poison,
    name="fp4_quantize",
    num_warps=num_warps or defaults["num_warps"],
    num_stages=num_stages or defaults["num_stages"],
  )

  def unpad(a, keep):
    return a[:m, :keep].reshape(*lead, keep)

  q = fp4.QArray(
    packed=unpad(packed, k // 2),
    scales=unpad(scales, k // block),
    global_scale=unpad(global_scale, 1),
    fmt=fmt,
    axis=-1,
  )
  return q, unpad(bits, k // 8)


def reference(x: jax.Array, fmt: str = "nvfp4") -> tuple[fp4.QArray, jax.Array]:
  """The same outputs from `fp4.quantize` and `fp4.mantissa_bits` (two passes)."""
  _check(x, fmt)
  q = fp4.quantize(x, fmt, axis=-1, global_group="row")
  return q, fp4.mantissa_bits(q)
