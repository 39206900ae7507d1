"""Quantized arrays and compact guidance: pytrees of packed uint8 arrays.

A `QArray` keeps the quantized axis where the input had it: `packed` halves that axis,
`scales` divides it by the block size, and `global_scale` has size 1 there (and along
every axis its global group spans), so all three broadcast against one another and
against the original array. Axes are stored negative so that a QArray made inside `vmap`
still names the right axis once a batch axis is added in front.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from trace_jax.fp4 import numerics


@dataclasses.dataclass(frozen=True)
class Format:
  """A block-scaled FP4 format."""

  name: str
  block_size: int  # elements sharing one block scale
  has_global_scale: bool  # NVFP4: f32 per-group encode scale; MXFP4: none (ones)

  def decode_scales(self, bits: jax.Array) -> jax.Array:
    return numerics.e4m3_decode(bits) if self.has_global_scale else numerics.e8m0_decode(bits)

  def bits_per_element(self) -> float:
    """4-bit element plus its share of the 8-bit block scale."""
    return 4 + 8 / self.block_size


FORMATS = {
  "nvfp4": Format("nvfp4", block_size=16, has_global_scale=True),
  "mxfp4": Format("mxfp4", block_size=32, has_global_scale=False),
}


def get_format(fmt: str) -> Format:
  if fmt not in FORMATS:
    raise ValueError(f"fmt={fmt!r} is not a known FP4 format; allowed: {sorted(FORMATS)}")
  return FORMATS[fmt]


def _axis_shape(shape: tuple[int, ...], axis: int, factor: float) -> tuple[int, ...]:
  shape = list(shape)
  shape[axis] = int(shape[axis] * factor)
  return tuple(shape)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["packed", "scales", "global_scale"],
  meta_fields=["fmt", "axis"],
)
@dataclasses.dataclass(frozen=True)
class QArray:
  """An FP4 tensor: packed codes, block scales and global scales.

  Attributes:
    packed: uint8 [..., n/2 along `axis`], element 2i in the low nibble.
    scales: uint8 [..., n/block along `axis`]: E4M3 bits (NVFP4) or E8M0 bits (MXFP4).
    global_scale: float32, size 1 along `axis` and along the axes its group spans;
      the encode scale gs of DESIGN.md (decode multiplies by s_b / gs). Ones for MXFP4;
      NaN for a group that held NaN or Inf.
    fmt: "nvfp4" or "mxfp4".
    axis: the quantized (contraction) axis, negative.
  """

  packed: jax.Array
  scales: jax.Array
  global_scale: jax.Array
  fmt: str
  axis: int

  @property
  def format(self) -> Format:
    return get_format(self.fmt)

  @property
  def shape(self) -> tuple[int, ...]:
    """Shape of the dequantized tensor."""
    return _axis_shape(self.packed.shape, self.axis, 2)

  @property
  def nbytes(self) -> int:
    return int(self.packed.size + self.scales.size + 4 * self.global_scale.size)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["global_scale", "scales", "mantissa_bits"],
  meta_fields=["fmt", "axis"],
)
@dataclasses.dataclass(frozen=True)
class CompactGuidance:
  """What compact TRACE guidance keeps of a rollout's quantization: 1.5 bits per element.

  Attributes:
    global_scale: float32, as in the recorded `QArray`.
    scales: uint8 block-scale bits, as in the recorded `QArray`.
    mantissa_bits: uint8 [..., n/8 along `axis`]: bit 0 of every element's code, element
      8i + j in bit j.
    fmt: "nvfp4" or "mxfp4".
    axis: the quantized axis, negative.
  """

  global_scale: jax.Array
  scales: jax.Array
  mantissa_bits: jax.Array
  fmt: str
  axis: int

  @property
  def shape(self) -> tuple[int, ...]:
    return _axis_shape(self.mantissa_bits.shape, self.axis, 8)

  @property
  def nbytes(self) -> int:
    return int(self.mantissa_bits.size + self.scales.size + 4 * self.global_scale.size)


def check_qarray(q: QArray, what: str = "q") -> None:
  """Refuse a QArray whose fields do not fit together, before any work (shapes and dtypes
  are static, so this holds under jit too): `packed` and `scales` uint8, `scales` exactly
  the shape of `packed` with the quantized axis at 2 / block_size of its length (no
  broadcasting: a scale of the wrong shape would silently scale other blocks), and
  `global_scale` float, size 1 along the axis and broadcasting against the elements."""
  fmt = get_format(q.fmt)
  for name in ("packed", "scales"):
    dtype = getattr(q, name).dtype
    if dtype != jnp.uint8:
      raise ValueError(
        f"{what}.{name} has dtype {dtype}; it must be uint8 "
        f"({'two E2M1 codes per byte' if name == 'packed' else 'E4M3 / E8M0 scale bits'})"
      )
  packed = tuple(q.packed.shape)
  if not packed or not -len(packed) <= q.axis < 0:
    raise ValueError(f"{what}.axis={q.axis} is not a negative axis of packed shape {packed}")
  elements = 2 * packed[q.axis]
  if elements % fmt.block_size:
    raise ValueError(
      f"{what}.packed has shape {packed}: {elements} elements along axis {q.axis}, not a "
      f"multiple of the {q.fmt} block of {fmt.block_size}"
    )
  want = list(packed)
  want[q.axis] = elements // fmt.block_size
  want = tuple(want)
  if tuple(q.scales.shape) != want:
    raise ValueError(
      f"{what}.scales has shape {tuple(q.scales.shape)}; packed {packed} ({q.fmt}, axis "
      f"{q.axis}) needs block scales of shape {want}, one per {fmt.block_size} elements"
    )
  gs = tuple(q.global_scale.shape)
  shape = _axis_shape(packed, q.axis, 2)
  if not jnp.issubdtype(q.global_scale.dtype, jnp.floating):
    raise ValueError(f"{what}.global_scale has dtype {q.global_scale.dtype}; it must be float")
  if len(gs) != len(shape) or gs[q.axis] != 1 or any(g not in (1, n) for g, n in zip(gs, shape)):
    raise ValueError(
      f"{what}.global_scale has shape {gs}; it needs {len(shape)} axes, size 1 along the "
      f"quantized axis {q.axis}, and to broadcast against the elements' shape {shape}"
    )


@jax.jit
def codes(q: QArray) -> jax.Array:
  """Unpacked 4-bit codes, uint8 with the dequantized shape (bit 3 = sign)."""
  if q.packed.dtype != jnp.uint8:
    raise ValueError(f"q.packed has dtype {q.packed.dtype}; it must be uint8 (two codes a byte)")
  return numerics.unpack_codes(q.packed, q.axis)


def _expand_blocks(scale: jax.Array, axis: int, block_size: int) -> jax.Array:
  """Repeat a per-block quantity along `axis` so it lines up with the elements."""
  return jnp.repeat(scale, block_size, axis=axis)


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
  """x_hat = code value * (s_b / gs), computed in float32, then cast to `dtype`.

  Raises:
    ValueError: `q`'s fields do not fit together (`check_qarray`).
  """
  check_qarray(q)
  fmt = q.format
  step = numerics.true_divide(fmt.decode_scales(q.scales), q.global_scale)  # s_b / gs, per block
  values = numerics.e2m1_decode(codes(q)) * _expand_blocks(step, q.axis, fmt.block_size)
  return values.astype(dtype)


@jax.jit
def block_scaled_values(q: QArray) -> jax.Array:
  """c * s_b of every element, without the global scale (float32, the dequantized shape):
  what FP4 kernels multiply before they divide by the global scales, after accumulating."""
  check_qarray(q)
  fmt = q.format
  return numerics.e2m1_decode(codes(q)) * _expand_blocks(
    fmt.decode_scales(q.scales), q.axis, fmt.block_size
  )


@jax.jit
def mantissa_bits(q: QArray) -> jax.Array:
  """Compact-guidance bits of `q`: bit 0 of every code, packed 8 per uint8 along its axis."""
  return numerics.pack_bits(codes(q) & 1, q.axis)


def compact_guidance(q: QArray, bits: jax.Array | None = None) -> CompactGuidance:
  """The compact guidance a rollout records for a quantized activation; `bits`: its
  mantissa bits when a kernel already emitted them (else derived from the codes)."""
  return CompactGuidance(
    global_scale=q.global_scale,
    scales=q.scales,
    mantissa_bits=mantissa_bits(q) if bits is None else bits,
    fmt=q.fmt,
    axis=q.axis,
  )
