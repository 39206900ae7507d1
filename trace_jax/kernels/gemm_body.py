"""The FP4 GEMM's kernel body, shared by its two grids (`gemm`: dense; `grouped_gemm`:
grouped over experts), with the operand checks, tilings and records both use.

Each program (a tile of rows, one column block, its share of K):
  1. global scales gs_x of its rows from their amax over K (a first pass over x, which is
     small at decode and read from L2; an exact division, `fp4.tiles`);
  2. K loop, `block_k` at a time: load x's even and odd elements (two strided loads),
     quantize them to nearest E2M1 with E4M3 / E8M0 block scales (`tiles.quantize_pairs`,
     bit for bit `fp4.quantize`), and write the rollout's record of them (compact guidance
     bits, or the full codes) from the programs of column block 0; load the weight's bytes
     and block scales, decode both nibbles to bf16 in a few integer operations
     (`tiles.scaled_pairs_bf16`); two dots (even, odd) accumulate in float32;
  3. divide by gs_x * gs_w (exactly) and store; SwiGLU (gate|up) takes silu(g) * u first.
Rows tiles of 1-8 rows (decode) use a broadcast-multiply-reduce instead of a tensor-core dot
(which needs 16 rows), so a batch of one quantizes and multiplies one row, not sixteen.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from trace_jax import fp4
from trace_jax.fp4 import numerics, tiles
from trace_jax.kernels import layout

_F32 = jnp.float32
RECORD_FORMS = ("none",) + fp4.RECORD_FORMS
GEMV_ROWS = 8  # row tiles up to this size skip the tensor cores


@dataclasses.dataclass(frozen=True)
class Spec:
  """Static description of one kernel instance."""

  w_fmt: str
  quantize: str | None  # x's FP4 format, or None (x as is)
  record: str
  rows: str  # "dense" (rows of x), "gather" (x[row // row_div] per tile), "tiled" (x in
  #   tile order [T, block_m, K]); the grouped ones write tile order [T, block_m, ...]
  swiglu: bool
  block_m: int
  block_n: int  # output columns per program (gate|up: per half)
  block_k: int
  steps: int  # block_k steps per program
  k_steps: int  # block_k steps of all of K (the prologue's amax pass)
  split: bool  # write scaled float32 partials (K split)
  num_rows: int  # rows of x (dense)
  row_div: int  # gather: x row of routed row r is r // row_div
  out_dtype: jnp.dtype

  @property
  def record_fields(self) -> tuple[str, ...]:
    return _RECORD_FIELDS[self.record]


_RECORD_FIELDS = {
  "none": (),
  "compact": ("scales", "global_scale", "bits"),
  "full": ("packed", "scales", "global_scale"),
}


def check_operands(x, w, quantize, record) -> tuple[fp4.QArray, int, int]:
  qw = w.qarray() if isinstance(w, layout.FusedWeight) else w
  if isinstance(qw, jax.Array | jax.ShapeDtypeStruct) and qw.dtype == jnp.bfloat16:
    if quantize is not None or record != "none" or x.shape[-1] != qw.shape[-2]:
      raise ValueError(
        f"fp4_grouped_gemm: bf16 weights {qw.shape} take unquantized x [..., K] without "
        f"records; got x {x.shape}, quantize={quantize!r}, record={record!r}"
      )
    return qw, qw.shape[-2], qw.shape[-1]
  if not isinstance(qw, fp4.QArray) or qw.axis != -2:
    raise ValueError(
      "fp4_gemm: w must be an fp4.QArray along K (axis -2) or a kernels.layout.FusedWeight; "
      f"got {type(w).__name__}"
    )
  k, n = qw.packed.shape[-2] * 2, qw.packed.shape[-1]
  if x.shape[-1] != k:
    raise ValueError(f"fp4_gemm: x has K={x.shape[-1]} but w has K={k}")
  if quantize is not None:
    fp4.get_format(quantize)
  if record not in RECORD_FORMS:
    raise ValueError(f"fp4_gemm: record={record!r} is not one of {RECORD_FORMS}")
  if record != "none" and quantize is None:
    raise ValueError("fp4_gemm: a record needs quantize= (there is nothing to record)")
  return qw, k, n


def loop_block_k(k: int, block_m: int, quantize: str | None, w_fmt: str) -> int:
  """K per loop step: what keeps a program's live tiles in registers, a multiple of twice
  the block sizes (the even/odd halves hold whole half-blocks). A decode tile's broadcast
  product [block_m, block_k/2, block_n] grows with block_m (256 / block_m); the prologue's
  temporaries of a dot tile with block_m x block_k (256 at 16 rows, 128 at 32, 64 at 64)."""
  limit = 256 // block_m if block_m <= GEMV_ROWS else {16: 256, 32: 128}.get(block_m, 64)
  blocks = [fp4.get_format(f).block_size for f in (w_fmt, quantize) if f not in (None, "bf16")]
  least = max([32] + [2 * b for b in blocks])
  fits = [bk for bk in (256, 128, 64, 32) if bk >= least and k % bk == 0]
  if not fits:
    raise ValueError(f"fp4_gemm: K={k} must be a multiple of {least}")
  return next((bk for bk in fits if bk <= limit), fits[-1])


def max_block_n(block_m: int, block_k: int) -> int:
  """The widest column block whose decoded weight tile ([block_k/2, block_n], two halves)
  and, for a decode tile, broadcast product ([block_m, block_k/2, block_n] float32) stay
  within 8192 elements: 64 a thread at 4 warps, so that they live in registers."""
  rows = block_m if block_m <= GEMV_ROWS else 1
  return max(16, 8192 // (block_k // 2 * rows))


def row_tile(rows: int) -> int:
  """Rows per program for `rows` rows: a power of two; up to 8 a broadcast product, from 16
  (the smallest tensor-core dot) to 64 a dot."""
  if rows <= GEMV_ROWS:
    return 1 << max(0, rows - 1).bit_length()
  return min(64, max(16, 1 << (rows - 1).bit_length()))


def _even_odd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A loaded row tile [rows, n] as its even and odd elements (register split)."""
  rows, n = x.shape
  even, odd = jnp.split(x.reshape(rows, n // 2, 2), 2, axis=2)
  return even.reshape(rows, n // 2), odd.reshape(rows, n // 2)


def _dot(a, b, gemv: bool):
  if gemv:  # [m, k] x [k, n] on the CUDA cores: a decode tile of a few rows
    return jnp.sum(a.astype(_F32)[:, :, None] * b.astype(_F32)[None, :, :], axis=1)
  return jnp.dot(a, b, preferred_element_type=_F32)


def kernel(*refs, spec: Spec):
  """One program: a tile of rows, one column block, its share of K. Every operand that is
  indexed by row comes as the program's own BlockSpec slice of bm rows (the dense rows
  past m and a tile's empty places masked), except x gathered by token ("gather").

  refs, in order (grouped: the first two; bf16 weights: no ws, wg and records):
    tile_expert_ref  # [T] int32: each tile's expert (-1: unused)
    tile_rows_ref    # [bm] int32: the tile's routed rows (-1: empty place)
    x_ref            # [bm, K] (dense, tiled) or [tokens, K] (gather): activations
    wp_ref           # [(E,) K/2, wn] uint8 (bf16: [(E,) K, wn]): the column block's codes
    ws_ref           # [(E,) K/block, wn] uint8: its block scales
    wg_ref           # [1] or [E] f32: the global scale(s)
    y_ref            # [bm, bn] out (K split: [bm, bn] f32 partial of split s)
    *record_refs     # [bm, K/2 | K/block | K/8 | 1] out: x's record, by `record_fields`
  """
  refs = list(refs)
  grouped = spec.rows != "dense"
  if grouped:
    tile_expert_ref, tile_rows_ref = refs.pop(0), refs.pop(0)
  x_ref = refs.pop(0)
  bf16 = spec.w_fmt == "bf16"  # the fair bf16 baseline: the same grid, bf16 weights
  if bf16:
    (wp_ref, y_ref), record_refs = refs[:2], {}
  else:
    wp_ref, ws_ref, wg_ref, y_ref = refs[:4]
    record_refs = dict(zip(spec.record_fields, refs[4:]))
  bm, bn, bk = spec.block_m, spec.block_n, spec.block_k
  gemv = bm <= GEMV_ROWS
  j = pl.program_id(1)
  lanes = jax.lax.broadcasted_iota(jnp.int32, (bm,), 0)
  if grouped:
    tile = pl.program_id(0)
    expert = tile_expert_ref[tile]
    live = expert >= 0
    expert = jnp.maximum(expert, 0)  # a dead tile (-1) is skipped; keep its loads in range
    valid = tile_rows_ref[...] >= 0
    first_step = 0
  else:
    valid = pl.program_id(0) * bm + lanes < spec.num_rows
    first_step = pl.program_id(2) * spec.steps
  w_index = (expert,) if grouped else ()
  widths = (bn, bn) if spec.swiglu else (bn,)

  def load_x(k0, width):
    mask = jnp.broadcast_to(valid[:, None], (bm, width))
    if spec.rows == "gather":  # the rows' tokens, gathered
      source = jnp.maximum(tile_rows_ref[...], 0) // spec.row_div
      cols = k0 + jax.lax.broadcasted_iota(jnp.int32, (bm, width), 1)
      ref = x_ref.at[jnp.broadcast_to(source[:, None], (bm, width)), cols]
    else:  # the program's own rows
      ref = x_ref.at[pl.ds(0, bm), pl.ds(k0, width)]
    return plgpu.load(ref, mask=mask, other=0).astype(_F32)

  def store_rows(ref, k0, value):
    """Store a [bm, width] tile of x-row or output values in the program's rows (a tile's
    empty places too; dense rows past m are masked)."""
    width = value.shape[1]
    mask = None if grouped else jnp.broadcast_to(valid[:, None], (bm, width))
    plgpu.store(ref.at[pl.ds(0, bm), pl.ds(k0, width)], value.astype(ref.dtype), mask=mask)

  def body():
    w_gs = 1.0 if bf16 else (wg_ref[expert] if grouped else wg_ref[0])
    if spec.quantize:  # the rows' amax over all of K (a max may drop NaN: flag it apart)

      def amax_step(t, carry):
        amax, finite = carry
        x = load_x(pl.multiple_of(t * bk, bk), bk)
        finite = jnp.minimum(finite, jnp.min(jnp.isfinite(x).astype(jnp.int32), axis=1))
        return jnp.maximum(amax, jnp.max(jnp.abs(x), axis=1)), finite

      init = (jnp.zeros((bm,), _F32), jnp.ones((bm,), jnp.int32))
      amax, finite = jax.lax.fori_loop(0, spec.k_steps, amax_step, init)
      amax = jnp.where(finite == 1, amax, jnp.nan)
      gs_x = tiles.row_global_scale(amax[:, None], spec.quantize)
      if "global_scale" in record_refs:

        @pl.when((j == 0) & (first_step == 0))
        def _():
          store_rows(record_refs["global_scale"], 0, gs_x)

    def bf16_step(t, accs):
      k0 = pl.multiple_of((first_step + t) * bk, bk)
      x = load_x(k0, bk).astype(jnp.bfloat16)
      rows = pl.ds(k0, bk)
      return tuple(
        acc + _dot(x, wp_ref[(*w_index, rows, pl.ds(offset, bn))], gemv)
        for acc, offset in zip(accs, (0, bn))
      )

    def step(t, accs):
      k0 = pl.multiple_of((first_step + t) * bk, bk)
      x_even, x_odd = _even_odd(load_x(k0, bk))
      if spec.quantize:
        _, scale_bits, (x_even, x_odd), packed, bits = tiles.quantize_pairs(
          x_even, x_odd, gs_x, spec.quantize
        )
        fields = {
          "packed": (packed, 2),
          "scales": (scale_bits, fp4.get_format(spec.quantize).block_size),
          "bits": (bits, 8),
        }

        @pl.when(j == 0)
        def _():
          for name, ref in record_refs.items():
            if name != "global_scale":
              value, per = fields[name]
              store_rows(ref, pl.multiple_of(k0 // per, bk // per), value)

      else:
        x_even, x_odd = x_even.astype(jnp.bfloat16), x_odd.astype(jnp.bfloat16)
      half = bk // 2
      w_rows = pl.ds(pl.multiple_of(k0 // 2, half), half)
      w_block = fp4.get_format(spec.w_fmt).block_size
      s_rows = pl.ds(pl.multiple_of(k0 // w_block, bk // w_block), bk // w_block)
      out = []
      for acc, offset in zip(accs, (0, bn)):
        cols = pl.ds(offset, bn)
        w_even, w_odd = tiles.scaled_pairs_bf16(
          wp_ref[(*w_index, w_rows, cols)], ws_ref[(*w_index, s_rows, cols)], spec.w_fmt, axis=0
        )
        out.append(acc + _dot(x_even, w_even, gemv) + _dot(x_odd, w_odd, gemv))
      return tuple(out)

    accs = tuple(jnp.zeros((bm, w), _F32) for w in widths)
    accs = jax.lax.fori_loop(0, spec.steps, bf16_step if bf16 else step, accs)
    scale = jnp.broadcast_to(w_gs, (bm, 1)).astype(_F32)
    if spec.quantize:
      scale = gs_x * scale
    ys = [numerics.true_divide(acc, jnp.broadcast_to(scale, acc.shape)) for acc in accs]
    if bf16:
      ys = list(accs)
    if spec.swiglu:  # as the XLA path: gate and up in the output dtype, then silu(g) * u
      gate, up = (y.astype(spec.out_dtype).astype(_F32) for y in ys)
      # sigmoid as 1 / (1 + e^-g), divided correctly rounded: jax.nn.sigmoid lowers to
      # Triton's div.full.f32 (approximate), which the offline sm_90 compile test refuses
      one = jnp.ones_like(gate)
      y = gate * numerics.true_divide(one, one + jnp.exp(-gate)) * up
    else:
      y = ys[0]
    store_rows(y_ref, 0, y)

  if grouped:
    pl.when(live)(body)
  else:
    body()


def record_output(outputs, spec: Spec, lead: tuple[int, ...]):
  """The kernel's record outputs as the guidance form: CompactGuidance or QArray."""
  if spec.record == "none":
    return None
  fields = {name: a.reshape(*lead, a.shape[-1]) for name, a in zip(spec.record_fields, outputs)}
  if spec.record == "compact":
    return fp4.CompactGuidance(
      global_scale=fields["global_scale"],
      scales=fields["scales"],
      mantissa_bits=fields["bits"],
      fmt=spec.quantize,
      axis=-1,
    )
  return fp4.QArray(
    packed=fields["packed"],
    scales=fields["scales"],
    global_scale=fields["global_scale"],
    fmt=spec.quantize,
    axis=-1,
  )


def record_shapes(spec: Spec, rows: tuple[int, ...], k: int):
  block = fp4.get_format(spec.quantize).block_size if spec.quantize else 1
  widths = {"packed": (k // 2, jnp.uint8), "scales": (k // block, jnp.uint8)}
  widths.update({"global_scale": (1, _F32), "bits": (k // 8, jnp.uint8)})
  return [
    jax.ShapeDtypeStruct((*rows, widths[name][0]), widths[name][1]) for name in spec.record_fields
  ]


def reference_record(xq, record):
  if record == "none":
    return None
  return xq if record == "full" else fp4.compact_guidance(xq)
