"""FP4 math on kernel tiles: what a Pallas kernel body does to packed bytes.

The kernels in `trace_jax.kernels` load blocks of packed codes and scales and call these
functions on them, so the format math stays here. They use only elementwise ops,
reshapes and reductions, which Pallas lowers (and runs in interpret mode on CPU).

A packed tile holds element pairs: byte p has element 2p in its low nibble and 2p + 1 in
its high nibble. Instead of interleaving the two back into one tile, kernels split the
other operand of a dot into its even and odd elements and take two dots, so a tile is
never re-laid out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.fp4 import numerics
from trace_jax.fp4.qarray import get_format
from trace_jax.fp4.quantize import _quantize_last
from trace_jax.fp4.spec import QuantSpec


def _broadcast_blocks(scale: jax.Array, axis: int, repeat: int) -> jax.Array:
  """Repeat each entry of `scale` `repeat` times along `axis` (a broadcast and a reshape)."""
  axis = axis % scale.ndim
  expanded = jnp.broadcast_to(
    jnp.expand_dims(scale, axis + 1), (*scale.shape[: axis + 1], repeat, *scale.shape[axis + 1 :])
  )
  return expanded.reshape(*scale.shape[:axis], scale.shape[axis] * repeat, *scale.shape[axis + 1 :])


def even_odd(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
  """The even and odd elements of x along `axis`: the order of a packed tile's low and
  high nibbles, for the other operand of a dot with it."""
  axis = axis % x.ndim
  take = lambda start: jax.lax.slice_in_dim(x, start, x.shape[axis], 2, axis)  # noqa: E731
  return take(0), take(1)


def interleave(even: jax.Array, odd: jax.Array, axis: int = -1) -> jax.Array:
  """Inverse of `even_odd`."""
  axis = axis % even.ndim
  pairs = jnp.stack([even, odd], axis=axis + 1)
  return pairs.reshape(*even.shape[:axis], 2 * even.shape[axis], *even.shape[axis + 1 :])


def scaled_pairs(
  packed: jax.Array, scale_bits: jax.Array, fmt: str, axis: int
) -> tuple[jax.Array, jax.Array]:
  """The (even, odd) elements of a packed tile times their block scale, float32.

  Args:
    packed: uint8 tile, n/2 bytes along `axis`.
    scale_bits: uint8 block scales, n/block along `axis`.
    fmt: "nvfp4" or "mxfp4".
    axis: the quantized axis.

  Returns:
    (even, odd): float32, packed's shape; value * s_b, without the global scale. For NVFP4
    the product of an E2M1 value and an E4M3 scale has at most 6 significant bits and lies
    in [2^-10, 2688], so it is exact in bfloat16 as well.
  """
  spec = get_format(fmt)
  scale = _broadcast_blocks(spec.decode_scales(scale_bits), axis, spec.block_size // 2)
  packed = packed.astype(jnp.uint8)
  even = numerics.e2m1_decode(packed & 0xF) * scale
  odd = numerics.e2m1_decode(packed >> 4) * scale
  return even, odd


def scaled_pairs_bf16(
  packed: jax.Array, scale_bits: jax.Array, fmt: str, axis: int
) -> tuple[jax.Array, jax.Array]:
  """`scaled_pairs` in bfloat16, for a kernel's dot: the same values (c * s_b is exact in
  bf16, see there), each element decoded in a few integer operations
  (`numerics.e2m1_bf16`) and one bf16 multiply by its block scale."""
  spec = get_format(fmt)
  scale = spec.decode_scales(scale_bits).astype(jnp.bfloat16)
  scale = _broadcast_blocks(scale, axis, spec.block_size // 2)
  packed = packed.astype(jnp.uint8)
  return numerics.e2m1_bf16(packed & 0xF) * scale, numerics.e2m1_bf16(packed >> 4) * scale


def row_global_scale(amax: jax.Array, fmt: str) -> jax.Array:
  """Per-row encode scale gs from the row's amax, as `fp4.quantize` computes it; NaN for a
  row whose amax is not finite (callers pass NaN for a row holding NaN: a max, in XLA or
  in a kernel, may drop NaN, so they flag such rows themselves)."""
  finite = jnp.isfinite(amax)
  if not get_format(fmt).has_global_scale:
    return jnp.where(finite, 1.0, jnp.nan).astype(jnp.float32)
  return jnp.where(finite, numerics.nvfp4_global_scale(amax), jnp.nan)


def quantize_pairs(x_even: jax.Array, x_odd: jax.Array, global_scale: jax.Array, fmt: str):
  """Nearest quantization of a row tile given as its even and odd elements, for a GEMM
  prologue that feeds the two halves to two dots against a packed weight's low and high
  nibbles (the row stays in that order from load to dot).

  Bit for bit `fp4.quantize(x, fmt, axis=-1, global_group="row")` of the interleaved rows
  when `global_scale` is the row's (`row_global_scale`): the same operations in the same
  order, on half-blocks (a block's amax is the max of its two halves').

  Args:
    x_even, x_odd: float32 [rows, n/2], elements 2i and 2i + 1 of a chunk of n (a multiple
      of the block size) of each row.
    global_scale: float32 [rows, 1]; NaN marks a non-finite row (codes and scales 0).

  Returns:
    (codes_even, codes_odd) uint8 4-bit codes, scale_bits uint8 [rows, n/block],
    (values_even, values_odd) bfloat16 code values times block scale (exact), and the
    record fields packed uint8 [rows, n/2] (element 2i low nibble) and mantissa bits
    uint8 [rows, n/8] (element 8i + j in bit j).
  """
  spec = get_format(fmt)
  rows, half = x_even.shape
  nb, h = 2 * half // spec.block_size, spec.block_size // 2
  even, odd = x_even.reshape(rows, nb, h), x_odd.reshape(rows, nb, h)
  amax_b = jnp.maximum(jnp.max(jnp.abs(even), axis=-1), jnp.max(jnp.abs(odd), axis=-1))
  finite = ~jnp.isnan(global_scale)  # [rows, 1]
  if spec.has_global_scale:
    scale_bits = numerics.e4m3_encode(numerics.true_divide(amax_b, 6.0) * global_scale)
  else:
    scale_bits = numerics.e8m0_encode(numerics.floor_log2(amax_b) - 2)
  step = numerics.true_divide(spec.decode_scales(scale_bits), global_scale)[..., None]
  codes = []
  for part in (even, odd):
    v = jnp.where(step > 0, numerics.true_divide(part, step), 0.0)
    exponent, _, units = numerics.e2m1_grid_units(jnp.abs(v))
    code = numerics.e2m1_sign(
      numerics.e2m1_unit_code(exponent, numerics.round_half_even(units)), v < 0
    )
    codes.append(jnp.where(finite[..., None], code, 0).astype(jnp.uint8).reshape(rows, half))
  scale_bits = jnp.where(finite, scale_bits, 0).astype(jnp.uint8)
  scale = _broadcast_blocks(spec.decode_scales(scale_bits).astype(jnp.bfloat16), 1, h)
  values = tuple(numerics.e2m1_bf16(c) * scale for c in codes)
  packed = codes[0] | (codes[1] << 4)
  quads = [(c & 1).astype(jnp.int32).reshape(rows, half // 4, 4) for c in codes]
  shifts = 2 * jax.lax.broadcasted_iota(jnp.int32, quads[0].shape, 2)
  bits = jnp.sum((quads[0] << shifts) + (quads[1] << (shifts + 1)), axis=-1).astype(jnp.uint8)
  return tuple(codes), scale_bits, values, packed, bits


def quantize_rows(
  x: jax.Array, fmt: str = "nvfp4"
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Per-row (per-token) nearest quantization of a tile [rows, n], in one pass.

  Bit for bit `fp4.quantize(x, fmt, axis=-1, global_group="row")`, plus the compact
  guidance bits of the result.

  Returns:
    packed uint8 [rows, n/2], scale bits uint8 [rows, n/block], global scale float32
    [rows, 1], mantissa bits uint8 [rows, n/8] (bit 0 of every code, 8 per byte).
  """
  spec = QuantSpec(fmt=fmt, axis=x.ndim - 1, group_axes=tuple(range(x.ndim - 1)))
  code, _, scale_bits, global_scale, _ = _quantize_last(spec, x, None, None)
  code = code.reshape(*code.shape[:-2], -1)
  return _pack_fields(code & 0xF, 4), scale_bits, global_scale, _pack_fields(code & 1, 1)


def _pack_fields(fields: jax.Array, width: int) -> jax.Array:
  """uint8 [..., n] holding `width`-bit values -> uint8 [..., n * width / 8], element i of
  a byte's group in bits [i * width, (i + 1) * width): `numerics.pack_codes` (width 4) and
  `numerics.pack_bits` (width 1), bit for bit.

  Each field is shifted into place and a byte's fields summed (they do not overlap): a
  reshape and a reduction over a power-of-two axis, which the Pallas Triton lowering has,
  where `numerics`' uint16/uint32 bitcasts of byte groups (faster in XLA on CPU) it lacks.
  """
  per_byte = 8 // width
  groups = fields.astype(jnp.int32).reshape(*fields.shape[:-1], -1, per_byte)
  shifts = width * jax.lax.broadcasted_iota(jnp.int32, groups.shape, groups.ndim - 1)
  return jnp.sum(groups << shifts, axis=-1).astype(jnp.uint8)
