"""How one call quantizes: the public keyword arguments resolved, once, into a `QuantSpec`.

`QuantSpec` holds every static choice of a quantization (format, axis, global groups,
rounding, block-scale rule, record form), resolved against the input's rank, so the jitted
and custom_vjp cores of `quantize.py` take it as their one static argument (a jit cache
key; qwix's `HowToQuantize` plays the same part). The arrays (x, the PRNG key, guidance, a
static global scale) stay ordinary pytree arguments. `resolve` validates the public
arguments, raising before any work, and builds the spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.fp4.qarray import CompactGuidance, Format, QArray, get_format
from trace_jax.fp4.sparse import SparseGuidance

ROUNDING_MODES = ("nearest", "stochastic", "guided")
SCALE_RULES = ("standard", "4over6")
RECORD_FORMS = ("compact", "full")
GlobalGroup = Union[str, int, Sequence[int]]
# One tensor's recorded rounding outcome, in any form: full codes, compact bits or sparse flags.
TensorGuidance = Union[QArray, CompactGuidance, SparseGuidance]


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
  """The static choices of one quantization: the jit key of the quantize cores.

  Resolved against the input's rank (axes non-negative, group axes a sorted tuple), so
  every spelling of the same choices ("row" or the axes, -1 or n - 1) compares and hashes
  equal and shares one compilation.
  """

  fmt: str  # "nvfp4" or "mxfp4" (qarray.FORMATS)
  axis: int  # the quantized axis, non-negative
  group_axes: tuple[int, ...] = ()  # axes indexing separate global groups, sorted, not axis
  rounding: str = "nearest"  # one of ROUNDING_MODES
  scale_rule: str = "standard"  # one of SCALE_RULES (NVFP4, nearest rounding)
  record: str | None = None  # fake_quant_record's form (RECORD_FORMS); None: no record

  def __post_init__(self):
    canonical = tuple(sorted({int(a) for a in self.group_axes}))  # hashable, one spelling
    object.__setattr__(self, "group_axes", canonical)
    _check_choices(self.fmt, self.rounding, self.scale_rule, self.record)
    if self.axis < 0 or self.axis in self.group_axes:
      raise ValueError(
        f"QuantSpec.axis={self.axis} must be non-negative and not in "
        f"group_axes={self.group_axes} (a global group spans the quantized axis)"
      )

  @property
  def format(self) -> Format:
    return get_format(self.fmt)


def _check_choices(fmt: str, rounding: str, scale_rule: str, record: str | None) -> None:
  """The checks of the static choices that need no array."""
  if record is not None and record not in RECORD_FORMS:
    raise ValueError(
      f"fake_quant_record: form={record!r} is not allowed; use one of {RECORD_FORMS}"
    )
  has_global_scale = get_format(fmt).has_global_scale
  if rounding not in ROUNDING_MODES:
    raise ValueError(f"rounding={rounding!r} is not allowed; use one of {ROUNDING_MODES}")
  if scale_rule not in SCALE_RULES:
    raise ValueError(f"scale_rule={scale_rule!r} is not allowed; use one of {SCALE_RULES}")
  if scale_rule != "standard" and (not has_global_scale or rounding != "nearest"):
    raise ValueError(
      f"scale_rule={scale_rule!r} chooses NVFP4 block scales under nearest "
      f"rounding; got fmt={fmt!r}, rounding={rounding!r}"
    )


def resolve(
  x: Any,
  fmt: str,
  axis: int,
  global_group: GlobalGroup,
  rounding: str,
  key: jax.Array | None,
  guidance: TensorGuidance | None,
  global_scale: jax.Array | None = None,
  scale_rule: str = "standard",
  record: str | None = None,
) -> tuple[QuantSpec, jax.Array, jax.Array | None]:
  """Validate the public arguments of `quantize` and friends, before any work.

  Returns:
    (spec, x as a jax array, the static global scale as float32 or None).
  """
  _check_choices(fmt, rounding, scale_rule, record)
  block_size = get_format(fmt).block_size
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
  if x.shape[axis] % block_size:
    raise ValueError(
      f"{fmt} quantizes blocks of {block_size}: axis {axis} of x has length "
      f"{x.shape[axis]}, not a multiple of {block_size} (shape {x.shape})"
    )
  if rounding == "stochastic" and key is None:
    raise ValueError("rounding='stochastic' needs key= (a jax.random key)")
  if rounding == "guided":
    if guidance is None:
      raise ValueError("rounding='guided' needs guidance= (a QArray or CompactGuidance)")
    _check_guidance(guidance, x.shape, fmt, axis)
  elif guidance is not None:
    raise ValueError(f"guidance= is only used with rounding='guided', not {rounding!r}")
  if rounding == "guided" and not isinstance(guidance, SparseGuidance):
    # The guidance's global scale fixes the groups (its non-unit axes).
    gs_shape = guidance.global_scale.shape
    group_axes = tuple(a for a in range(x.ndim) if gs_shape[a] != 1)
  else:
    group_axes = _group_axes(global_group, x.ndim, axis)
  static_scale = _check_static_scale(global_scale, x, fmt, axis, rounding)
  spec = QuantSpec(
    fmt=fmt,
    axis=axis,
    group_axes=group_axes,
    rounding=rounding,
    scale_rule=scale_rule,
    record=record,
  )
  return spec, x, static_scale


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
  _check_global_scale_shape(guidance.global_scale.shape, shape, axis, f"{kind} guidance ")


def _check_static_scale(global_scale, x, fmt, axis, rounding):
  """A given NVFP4 encode scale: real, size 1 along `axis`, broadcastable to x, and, where
  its values are concrete (not traced), finite and > 0.

  An encode scale of Inf maps every block scale to Inf and every element to 0, one <= 0
  flips or zeroes every value (-0 for a negative one): both would quantize silently to
  garbage. Under jit a traced scale cannot be read without a device-to-host round trip, so
  its values go unchecked there (their shape and dtype are still checked).
  """
  if global_scale is None:
    return None
  if not get_format(fmt).has_global_scale:
    raise ValueError(f"global_scale= is an NVFP4 encode scale; fmt={fmt!r} has none")
  if rounding == "guided":
    raise ValueError("global_scale= and rounding='guided' both fix the scales; pass one")
  dtype = getattr(global_scale, "dtype", None)
  if dtype is not None and not (
    jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  ):
    raise ValueError(f"global_scale must be a real (float) array; got dtype {dtype}")
  gs = jnp.asarray(global_scale, jnp.float32)
  _check_global_scale_shape(gs.shape, x.shape, axis, "")
  try:
    values = np.asarray(global_scale, np.float32)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return gs  # traced: values unchecked (docstring)
  bad = ~(np.isfinite(values) & (values > 0))
  if bad.any():
    raise ValueError(
      f"global_scale holds {np.unique(values[bad])[:5].tolist()} "
      f"(first at index {tuple(int(i) for i in np.argwhere(bad)[0])}); an NVFP4 encode "
      "scale must be finite and > 0 (448 * 6 / amax)"
    )
  return gs


def _check_global_scale_shape(gs_shape, shape, axis: int, owner: str) -> None:
  """A global scale has x's rank, size 1 along the quantized axis, and broadcasts to x."""
  gs_shape = tuple(gs_shape)
  if (
    len(gs_shape) != len(shape)
    or gs_shape[axis] != 1
    or any(g not in (1, s) for g, s in zip(gs_shape, shape))
  ):
    raise ValueError(
      f"{owner}global_scale has shape {gs_shape}; it needs {len(shape)} axes, size 1 "
      f"along the quantized axis {axis}, and to broadcast against {shape}"
    )
