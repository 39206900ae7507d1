"""Block-scaled FP4 quantization: NVFP4 and MXFP4, three rounding modes, fake quantization.

NVFP4 (DESIGN.md section 1, the compressed-tensors / TransformerEngine convention):
  1. gs = (448 * 6) / amax(|x| over the global group), gs = 1 where amax is 0;
  2. s_b = e4m3(min(amax_b / 6 * gs, 448)) per block of 16 along the quantized axis;
  3. v = x / (s_b / gs), in that order (v = 0 where s_b = 0);
  4. code = e2m1(v) by the rounding mode; decode x_hat = code * (s_b / gs).
Every division is a true IEEE division (`numerics.true_divide`), so exact ties (frequent
with bf16 inputs) round as the spec says, bit for bit with compressed-tensors.
MXFP4 (OCP MX v1.0): s_b = 2^(floor(log2(amax_b)) - 2) as E8M0, blocks of 32, gs = 1.

Block scale rules (NVFP4, nearest rounding): "standard" is step 2 above, the block's amax
maps to 6, the largest E2M1 value. "4over6" ("Four Over Six", adaptive block scaling) also
tries s4 = e4m3(min(amax_b / 4 * gs, 448)), mapping the amax to 4, and keeps, per block,
whichever scale reconstructs the block with the smaller squared error (the standard one on a
tie). Mapping to 4 trades range for resolution near the top of the block: E2M1 has no value
between 4 and 6, so values around 5 / 6 of the amax round badly under the standard scale.
The global scale stays the standard one, so the blocks whose 4-scale would exceed 448 clip
and (reconstructing worse) keep the standard scale.

The three rounding modes share steps 1-3 and the grid neighbours of |v|; they differ only
in which neighbour they take. Guided rounding (TRACE, DESIGN.md section 3) skips steps 1-2
and reuses the rollout's recorded scales.

A global group that holds NaN or Inf gets a NaN global scale, so it dequantizes to NaN
instead of silently to zero (which is what a plain cast to E2M1 does); the codes and block
scales of such a group carry no meaning.

The static choices of a call (format, axis, global groups, rounding, scale rule, record
form) travel to the jitted and custom_vjp cores as one hashable `spec.QuantSpec`; the
arrays (x, key, guidance, a static global scale) as ordinary pytree arguments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from trace_jax.fp4 import numerics, sparse
from trace_jax.fp4.qarray import CompactGuidance, QArray
from trace_jax.fp4.sparse import SparseGuidance
from trace_jax.fp4.spec import GlobalGroup, TensorGuidance, QuantSpec, resolve


def _to_last(a: jax.Array, axis: int) -> jax.Array:
  return jnp.moveaxis(a, axis, -1)


def _unblock(a: jax.Array, axis: int) -> jax.Array:
  """[..., nb, bs] with the quantized axis last -> the input's layout."""
  return jnp.moveaxis(a.reshape(*a.shape[:-2], -1), -1, axis)


