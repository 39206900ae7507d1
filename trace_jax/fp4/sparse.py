"""Boundary-aware sparse guidance: record the rounding only where it could go the other way.

A training value rounds differently from the rollout's only where the rollout's value lies
near a rounding boundary: the two paths differ by bf16-level amounts. Sparse guidance
(DESIGN.md section 3, "sparse") therefore keeps, per row (one token, or one (token, head),
(token, expert) row of a site), only:
  1. the positions and mantissa bits of the elements whose rollout value v, in units of the
     local E2M1 grid spacing, lies within `delta` of the midpoint between its two grid
     neighbours (`|frac(t) - 1/2| <= delta`, t = |v| / spacing; exact ties always);
  2. the positions and E4M3 bits of the block scales whose ideal value amax_b / 6 * gs, in
     units of the local E4M3 spacing, lies within `scale_delta` of an E4M3 midpoint;
  3. no global scales. A row's global scale gs = 448 * 6 / amax enters the rounding only as
     a common factor of the row (v = x * gs / s_b, ideal scale amax_b / 6 * gs): its
     difference between the paths is part of the measured |v_train - v_rollout| (and of the
     scales' distance) that `delta` and `scale_delta` are calibrated to cover, so the
     training path uses its own. The decoded values then differ from the rollout's by that
     relative factor (bf16-level), never by a grid step.
The training path (`quantize(..., rounding="guided", guidance=SparseGuidance)`): its own
global and block scales, the recorded block scale where one is flagged, the recorded bit
where an element is flagged (the neighbour whose code's lowest bit equals it; a fallback
where the value sits on the grid with the other bit), nearest rounding elsewhere.

Fixed-size buffers (jit, scan, the rollout's slot buffers): each row keeps at most
`capacity(n)` flagged elements and `block_capacity(nb)` flagged blocks; `count` and
`block_count` hold how many were flagged, so an overflow (count > capacity) is counted,
never lost silently: the flags beyond capacity round to nearest on the training path.

Bytes: the buffers are not what travels; `encoded_bits` measures, on the host, the flagged
positions of each token's rows at a site in three forms (a bitmap, fixed-width run lengths,
Golomb-Rice coded index deltas), and `site_bits` takes the smallest per site, plus one bit
per flagged element and eight per flagged block scale. At a flag density p the index
deltas cost about log2(1/p) + 2 bits per flag, the bitmap 1/p; the deltas win below p ~ 1/4.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.fp4 import numerics
from trace_jax.fp4.qarray import QArray, get_format

ENCODINGS = ("bitmap", "runlength", "index_deltas")
# Calibrated on the mismatch study (`studies.sparse.calibrate`; experiments/mismatch.py
# --preset=tiny --sft_steps=50 --rollouts=16, 201,984 guided elements of real tokens): with
# full guidance on every layer, the 0.999 quantile of |t_train - t_rollout| is 0.069 E2M1
# grid units for the elements and 0.188 E4M3 units for the ideal block scales (global scales
# agreed in every row). Under nearest rounding with routing replay the same quantiles are
# 1.9 and 5.1 units: unguided flips compound, which is why sparse guidance covers every layer.
DEFAULT_DELTA = 0.07
DEFAULT_SCALE_DELTA = 0.19


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseSpec:
  """What sparse guidance flags and how much room each row has (static: a jit key)."""

  delta: float = DEFAULT_DELTA  # element margin around an E2M1 midpoint, grid units, [0, 0.5]
  scale_delta: float = DEFAULT_SCALE_DELTA  # block-scale margin around an E4M3 midpoint, [0, 0.5]
  capacity_frac: float = 0.25  # flagged elements kept per row: this share of the row,
  #   rounded up to a multiple of 8 (at least 8)
  block_capacity_frac: float = 0.5  # flagged block scales kept per row (at least 1)
  site_deltas: tuple = ()  # ((site, delta), ...): per-site-kind margins instead of `delta`
  #   (the paths' differences enter at some sites only: attention outputs, RoPE'd keys)

  def __post_init__(self):
    object.__setattr__(self, "site_deltas", tuple((str(k), float(v)) for k, v in self.site_deltas))
    for name, value in (
      ("delta", self.delta),
      ("scale_delta", self.scale_delta),
      *((f"site_deltas[{k!r}]", v) for k, v in self.site_deltas),
    ):
      if not (isinstance(value, (int, float)) and 0.0 <= value <= 0.5):
        raise ValueError(
          f"SparseSpec.{name}={value!r} must lie in [0, 0.5] (grid units from "
          "the midpoint; 0.5 flags every element)"
        )
    for name in ("capacity_frac", "block_capacity_frac"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and 0.0 < value <= 1.0):
        raise ValueError(f"SparseSpec.{name}={value!r} must lie in (0, 1]")

  def for_site(self, site: str) -> "SparseSpec":
    """The spec one site records with: its own margin if `site_deltas` names it."""
    if not self.site_deltas:
      return self
    return dataclasses.replace(
      self, delta=dict(self.site_deltas).get(site, self.delta), site_deltas=()
    )

  def capacity(self, n: int) -> int:
    return min(n, max(8, 8 * math.ceil(n * self.capacity_frac / 8)))

  def block_capacity(self, blocks: int) -> int:
    return min(blocks, max(1, math.ceil(blocks * self.block_capacity_frac)))

  def replace(self, **changes) -> "SparseSpec":
    return dataclasses.replace(self, **changes)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["index", "mantissa_bits", "count", "block_index", "block_scales", "block_count"],
  meta_fields=["fmt", "n"],
)
@dataclasses.dataclass(frozen=True)
class SparseGuidance:
  """Sparse TRACE guidance of rows [..., n] quantized along their last axis.

  Attributes:
    index: uint8 / uint16 [..., C]: positions of the flagged elements, ascending; slots
      j >= min(count, C) carry nothing.
    mantissa_bits: uint8 [..., C / 8]: the flagged elements' code bit 0, slot 8i + j in bit j.
    count: int32 [..., 1]: elements flagged in the row (may exceed C: overflow).
    block_index: uint8 / uint16 [..., Cb]: flagged blocks, ascending.
    block_scales: uint8 [..., Cb]: their E4M3 scale bits.
    block_count: int32 [..., 1]: blocks flagged in the row.
    fmt: "nvfp4".
    n: the row length (elements along the quantized axis).
  """

  index: jax.Array
  mantissa_bits: jax.Array
  count: jax.Array
  block_index: jax.Array
  block_scales: jax.Array
  block_count: jax.Array
  fmt: str
  n: int

  axis = -1  # the quantized axis (activation rows): always the last

  @property
  def shape(self) -> tuple[int, ...]:
    return (*self.index.shape[:-1], self.n)

  @property
  def capacity(self) -> int:
    return self.index.shape[-1]

  @property
  def block_capacity(self) -> int:
    return self.block_index.shape[-1]

  @property
  def overflow(self) -> jax.Array:
    """int32 [..., 1]: flagged elements beyond capacity (rounded to nearest in training)."""
    return jnp.maximum(self.count - self.capacity, 0)

  @property
  def block_overflow(self) -> jax.Array:
    return jnp.maximum(self.block_count - self.block_capacity, 0)


def _index_dtype(n: int):
  return jnp.uint8 if n <= 256 else jnp.uint16


def e2m1_boundary_distance(v: jax.Array) -> jax.Array:
  """|frac(t) - 1/2| of |v| in E2M1 grid units t (`numerics.e2m1_grid_units`): 0 at a
  midpoint (an exact tie), 1/2 on the grid; 1/2 too where both neighbours clamp to 6."""
  exponent, _, units = numerics.e2m1_grid_units(jnp.abs(v))
  lo = numerics.e2m1_unit_code(exponent, jnp.floor(units))
  hi = numerics.e2m1_unit_code(exponent, jnp.ceil(units))
  distance = jnp.abs(units - jnp.floor(units) - 0.5)
  return jnp.where(lo == hi, 0.5, distance)


def e4m3_boundary_distance(ideal: jax.Array) -> jax.Array:
  """The same for a non-negative ideal block scale on the E4M3 grid (clipped to 448)."""
  _, units = numerics.e4m3_grid_units(ideal)
  distance = jnp.abs(units - jnp.floor(units) - 0.5)
  return jnp.where(ideal >= numerics.E4M3_MAX, 0.5, distance)


def _row_values(x: jax.Array, q: QArray):
  """(blocks [..., nb, bs] f32, v [..., nb, bs], ideal block scales [..., nb]) of x under
  the recorded scales of q: the very ops of `quantize` (true divisions), bit for bit."""
  bs = get_format(q.fmt).block_size
  blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // bs, bs)
  global_scale = q.global_scale.astype(jnp.float32)  # [..., 1]
  step = numerics.true_divide(numerics.e4m3_decode(q.scales), global_scale)[..., None]
  v = jnp.where(step > 0, numerics.true_divide(blocks, step), 0.0)
  amax_b = jnp.max(jnp.abs(blocks), axis=-1)
  ideal = numerics.true_divide(amax_b, 6.0) * global_scale
  return blocks, v, ideal


def _check(x, q: QArray) -> None:
  if not isinstance(q, QArray):
    raise ValueError(f"sparse guidance is made from the rollout's QArray; got {type(q).__name__}")
  if q.fmt != "nvfp4":
    raise ValueError(
      f"sparse guidance supports fmt='nvfp4' (E4M3 block scales, per-row "
      f"global scales); got fmt={q.fmt!r}"
    )
  if q.axis != -1 or tuple(q.shape) != tuple(x.shape):
    raise ValueError(
      f"sparse guidance needs rows quantized along the last axis, x and the "
      f"record alike; got x {x.shape}, record {q.shape} along axis {q.axis}"
    )


def _compact_positions(flags: jax.Array, capacity: int):
  """The first `capacity` True positions of each row of flags [..., n], ascending, and
  how many there are (int32 [..., 1]).

  A running count gives each flag its slot; one scatter writes the positions (flags past
  capacity go to a spare column that is dropped): O(n) per row, where a sort costs
  O(n log n) and, on CPU, 40x the quantization itself (experiments/bench_sparse.py)."""
  n = flags.shape[-1]
  lead = flags.shape[:-1]
  rows = int(np.prod(lead, dtype=np.int64))
  flat = flags.reshape(rows, n)
  slot = jnp.cumsum(flat, axis=-1, dtype=jnp.int32) - 1
  slot = jnp.where(flat & (slot < capacity), slot, capacity)
  positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (rows, n))
  index = (
    jnp.zeros((rows, capacity + 1), jnp.int32)
    .at[jnp.arange(rows)[:, None], slot]
    .set(positions, mode="drop")[:, :capacity]
  )
  count = jnp.sum(flat, axis=-1, keepdims=True, dtype=jnp.int32)
  return index.reshape(*lead, capacity).astype(_index_dtype(n)), count.reshape(*lead, 1)


@functools.partial(jax.jit, static_argnums=2)
def _sparse_guidance(x, q, spec: SparseSpec):
  _, v, ideal = _row_values(x, q)
  n = x.shape[-1]
  flags = (e2m1_boundary_distance(v) <= spec.delta).reshape(*x.shape[:-1], n)
  flags = flags & jnp.isfinite(q.global_scale)
  index, count = _compact_positions(flags, spec.capacity(n))
  code_bits = numerics.unpack_codes(q.packed) & 1  # the recorded codes' bits, never re-derived
  bits = jnp.take_along_axis(code_bits, index.astype(jnp.int32), axis=-1)
  nb = ideal.shape[-1]
  block_flags = (e4m3_boundary_distance(ideal) <= spec.scale_delta) & jnp.isfinite(q.global_scale)
  block_index, block_count = _compact_positions(block_flags, spec.block_capacity(nb))
  block_scales = jnp.take_along_axis(q.scales, block_index.astype(jnp.int32), axis=-1)
  return SparseGuidance(
    index=index,
    mantissa_bits=numerics.pack_bits(bits),
    count=count,
    block_index=block_index,
    block_scales=block_scales,
    block_count=block_count,
    fmt=q.fmt,
    n=n,
  )


def sparse_guidance(x: jax.Array, q: QArray, spec: SparseSpec = SparseSpec()) -> SparseGuidance:
  """The sparse guidance of a rollout site: its input rows x [..., n] and their recorded
  `QArray` q (per-row NVFP4, `quantize(x, global_group="row")`, the same x).

  Works under jit / vmap / scan; x carries no gradient through it.
  """
  _check(x, q)
  return _sparse_guidance(jax.lax.stop_gradient(x), q, spec)


def expand(g: SparseGuidance, shape: tuple[int, ...]):
  """Dense views of sparse guidance for rows of `shape` [..., n]:
  (flags bool [..., n], bits uint8 [..., n], block_flags bool [..., nb], block_bits uint8
  [..., nb]). Slots past min(count, capacity) are dropped (scattered into a spare column)."""
  n = shape[-1]
  nb = n // get_format(g.fmt).block_size
  rows = int(np.prod(shape[:-1], dtype=np.int64))

  def scatter(index, count, values, width, dtype):
    cap = index.shape[-1]
    index = index.reshape(rows, cap).astype(jnp.int32)
    valid = jnp.arange(cap) < jnp.minimum(count.reshape(rows, 1), cap)
    index = jnp.where(valid, index, width)
    row = jnp.arange(rows)[:, None]
    flags = jnp.zeros((rows, width + 1), bool).at[row, index].set(True)[:, :width]
    dense = (
      jnp.zeros((rows, width + 1), dtype)
      .at[row, index]
      .set(values.reshape(rows, cap).astype(dtype))[:, :width]
    )
    return flags.reshape(*shape[:-1], width), dense.reshape(*shape[:-1], width)

  bits = numerics.unpack_bits(g.mantissa_bits)[..., : g.capacity]
  flags, dense_bits = scatter(g.index, g.count, bits, n, jnp.uint8)
  block_flags, block_bits = scatter(g.block_index, g.block_count, g.block_scales, nb, jnp.uint8)
  return flags, dense_bits, block_flags, block_bits


def boundary_noise(
  x_train: jax.Array, x_rollout: jax.Array, q_rollout: QArray, train_global_scale: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """What `delta` and `scale_delta` must cover, per element and per block:
  (|t_train - t_rollout| [..., n] of the elements, in units of the rollout value's grid
  spacing; |u_train - u_rollout| [..., nb] of the ideal block scales in units of the
  rollout ideal's E4M3 spacing). The training values are taken as the sparse training
  path sees them: its own global scale, the rollout's block scales."""
  _check(x_rollout, q_rollout)
  _, v_r, ideal_r = _row_values(x_rollout, q_rollout)
  own = dataclasses.replace(q_rollout, global_scale=train_global_scale)
  _, v_t, ideal_t = _row_values(x_train, own)
  _, spacing, _ = numerics.e2m1_grid_units(jnp.abs(v_r))
  element = (jnp.abs(v_t - v_r) / spacing).reshape(x_rollout.shape)
  scale_spacing, _ = numerics.e4m3_grid_units(ideal_r)
  return element, jnp.abs(ideal_t - ideal_r) / scale_spacing


# --- Bytes, on the host ---------------------------------------------------------------------


def _gamma_bits(values: np.ndarray) -> np.ndarray:
  """Elias-gamma code length of positive integers: 2 floor(log2 v) + 1."""
  return 2 * np.floor(np.log2(np.maximum(values, 1))).astype(np.int64) + 1


def _token_positions(index, count, width: int, keep):
  """Flagged positions of each token's rows laid end to end ([T, R * C], ascending, -1 past
  each token's count k [T]): a token site is one stream of R * width elements."""
  index = np.asarray(index).astype(np.int64)
  count = np.asarray(count)[..., 0]
  cap = index.shape[-1]
  tokens = int(np.prod(count.shape[:2]))  # [B, S] (a 1-d batch: each row a token)
  index = index.reshape(tokens, -1, cap)  # [T, R, C]
  count = np.minimum(count.reshape(tokens, -1), cap)  # [T, R]
  if keep is not None:
    keep = np.asarray(keep, bool).reshape(tokens)
    index, count = index[keep], count[keep]
  rows = index.shape[1]
  valid = np.arange(cap)[None, None, :] < count[..., None]
  flat = index + (np.arange(rows) * width)[None, :, None]
  flat = np.where(valid, flat, np.iinfo(np.int64).max).reshape(index.shape[0], -1)
  flat.sort(axis=-1)
  k = count.sum(axis=-1)
  flat = np.where(np.arange(flat.shape[1])[None, :] < k[:, None], flat, -1)
  return flat, k, rows * width


def encoded_bits(index, count, width: int, keep=None) -> dict[str, int]:
  """Bits of the stored flagged positions (index [B, S, ..., C], count [B, S, ..., 1]) of
  rows of `width` elements, each token's rows at a site coded as one stream of L elements
  with k flags, in each of `ENCODINGS`:
    bitmap        one bit per element: L per token;
    runlength     the k + 1 runs of unflagged elements around the flags, each in
                  ceil(log2(L + 1)) bits (the decoder stops at L);
    index_deltas  k + 1 in Elias gamma, then each gap (unflagged elements since the
                  previous flag) in Golomb-Rice code with the site's best parameter r
                  (1 + r + gap >> r bits; r in a 4-bit header per site).
  `keep` (bool [B, S], real tokens) counts only those tokens."""
  flat, k, length = _token_positions(index, count, width, keep)
  valid = flat >= 0
  previous = np.concatenate([np.full((flat.shape[0], 1), -1), flat[:, :-1]], axis=1)
  gaps = np.where(valid, flat - previous - 1, 0)
  gap_list = gaps[valid]
  rice = min(int(gap_list.size) * (1 + r) + int(np.sum(gap_list >> r)) for r in range(16))
  return {
    "bitmap": flat.shape[0] * length,
    "runlength": int(np.sum(k + 1)) * math.ceil(math.log2(length + 1)),
    "index_deltas": 4 + rice + int(np.sum(_gamma_bits(k + 1))),
  }


def site_bits(g: SparseGuidance, rows_mask=None) -> dict:
  """Bits of one site's sparse guidance over the kept rows: the positions in the smallest
  encoding (chosen per site, separately for elements and blocks), one mantissa bit per
  stored flag, eight bits per stored block scale; with every encoding's size, the counts
  and the overflow."""
  count = np.asarray(g.count)
  block_count = np.asarray(g.block_count)
  rows = count.shape[:-1]
  keep = np.ones(rows, bool)
  if rows_mask is not None:  # [B, S] token mask over rows [B, S, ...]
    rows_mask = np.asarray(rows_mask, bool)
    keep = np.broadcast_to(
      rows_mask.reshape(rows_mask.shape + (1,) * (len(rows) - rows_mask.ndim)), rows
    )
  nb = g.n // get_format(g.fmt).block_size
  token_keep = None if rows_mask is None else np.asarray(rows_mask, bool)
  elements = encoded_bits(g.index, count, g.n, token_keep)
  blocks = encoded_bits(g.block_index, block_count, nb, token_keep)
  count_k, block_k = count[..., 0][keep], block_count[..., 0][keep]
  stored = int(np.sum(np.minimum(count_k, g.capacity)))
  stored_blocks = int(np.sum(np.minimum(block_k, g.block_capacity)))
  element_form = min(elements, key=elements.get)
  block_form = min(blocks, key=blocks.get)
  total = elements[element_form] + stored + blocks[block_form] + 8 * stored_blocks
  return {
    "total": total,
    "positions": elements[element_form] + blocks[block_form],
    "bits": stored,
    "scales": 8 * stored_blocks,
    "element_encoding": element_form,
    "block_encoding": block_form,
    "element_encodings": elements,
    "block_encodings": blocks,
    "flagged": int(np.sum(count_k)),
    "elements": int(keep.sum()) * g.n,
    "flagged_blocks": int(np.sum(block_k)),
    "blocks": int(keep.sum()) * nb,
    "overflow": int(np.sum(np.maximum(count_k - g.capacity, 0))),
    "block_overflow": int(np.sum(np.maximum(block_k - g.block_capacity, 0))),
  }
