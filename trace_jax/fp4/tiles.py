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