def _quantize_last(spec: QuantSpec, x, key, guidance, static_scale=None):
  """The code path all modes share, on validated arguments, with the quantized axis last.

  `static_scale` (NVFP4, not guided): a given encode scale gs, broadcast over the groups,
  instead of the one computed from each group's amax (a calibrated, static activation
  scale as the W4A4 compressed-tensors scheme stores it). Block scales above 448 clip and
  elements above 6 saturate, as the format's own quantizer does.

  Returns (codes [..., nb, bs], values [..., nb, bs] (the codes' E2M1 values, before the
  scale), scale_bits [..., nb], global_scale [..., 1] (NaN for non-finite groups),
  fell_back [..., nb, bs]).
  """
  fmt, axis, rounding = spec.format, spec.axis, spec.rounding
  bs = fmt.block_size
  xl = _to_last(x.astype(jnp.float32), axis)  # [..., n]
  # Axis `a` of x sits at position a (a < axis) or a - 1 (a > axis) once axis is last.
  last_group_axes = tuple(a if a < axis else a - 1 for a in spec.group_axes)
  reduce_axes = tuple(a for a in range(xl.ndim) if a not in last_group_axes)
  blocks = xl.reshape(*xl.shape[:-1], xl.shape[-1] // bs, bs)  # [..., nb, bs]
  # Block amax, then the group's from the blocks'. Whether a group is finite is checked
  # on its own: a max may drop NaN (Pallas kernels on CPU and GPU do).
  amax_b = jnp.max(jnp.abs(blocks), axis=-1)  # [..., nb]
  amax = jnp.max(amax_b, axis=reduce_axes, keepdims=True)  # [..., 1]
  # A min over int32 flags, not jnp.all: Pallas' Triton lowering has no reduce_and.
  finite_b = jnp.min(jnp.isfinite(blocks).astype(jnp.int32), axis=-1)  # [..., nb]
  finite = jnp.min(finite_b, axis=reduce_axes, keepdims=True) == 1

  sparse_dense = None
  if rounding == "guided" and not isinstance(guidance, SparseGuidance):
    global_scale = _to_last(guidance.global_scale.astype(jnp.float32), axis)
    scale_bits = _to_last(guidance.scales, axis)
  else:
    if fmt.has_global_scale and static_scale is not None:
      global_scale = jnp.broadcast_to(_to_last(static_scale.astype(jnp.float32), axis), amax.shape)
      scale_bits = numerics.e4m3_encode(numerics.true_divide(amax_b, 6.0) * global_scale)
    elif fmt.has_global_scale:
      # True divisions (numerics.true_divide), as the spec divides: a reciprocal
      # multiply would flip exact ties of the block scale and of the codes.
      global_scale = numerics.nvfp4_global_scale(amax)
      scale_bits = numerics.e4m3_encode(numerics.true_divide(amax_b, 6.0) * global_scale)
    else:
      global_scale = jnp.ones(finite.shape, jnp.float32)
      scale_bits = numerics.e8m0_encode(numerics.floor_log2(amax_b) - 2)
    if spec.scale_rule == "4over6":
      scale_bits = _four_over_six(blocks, amax_b, global_scale, scale_bits)
    if rounding == "guided":  # sparse: own scales, the recorded ones where flagged
      sparse_dense = sparse.expand(guidance, xl.shape)
      scale_bits = jnp.where(sparse_dense[2], sparse_dense[3], scale_bits)

  step = numerics.true_divide(fmt.decode_scales(scale_bits), global_scale)[..., None]  # s_b / gs
  v = jnp.where(step > 0, numerics.true_divide(blocks, step), 0.0)  # q = 0 where s_b = 0
  exponent, spacing, units = numerics.e2m1_grid_units(jnp.abs(v))
  lo_units, hi_units = jnp.floor(units), jnp.ceil(units)
  fell_back = jnp.zeros(v.shape, bool)
  if rounding == "nearest":
    chosen = numerics.round_half_even(units)  # even units are even codes
  elif rounding == "stochastic":
    uniform = jax.random.uniform(key, v.shape, jnp.float32)
    chosen = lo_units + (uniform < units - lo_units)  # hi with probability frac(units)
  else:
    lo_code = numerics.e2m1_unit_code(exponent, lo_units)
    hi_code = numerics.e2m1_unit_code(exponent, hi_units)
    if sparse_dense is not None:  # the recorded bit where flagged, nearest elsewhere
      flags = sparse_dense[0].reshape(v.shape)
      bits = sparse_dense[1].reshape(v.shape)
      follow = jnp.where((hi_code & 1) == (bits & 1), hi_units, lo_units)
      chosen = jnp.where(flags, follow, numerics.round_half_even(units))
      fell_back = flags & (lo_code == hi_code) & ((lo_code & 1) != (bits & 1))
    elif isinstance(guidance, CompactGuidance):
      bits = numerics.unpack_bits(_to_last(guidance.mantissa_bits, axis)).reshape(v.shape)
      chosen = jnp.where((hi_code & 1) == (bits & 1), hi_units, lo_units)
      fell_back = (lo_code == hi_code) & ((lo_code & 1) != (bits & 1))
    else:
      recorded = numerics.unpack_codes(_to_last(guidance.packed, axis)).reshape(v.shape) & 7
      fell_back = (recorded != lo_code) & (recorded != hi_code)
      chosen = jnp.where(
        recorded == lo_code,
        lo_units,
        jnp.where(recorded == hi_code, hi_units, numerics.round_half_even(units)),
      )
  negative = v < 0
  code = numerics.e2m1_sign(numerics.e2m1_unit_code(exponent, chosen), negative)
  magnitude = numerics.e2m1_unit_value(chosen, spacing)
  value = jnp.where(negative & (magnitude > 0), -magnitude, magnitude)  # 0 stays +0
  # A non-finite group is marked by its NaN global scale; its codes and block scales are
  # zeroed so that every implementation (XLA or a kernel) writes the same bytes there.
  code = jnp.where(finite[..., None], code, 0).astype(code.dtype)
  scale_bits = jnp.where(finite, scale_bits, 0).astype(scale_bits.dtype)
  global_scale = jnp.where(finite, global_scale, jnp.nan)
  return code, value, scale_bits, global_scale, fell_back


def _block_sq_error(blocks, scale_bits, global_scale):
  """Squared error [..., nb] of nearest-rounding `blocks` [..., nb, bs] with these NVFP4
  block scales (the decode of steps 3-4 above)."""
  step = numerics.true_divide(numerics.e4m3_decode(scale_bits), global_scale)[..., None]
  v = jnp.where(step > 0, numerics.true_divide(blocks, step), 0.0)
  _, spacing, units = numerics.e2m1_grid_units(jnp.abs(v))
  magnitude = numerics.e2m1_unit_value(numerics.round_half_even(units), spacing)
  decoded = jnp.where(v < 0, -magnitude, magnitude) * step
  return jnp.sum(jnp.square(decoded - blocks), axis=-1)


def _four_over_six(blocks, amax_b, global_scale, scale_bits):
  """Per block, the standard scale (amax -> 6) or the one mapping amax -> 4, whichever
  reconstructs the block better (the standard one on a tie)."""
  scale4 = numerics.e4m3_encode(numerics.true_divide(amax_b, 4.0) * global_scale)
  better4 = _block_sq_error(blocks, scale4, global_scale) < _block_sq_error(
    blocks, scale_bits, global_scale
  )
  return jnp.where(better4, scale4, scale_bits)


def _record(
  spec: QuantSpec, form: str, code, scale_bits, global_scale, ndim: int
) -> TensorGuidance:
  """The `QArray` (form "full") or its `CompactGuidance` ("compact"), in the input's layout,
  from `_quantize_last`'s codes and scales."""
  axis = spec.axis
  flat = code.reshape(*code.shape[:-2], -1)  # [..., n]
  scales = jnp.moveaxis(scale_bits, -1, axis)
  global_scale = jnp.moveaxis(global_scale, -1, axis)
  if form == "full":
    packed = jnp.moveaxis(numerics.pack_codes(flat), -1, axis)
    return QArray(
      packed=packed, scales=scales, global_scale=global_scale, fmt=spec.fmt, axis=axis - ndim
    )
  # The mantissa bit is the code's lowest bit: packed from the codes, never re-derived.
  bits = jnp.moveaxis(numerics.pack_bits(flat & 1), -1, axis)
  return CompactGuidance(
    global_scale=global_scale, scales=scales, mantissa_bits=bits, fmt=spec.fmt, axis=axis - ndim
  )


@functools.partial(jax.jit, static_argnums=0)
def _quantize(spec: QuantSpec, x, key, guidance, static_scale):
  """(the packed `QArray`, the fell_back mask in x's layout)."""
  code, _, scale_bits, global_scale, fell_back = _quantize_last(
    spec, x, key, guidance, static_scale
  )
  q = _record(spec, "full", code, scale_bits, global_scale, x.ndim)
  return q, _unblock(fell_back, spec.axis)


@functools.partial(jax.jit, static_argnums=0)
def _fake_quant(spec: QuantSpec, x, key, guidance, static_scale):
  """dequantize(quantize(x)) without packing: the same ops as `dequantize`, bit for bit.
  With `spec.record`, also the record and fell_back mask of that one quantization, as
  `_quantize` (and `compact_guidance`) give them, bit for bit."""
  code, value, scale_bits, global_scale, fell_back = _quantize_last(
    spec, x, key, guidance, static_scale
  )
  step = numerics.true_divide(spec.format.decode_scales(scale_bits), global_scale)  # s_b / gs
  values = _unblock(value * step[..., None], spec.axis).astype(x.dtype)
  if spec.record is None:
    return values
  record = _record(spec, spec.record, code, scale_bits, global_scale, x.ndim)
  return values, record, _unblock(fell_back, spec.axis)


def _fake_quant_fwd(spec: QuantSpec, x, key, guidance, static_scale):
  return _fake_quant(spec, x, key, guidance, static_scale), static_scale


def _fake_quant_bwd(spec: QuantSpec, static_scale, g):
  """Straight through to x; the key, the guidance and a record carry no gradient, and a
  static scale gets zeros."""
  g_values = g if spec.record is None else g[0]
  zero_scale = None if static_scale is None else jnp.zeros_like(static_scale)
  return g_values, None, None, zero_scale


# The spec is the one nondiff argument: static and hashable, never an array.
_fake_quant_ste = jax.custom_vjp(_fake_quant, nondiff_argnums=(0,))
_fake_quant_ste.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def quantize_with_fallbacks(
  x: jax.Array,
  fmt: str = "nvfp4",
  *,
  axis: int = -1,
  global_group: GlobalGroup = "tensor",
  rounding: str = "nearest",
  key: jax.Array | None = None,
  guidance: TensorGuidance | None = None,
  global_scale: jax.Array | None = None,
  scale_rule: str = "standard",
) -> tuple[QArray, jax.Array]:
  """`quantize`, also returning a bool mask (input shape) of guidance fallbacks.

  Full guidance falls back where the recorded code is not one of the two grid neighbours of
  the training value (nearest rounding is used instead). Compact guidance falls back where
  the value sits exactly on the grid or saturates, so its only neighbour's lowest bit
  differs from the recorded one (that neighbour is taken). Other modes never fall back.
  """
  spec, x, static_scale = resolve(
    x, fmt, axis, global_group, rounding, key, guidance, global_scale, scale_rule
  )
  return _quantize(spec, x, key, guidance, static_scale)


def quantize(
  x: jax.Array,
  fmt: str = "nvfp4",
  *,
  axis: int = -1,
  global_group: GlobalGroup = "tensor",
  rounding: str = "nearest",
  key: jax.Array | None = None,
  guidance: TensorGuidance | None = None,
  global_scale: jax.Array | None = None,
  scale_rule: str = "standard",
) -> QArray:
  """Quantize `x` to block-scaled FP4 along `axis`.

  Args:
    x: floating array; computed in float32.
    fmt: "nvfp4" (blocks of 16, E4M3 scales, f32 global scale) or "mxfp4" (blocks of 32,
      E8M0 scales).
    axis: the quantized (contraction) axis; its length must be a multiple of the block.
    global_group: which elements share a global scale: "tensor" (all), "row" (one per
      index of the other axes: per token), or an int / tuple of axes that each get their
      own (e.g. 0 for stacked expert weights [E, K, N]). Ignored with guidance, whose
      global_scale already fixes the groups.
    rounding: "nearest" (round-half-to-even), "stochastic" (unbiased, needs `key`) or
      "guided" (needs `guidance`).
    key: PRNG key for stochastic rounding.
    guidance: for "guided": a `QArray` the rollout recorded (full guidance: its codes) or
      a `CompactGuidance` (its mantissa bits); its global and block scales are reused.
    global_scale: NVFP4 only: a fixed encode scale gs (float32, size 1 along `axis`,
      broadcast to x) used instead of 448 * 6 / amax of each group: a static, calibrated
      scale (elements beyond 6 * 448 / gs saturate).
    scale_rule: NVFP4 block scales, nearest rounding: "standard" (amax -> 6) or "4over6"
      (per block, amax -> 6 or amax -> 4, whichever reconstructs better; module docstring).

  Returns:
    A `QArray`.
  """
  spec, x, static_scale = resolve(
    x, fmt, axis, global_group, rounding, key, guidance, global_scale, scale_rule
  )
  return _quantize(spec, x, key, guidance, static_scale)[0]


def fake_quant(
  x: jax.Array,
  fmt: str = "nvfp4",
  *,
  axis: int = -1,
  global_group: GlobalGroup = "tensor",
  rounding: str = "nearest",
  key: jax.Array | None = None,
  guidance: TensorGuidance | None = None,
  global_scale: jax.Array | None = None,
  scale_rule: str = "standard",
) -> jax.Array:
  """dequantize(quantize(x, ...)) in x's dtype, with a straight-through gradient.

  The gradient is the identity: a plain `astype(float4_e2m1fn)` would round the gradient
  to FP4 too (the transpose of a convert is a convert). `key` and `guidance` are ordinary
  pytree arguments (they work under jit, vmap, scan and grad; their cotangents are zero).
  Arguments as for `quantize`.
  """
  spec, x, static_scale = resolve(
    x, fmt, axis, global_group, rounding, key, guidance, global_scale, scale_rule
  )
  return _fake_quant_ste(spec, x, key, guidance, static_scale)


def fake_quant_record(
  x: jax.Array,
  fmt: str = "nvfp4",
  *,
  form: str = "full",
  axis: int = -1,
  global_group: GlobalGroup = "tensor",
  rounding: str = "nearest",
  key: jax.Array | None = None,
  guidance: TensorGuidance | None = None,
) -> tuple[jax.Array, TensorGuidance, jax.Array]:
  """`fake_quant` and its record from one quantization (what a recording site needs).

  The record is in the form TRACE guidance stores: `form="full"` gives the `QArray`
  (`quantize`), `form="compact"` its `CompactGuidance` (`compact_guidance(quantize(...))`),
  both bit for bit, without quantizing twice or unpacking the codes again.

  Returns:
    (values as `fake_quant` (straight-through gradient), record, fell_back bool mask as
    `quantize_with_fallbacks`).
  """
  spec, x, _ = resolve(x, fmt, axis, global_group, rounding, key, guidance, record=form)
  return _fake_quant_ste(spec, x, key, guidance, None)
