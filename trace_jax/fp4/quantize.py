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
"""

from __future__ import annotations

import functools
from typing import Any, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.fp4 import numerics, sparse
from trace_jax.fp4.qarray import CompactGuidance, QArray, get_format
from trace_jax.fp4.sparse import SparseGuidance

ROUNDING_MODES = ("nearest", "stochastic", "guided")
SCALE_RULES = ("standard", "4over6")
GlobalGroup = Union[str, int, Sequence[int]]
Guidance = Union[QArray, CompactGuidance, SparseGuidance]

_F32_MAX = float(np.finfo(np.float32).max)


def _group_axes(global_group: GlobalGroup, ndim: int, axis: int) -> tuple[int, ...]:
  """Axes that index separate global groups (non-negative, sorted).

  "tensor": none (one global scale for the whole tensor, leading batch axes included);
  "row": every axis but the quantized one (one per token); an int or a sequence of ints:
  exactly those axes, e.g. `global_group=0` for stacked expert weights [E, K, N] gives one
  global scale per expert.
  """
  if isinstance(global_group, str):
    if global_group == "tensor":
      return ()
    if global_group == "row":
      return tuple(a for a in range(ndim) if a != axis)
    raise ValueError(
      f"global_group={global_group!r} is not allowed; use 'tensor', 'row', or the axes "
      "(an int or a tuple of ints) that each get their own global scale"
    )
  axes = (global_group,) if isinstance(global_group, (int, np.integer)) else tuple(global_group)
  normalised = []
  for a in axes:
    if not isinstance(a, (int, np.integer)) or not -ndim <= a < ndim:
      raise ValueError(f"global_group axis {a!r} is out of range for a {ndim}-d input")
    if a % ndim == axis:
      raise ValueError(f"global_group axis {a} is the quantized axis; a global group must span it")
    normalised.append(int(a) % ndim)
  return tuple(sorted(set(normalised)))


def _check_guidance(guidance: Any, shape: tuple[int, ...], fmt: str, axis: int) -> None:
  """Raise a ValueError unless `guidance` was recorded for a tensor like this one."""
  if not isinstance(guidance, (QArray, CompactGuidance, SparseGuidance)):
    raise ValueError(
      "rounding='guided' needs guidance=QArray (full guidance: recorded codes), "
      "CompactGuidance (scales + mantissa bits) or SparseGuidance (flagged bits and "
      f"scales); got {type(guidance).__name__}"
    )
  if isinstance(guidance, SparseGuidance):
    if fmt != guidance.fmt or axis != len(shape) - 1 or tuple(guidance.shape) != tuple(shape):
      raise ValueError(
        f"sparse guidance was recorded for rows {guidance.shape} in "
        f"fmt={guidance.fmt!r} along the last axis; the input has shape {shape}, "
        f"fmt={fmt!r}, axis {axis}"
      )
    return
  kind = "full" if isinstance(guidance, QArray) else "compact"
  if guidance.fmt != fmt:
    raise ValueError(f"{kind} guidance was recorded in fmt={guidance.fmt!r}, not {fmt!r}")
  ndim = len(shape)
  if guidance.axis % ndim != axis or len(guidance.shape) != ndim:
    raise ValueError(
      f"{kind} guidance has axis {guidance.axis} for shape {guidance.shape}; the input has "
      f"axis {axis - ndim} and shape {shape}"
    )
  if tuple(guidance.shape) != tuple(shape):
    raise ValueError(f"{kind} guidance was recorded for shape {guidance.shape}, input is {shape}")
  gs_shape = tuple(guidance.global_scale.shape)
  bad_gs = (
    len(gs_shape) != ndim
    or gs_shape[axis] != 1
    or any(g not in (1, s) for g, s in zip(gs_shape, shape))
  )
  if bad_gs:
    raise ValueError(
      f"{kind} guidance global_scale has shape {gs_shape}; it must have size 1 along the "
      f"quantized axis and broadcast against {shape}"
    )


def _validate(x, fmt, axis, rounding, key, guidance, scale_rule="standard") -> tuple[int, Any]:
  spec = get_format(fmt)
  if rounding not in ROUNDING_MODES:
    raise ValueError(f"rounding={rounding!r} is not allowed; use one of {ROUNDING_MODES}")
  if scale_rule not in SCALE_RULES:
    raise ValueError(f"scale_rule={scale_rule!r} is not allowed; use one of {SCALE_RULES}")
  if scale_rule != "standard" and (not spec.has_global_scale or rounding != "nearest"):
    raise ValueError(
      f"scale_rule={scale_rule!r} chooses NVFP4 block scales under nearest "
      f"rounding; got fmt={fmt!r}, rounding={rounding!r}"
    )
  x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating array to quantize; got dtype {x.dtype}")
  if x.ndim == 0:
    raise ValueError("x must have at least one axis to quantize; got a scalar")
  if x.size == 0:  # no amax, no scales: refuse rather than fail inside a reduction
    raise ValueError(f"x has shape {x.shape}, no elements to quantize")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis={axis} is out of range for x of shape {x.shape}")
  axis = axis % x.ndim
  n = x.shape[axis]
  if n % spec.block_size:
    raise ValueError(
      f"{fmt} quantizes blocks of {spec.block_size}: axis {axis} of x has length {n}, "
      f"not a multiple of {spec.block_size} (shape {x.shape})"
    )
  if rounding == "stochastic" and key is None:
    raise ValueError("rounding='stochastic' needs key= (a jax.random key)")
  if rounding == "guided":
    if guidance is None:
      raise ValueError("rounding='guided' needs guidance= (a QArray or CompactGuidance)")
    _check_guidance(guidance, x.shape, fmt, axis)
  elif guidance is not None:
    raise ValueError(f"guidance= is only used with rounding='guided', not {rounding!r}")
  return axis, x


def _to_last(a: jax.Array, axis: int) -> jax.Array:
  return jnp.moveaxis(a, axis, -1)


def quantize_with_fallbacks(
  x: jax.Array,
  fmt: str = "nvfp4",
  *,
  axis: int = -1,
  global_group: GlobalGroup = "tensor",
  rounding: str = "nearest",
  key: jax.Array | None = None,
  guidance: Guidance | None = None,
  global_scale: jax.Array | None = None,
  scale_rule: str = "standard",
) -> tuple[QArray, jax.Array]:
  """`quantize`, also returning a bool mask (input shape) of guidance fallbacks.

  Full guidance falls back where the recorded code is not one of the two grid neighbours of
  the training value (nearest rounding is used instead). Compact guidance falls back where
  the value sits exactly on the grid or saturates, so its only neighbour's lowest bit
  differs from the recorded one (that neighbour is taken). Other modes never fall back.
  """
  x, axis, group_axes = _resolve(x, fmt, axis, global_group, rounding, key, guidance, scale_rule)
  static_scale = _check_static_scale(global_scale, x, fmt, axis, rounding)
  return _quantize(x, key, guidance, fmt, axis, group_axes, rounding, static_scale, scale_rule)


def _check_static_scale(global_scale, x, fmt, axis, rounding):
  """A given NVFP4 encode scale: float, size 1 along `axis`, broadcastable to x."""
  if global_scale is None:
    return None
  if not get_format(fmt).has_global_scale:
    raise ValueError(f"global_scale= is an NVFP4 encode scale; fmt={fmt!r} has none")
  if rounding == "guided":
    raise ValueError("global_scale= and rounding='guided' both fix the scales; pass one")
  gs = jnp.asarray(global_scale, jnp.float32)
  if (
    gs.ndim != x.ndim
    or gs.shape[axis] != 1
    or any(g not in (1, n) for g, n in zip(gs.shape, x.shape))
  ):
    raise ValueError(
      f"global_scale has shape {gs.shape}; it needs {x.ndim} axes, size 1 "
      f"along the quantized axis {axis}, and to broadcast against {x.shape}"
    )
  return gs


def _resolve(x, fmt, axis, global_group, rounding, key, guidance, scale_rule="standard"):
  """Validate, then return (x, axis >= 0, group_axes) for the jitted core."""
  axis, x = _validate(x, fmt, axis, rounding, key, guidance, scale_rule)
  if rounding == "guided" and not isinstance(guidance, SparseGuidance):
    # The guidance's global scale fixes the groups (its non-unit axes).
    gs_shape = guidance.global_scale.shape
    group_axes = tuple(a for a in range(x.ndim) if gs_shape[a] != 1)
  else:
    group_axes = _group_axes(global_group, x.ndim, axis)
  return x, axis, group_axes


def _quantize_last(
  x, key, guidance, fmt, axis, group_axes, rounding, static_scale=None, scale_rule="standard"
):
  """The code path all modes share, on validated arguments, with the quantized axis last.

  `static_scale` (NVFP4, not guided): a given encode scale gs, broadcast over the groups,
  instead of the one computed from each group's amax (a calibrated, static activation
  scale as the W4A4 compressed-tensors scheme stores it). Block scales above 448 clip and
  elements above 6 saturate, as the format's own quantizer does.

  Returns (codes [..., nb, bs], values [..., nb, bs] (the codes' E2M1 values, before the
  scale), scale_bits [..., nb], global_scale [..., 1] (NaN for non-finite groups),
  fell_back [..., nb, bs]).
  """
  spec = get_format(fmt)
  bs = spec.block_size
  xl = _to_last(x.astype(jnp.float32), axis)  # [..., n]
  # Axis `a` of x sits at position a (a < axis) or a - 1 (a > axis) once axis is last.
  last_group_axes = tuple(a if a < axis else a - 1 for a in group_axes)
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
    if spec.has_global_scale and static_scale is not None:
      global_scale = jnp.broadcast_to(_to_last(static_scale.astype(jnp.float32), axis), amax.shape)
      scale_bits = numerics.e4m3_encode(numerics.true_divide(amax_b, 6.0) * global_scale)
    elif spec.has_global_scale:
      # gs = 1 where amax is 0; stay finite where amax is f32-subnormal.
      # True divisions (numerics.true_divide), as the spec divides: a reciprocal
      # multiply would flip exact ties of the block scale and of the codes.
      global_scale = jnp.minimum(
        numerics.true_divide(448.0 * 6.0, jnp.where(amax > 0, amax, 448.0 * 6.0)), _F32_MAX
      )
      scale_bits = numerics.e4m3_encode(numerics.true_divide(amax_b, 6.0) * global_scale)
    else:
      global_scale = jnp.ones(finite.shape, jnp.float32)
      scale_bits = numerics.e8m0_encode(numerics.floor_log2(amax_b) - 2)
    if scale_rule == "4over6":
      scale_bits = _four_over_six(blocks, amax_b, global_scale, scale_bits)
    if rounding == "guided":  # sparse: own scales, the recorded ones where flagged
      sparse_dense = sparse.expand(guidance, xl.shape)
      scale_bits = jnp.where(sparse_dense[2], sparse_dense[3], scale_bits)

  step = numerics.true_divide(spec.decode_scales(scale_bits), global_scale)[..., None]  # s_b / gs
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


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 8))
def _quantize(
  x, key, guidance, fmt, axis, group_axes, rounding, static_scale=None, scale_rule="standard"
):
  code, _, scale_bits, global_scale, fell_back = _quantize_last(
    x, key, guidance, fmt, axis, group_axes, rounding, static_scale, scale_rule
  )
  flat_shape = (*code.shape[:-2], -1)
  q = QArray(
    packed=jnp.moveaxis(numerics.pack_codes(code.reshape(flat_shape)), -1, axis),
    scales=jnp.moveaxis(scale_bits, -1, axis),
    global_scale=jnp.moveaxis(global_scale, -1, axis),
    fmt=fmt,
    axis=axis - x.ndim,
  )
  return q, jnp.moveaxis(fell_back.reshape(flat_shape), -1, axis)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 8))
def _fake_quant_values(
  x, key, guidance, fmt, axis, group_axes, rounding, static_scale=None, scale_rule="standard"
):
  """dequantize(quantize(x)) without packing: the same ops as `dequantize`, bit for bit."""
  _, value, scale_bits, global_scale, _ = _quantize_last(
    x, key, guidance, fmt, axis, group_axes, rounding, static_scale, scale_rule
  )
  step = numerics.true_divide(get_format(fmt).decode_scales(scale_bits), global_scale)  # s_b / gs
  values = value * step[..., None]
  return jnp.moveaxis(values.reshape(*value.shape[:-2], -1), -1, axis).astype(x.dtype)


def quantize(
  x: jax.Array,
  fmt: str = "nvfp4",
  *,
  axis: int = -1,
  global_group: GlobalGroup = "tensor",
  rounding: str = "nearest",
  key: jax.Array | None = None,
  guidance: Guidance | None = None,
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
  q, _ = quantize_with_fallbacks(
    x,
    fmt,
    axis=axis,
    global_group=global_group,
    rounding=rounding,
    key=key,
    guidance=guidance,
    global_scale=global_scale,
    scale_rule=scale_rule,
  )
  return q


def fake_quant(
  x: jax.Array,
  fmt: str = "nvfp4",
  *,
  axis: int = -1,
  global_group: GlobalGroup = "tensor",
  rounding: str = "nearest",
  key: jax.Array | None = None,
  guidance: Guidance | None = None,
  global_scale: jax.Array | None = None,
  scale_rule: str = "standard",
) -> jax.Array:
  """dequantize(quantize(x, ...)) in x's dtype, with a straight-through gradient.

  The gradient is the identity: a plain `astype(float4_e2m1fn)` would round the gradient
  to FP4 too (the transpose of a convert is a convert). `key` and `guidance` are ordinary
  pytree arguments (they work under jit, vmap, scan and grad; their cotangents are zero).
  Arguments as for `quantize`.
  """
  x, axis, group_axes = _resolve(x, fmt, axis, global_group, rounding, key, guidance, scale_rule)
  static_scale = _check_static_scale(global_scale, x, fmt, axis, rounding)
  return _fake_quant_ste(
    x, key, guidance, fmt, axis, group_axes, rounding, static_scale, scale_rule
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 8))
def _fake_quant_ste(
  x, key, guidance, fmt, axis, group_axes, rounding, static_scale, scale_rule="standard"
):
  return _fake_quant_values(
    x, key, guidance, fmt, axis, group_axes, rounding, static_scale, scale_rule
  )


def _fake_quant_fwd(
  x, key, guidance, fmt, axis, group_axes, rounding, static_scale, scale_rule="standard"
):
  values = _fake_quant_values(
    x, key, guidance, fmt, axis, group_axes, rounding, static_scale, scale_rule
  )
  return values, static_scale


def _fake_quant_bwd(fmt, axis, group_axes, rounding, scale_rule, static_scale, g):
  del fmt, axis, group_axes, rounding, scale_rule
  zero_scale = None if static_scale is None else jnp.zeros_like(static_scale)
  return g, None, None, zero_scale


_fake_quant_ste.defvjp(_fake_quant_fwd, _fake_quant_bwd)


RECORD_FORMS = ("compact", "full")


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _fake_quant_record(x, key, guidance, fmt, axis, group_axes, rounding, form):
  """One pass of `_quantize_last`: the values of `_fake_quant_values` and the record of
  `_quantize` (full) or of `compact_guidance(_quantize(...))` (compact), bit for bit."""
  code, value, scale_bits, global_scale, fell_back = _quantize_last(
    x, key, guidance, fmt, axis, group_axes, rounding
  )
  step = numerics.true_divide(get_format(fmt).decode_scales(scale_bits), global_scale)
  values = value * step[..., None]
  values = jnp.moveaxis(values.reshape(*value.shape[:-2], -1), -1, axis).astype(x.dtype)
  flat = code.reshape(*code.shape[:-2], -1)
  scales = jnp.moveaxis(scale_bits, -1, axis)
  global_scale = jnp.moveaxis(global_scale, -1, axis)
  if form == "full":
    record = QArray(
      packed=jnp.moveaxis(numerics.pack_codes(flat), -1, axis),
      scales=scales,
      global_scale=global_scale,
      fmt=fmt,
      axis=axis - x.ndim,
    )
  else:  # the mantissa bit is the code's lowest bit; packed from the codes, never re-derived
    record = CompactGuidance(
      global_scale=global_scale,
      scales=scales,
      mantissa_bits=jnp.moveaxis(numerics.pack_bits(flat & 1), -1, axis),
      fmt=fmt,
      axis=axis - x.ndim,
    )
  return values, record, jnp.moveaxis(fell_back.reshape(flat.shape), -1, axis)


def fake_quant_record(
  x: jax.Array,
  fmt: str = "nvfp4",
  *,
  form: str = "full",
  axis: int = -1,
  global_group: GlobalGroup = "tensor",
  rounding: str = "nearest",
  key: jax.Array | None = None,
  guidance: Guidance | None = None,
) -> tuple[jax.Array, Guidance, jax.Array]:
  """`fake_quant` and its record from one quantization (what a recording site needs).

  The record is in the form TRACE guidance stores: `form="full"` gives the `QArray`
  (`quantize`), `form="compact"` its `CompactGuidance` (`compact_guidance(quantize(...))`),
  both bit for bit, without quantizing twice or unpacking the codes again.

  Returns:
    (values as `fake_quant` (straight-through gradient), record, fell_back bool mask as
    `quantize_with_fallbacks`).
  """
  if form not in RECORD_FORMS:
    raise ValueError(f"fake_quant_record: form={form!r} is not allowed; use one of {RECORD_FORMS}")
  x, axis, group_axes = _resolve(x, fmt, axis, global_group, rounding, key, guidance)
  return _fake_quant_record_ste(x, key, guidance, fmt, axis, group_axes, rounding, form)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _fake_quant_record_ste(x, key, guidance, fmt, axis, group_axes, rounding, form):
  return _fake_quant_record(x, key, guidance, fmt, axis, group_axes, rounding, form)


def _fake_quant_record_fwd(x, key, guidance, fmt, axis, group_axes, rounding, form):
  return _fake_quant_record(x, key, guidance, fmt, axis, group_axes, rounding, form), None


def _fake_quant_record_bwd(fmt, axis, group_axes, rounding, form, residual, g):
  del fmt, axis, group_axes, rounding, form, residual
  return g[0], None, None  # straight through to x; the record carries no gradient


_fake_quant_record_ste.defvjp(_fake_quant_record_fwd, _fake_quant_record_bwd)
