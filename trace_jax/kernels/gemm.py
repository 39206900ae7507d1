"""The FP4 GEMM: x @ w with w packed FP4 and x quantized to FP4 in the kernel's prologue.

  y[m, n] = sum_k (c_x s_bx)[m, k] (c_w s_bw)[k, n] / (gs_x[m] gs_w)   (quantize=fmt: W4A4)
  y[m, n] = sum_k x[m, k] (c_w s_bw)[k, n] / gs_w                      (quantize=None: W4A16)

w is the rollout's packed weight [K, N] along K (`fp4.QArray`, or a `layout.FusedWeight`
of siblings sharing one global scale: q|k|v in one call, gate|up with SwiGLU). One kernel
body serves two grids:
  dense    (row tiles, column blocks, K splits): rows m of x;
  grouped  (expert tiles, column blocks): the rows of one expert per tile, gathered by
           `routing.RoutingTiles` (sort-free, expert-major: each expert's weight block is
           read once per column block, however many rows chose it).

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
At decode a dense weight is split along K until the GPU has ~2 programs per SM; each split
writes its scaled float32 partial sum and XLA adds the partials (in a fixed order).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from trace_jax import fp4
from trace_jax.fp4 import numerics, tiles
from trace_jax.kernels import dispatch, layout
from trace_jax.kernels.routing import RoutingTiles

_F32 = jnp.float32
RECORD_FORMS = ("none", "compact", "full")
TARGET_PROGRAMS = 264  # two programs per SM of an H100 / H200 (132 SMs)
GEMV_ROWS = 8  # row tiles up to this size skip the tensor cores


@dataclasses.dataclass(frozen=True)
class _Spec:
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


def _check(x, w, quantize, record) -> tuple[fp4.QArray, int, int]:
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


def _block_k(k: int, block_m: int, quantize: str | None, w_fmt: str) -> int:
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


def dense_tiling(m: int, n: int, k: int, *, quantize=None, w_fmt="nvfp4", swiglu_tile=None):
  """(block_m, block_n, block_k, k_splits) of a dense GEMM. Decode (m <= 256: up to four
  row tiles): the widest column block (128, 64, 32, 16) and fewest K splits that make
  `TARGET_PROGRAMS` programs with at least two K steps each; prefill: 128-wide blocks,
  unsplit."""
  block_m = row_tile(m)
  block_k = _block_k(k, block_m, quantize, w_fmt)
  steps = k // block_k
  row_tiles = -(-m // block_m)
  if swiglu_tile is not None:
    return block_m, swiglu_tile, block_k, 1
  cap = max_block_n(block_m, block_k)
  widths = [bn for bn in (128, 64, 32, 16) if n % bn == 0 and bn <= cap] or [n]
  if m > 256:
    return block_m, widths[0], block_k, 1
  fallback = None
  for bn in widths:
    for splits in (d for d in range(1, steps + 1) if steps % d == 0):
      if splits > 1 and steps // splits < 2:
        break
      fallback = (block_m, bn, block_k, splits)
      if row_tiles * (n // bn) * splits >= TARGET_PROGRAMS:
        return fallback
  return fallback


def _even_odd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A loaded row tile [rows, n] as its even and odd elements (register split)."""
  rows, n = x.shape
  even, odd = jnp.split(x.reshape(rows, n // 2, 2), 2, axis=2)
  return even.reshape(rows, n // 2), odd.reshape(rows, n // 2)


def _dot(a, b, gemv: bool):
  if gemv:  # [m, k] x [k, n] on the CUDA cores: a decode tile of a few rows
    return jnp.sum(a.astype(_F32)[:, :, None] * b.astype(_F32)[None, :, :], axis=1)
  return jnp.dot(a, b, preferred_element_type=_F32)


def _kernel(*refs, spec: _Spec):
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
    valid = tile_rows_ref[tile, :] >= 0
    first_step = 0
  else:
    row0 = pl.program_id(0) * bm
    valid = row0 + lanes < spec.num_rows
    first_step = pl.program_id(2) * spec.steps
  w_index = (expert,) if grouped else ()
  widths = (bn, bn) if spec.swiglu else (bn,)

  def load_x(k0, width):
    mask = jnp.broadcast_to(valid[:, None], (bm, width))
    if spec.rows == "dense":
      ref = x_ref.at[pl.ds(row0, bm), pl.ds(k0, width)]
    elif spec.rows == "gather":  # the rows' tokens, gathered
      source = jnp.maximum(tile_rows_ref[tile, :], 0) // spec.row_div
      cols = k0 + jax.lax.broadcasted_iota(jnp.int32, (bm, width), 1)
      ref = x_ref.at[jnp.broadcast_to(source[:, None], (bm, width)), cols]
    else:  # tile order
      ref = x_ref.at[tile, pl.ds(0, bm), pl.ds(k0, width)]
    return plgpu.load(ref, mask=mask, other=0).astype(_F32)

  def store_rows(ref, k0, value):
    """Store a [bm, width] tile of x-row or output values at this tile's rows."""
    width = value.shape[1]
    if grouped:
      plgpu.store(ref.at[tile, pl.ds(0, bm), pl.ds(k0, width)], value.astype(ref.dtype))
    else:
      mask = jnp.broadcast_to(valid[:, None], (bm, width))
      plgpu.store(ref.at[pl.ds(row0, bm), pl.ds(k0, width)], value.astype(ref.dtype), mask=mask)

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
    if spec.split:
      mask = jnp.broadcast_to(valid[:, None], y.shape)
      plgpu.store(y_ref.at[pl.program_id(2), pl.ds(row0, bm), pl.ds(0, bn)], y, mask=mask)
    else:
      store_rows(y_ref, 0, y)

  if grouped:
    pl.when(live)(body)
  else:
    body()


def _record(outputs, spec: _Spec, lead: tuple[int, ...]):
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


def _record_shapes(spec: _Spec, rows: tuple[int, ...], k: int):
  block = fp4.get_format(spec.quantize).block_size if spec.quantize else 1
  widths = {"packed": (k // 2, jnp.uint8), "scales": (k // block, jnp.uint8)}
  widths.update({"global_scale": (1, _F32), "bits": (k // 8, jnp.uint8)})
  return [
    jax.ShapeDtypeStruct((*rows, widths[name][0]), widths[name][1]) for name in spec.record_fields
  ]


def fp4_gemm(
  x: jax.Array,
  w,
  *,
  quantize: str | None = None,
  record: str = "none",
  out_dtype=jnp.bfloat16,
  interpret: bool | None = None,
  poison: bool = False,
  block_n: int | None = None,
  k_splits: int | None = None,
  num_warps: int | None = None,
  num_stages: int = 3,
):
  """x [..., K] @ w [K, N] -> ([..., N] `out_dtype`, record of x's quantization or None).

  Args:
    x: activations (bf16 or float32), unquantized.
    w: `fp4.QArray` [K, N] along K, or a `layout.FusedWeight` (tile None: the siblings'
      columns side by side; a gate|up tile: SwiGLU, the output is [..., N / 2]).
    quantize: quantize x per row to this FP4 format first (W4A4); None: W4A16.
    record: the record of x's quantization to return: "none", "compact"
      (`fp4.CompactGuidance`) or "full" (`fp4.QArray`), as guidance stores it.
    interpret, poison: as the other kernels (tests: poison fills outputs with NaN / 0xFF).
    block_n, k_splits, num_warps, num_stages: tiling (default `dense_tiling`).
  """
  qw, k, n = _check(x, w, quantize, record)
  if qw.packed.ndim != 2:
    raise ValueError(f"fp4_gemm: w must be [K, N]; got {qw.packed.shape} (experts: grouped)")
  swiglu = isinstance(w, layout.FusedWeight) and w.tile is not None
  lead = x.shape[:-1]
  m = math.prod(lead)
  bm, bn, bk, splits = dense_tiling(
    m, n, k, quantize=quantize, w_fmt=qw.fmt, swiglu_tile=w.tile if swiglu else None
  )
  bn = block_n or bn
  splits = 1 if swiglu else (k_splits or splits)
  if n % (2 * bn if swiglu else bn) or (k // bk) % splits:
    raise ValueError(f"fp4_gemm: block_n={bn} must divide N={n}, k_splits={splits} the K steps")
  x2 = x.reshape(m, k)
  spec = _Spec(
    w_fmt=qw.fmt,
    quantize=quantize,
    record=record,
    rows="dense",
    swiglu=swiglu,
    block_m=bm,
    block_n=bn,
    block_k=bk,
    steps=k // bk // splits,
    k_steps=k // bk,
    split=splits > 1,
    num_rows=m,
    row_div=1,
    out_dtype=jnp.dtype(out_dtype),
  )
  launch = (dispatch.interpret_default(interpret), poison, num_warps or (8 if bm >= 32 else 4))
  y, record_out = _dense_call(x2, qw, spec, splits, *launch, num_stages)
  return y.reshape(*lead, y.shape[-1]), _record(record_out, spec, lead)


@functools.partial(jax.jit, static_argnums=tuple(range(2, 8)))
def _dense_call(x2, qw, spec, splits, interpret, poison, num_warps, num_stages):
  m, k = x2.shape
  n = qw.packed.shape[-1]
  n_out = n // 2 if spec.swiglu else n
  wn = 2 * spec.block_n if spec.swiglu else spec.block_n
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, s: (0,) * a.ndim)  # noqa: E731
  inputs = [x2, qw.packed, qw.scales]
  inputs.append(qw.global_scale.reshape(1).astype(_F32))
  in_specs = [whole(a) for a in inputs[:-3]] + [
    pl.BlockSpec((k // 2, wn), lambda i, j, s: (0, j)),
    pl.BlockSpec((qw.scales.shape[0], wn), lambda i, j, s: (0, j)),
    whole(inputs[-1]),
  ]
  if spec.split:
    y_shape = jax.ShapeDtypeStruct((splits, m, n_out), _F32)
    y_spec = pl.BlockSpec((splits, m, spec.block_n), lambda i, j, s: (0, 0, j))
  else:
    y_shape = jax.ShapeDtypeStruct((m, n_out), spec.out_dtype)
    y_spec = pl.BlockSpec((m, spec.block_n), lambda i, j, s: (0, j))
  records = _record_shapes(spec, (m,), k)
  out = dispatch.pallas_call(
    functools.partial(_kernel, spec=spec),
    out_shape=[y_shape, *records],
    grid=(-(-m // spec.block_m), n // wn, splits),
    in_specs=in_specs,
    out_specs=[y_spec, *(pl.BlockSpec(r.shape, lambda i, j, s: (0, 0)) for r in records)],
    inputs=inputs,
    interpret=interpret,
    poison=poison,
    name="fp4_gemm",
    num_warps=num_warps,
    num_stages=num_stages,
  )
  y = out[0]
  if spec.split:  # the splits' scaled partial sums, added in split order
    y = jnp.sum(y, axis=0).astype(spec.out_dtype)
  return y, out[1:]


def grouped_tile_rows(num_rows: int, num_experts: int) -> int:
  """Rows per expert tile: about twice a tile's expected rows (num_rows / num_experts),
  so that most experts fit one tile; 1 at batch 1 (each expert gets one row)."""
  expected = -(-2 * num_rows // num_experts)
  return min(16, 1 << max(0, expected - 1).bit_length())


def fp4_grouped_gemm(
  x: jax.Array,
  w,
  routing: RoutingTiles,
  *,
  quantize: str | None = None,
  record: str = "none",
  out_dtype=jnp.bfloat16,
  interpret: bool | None = None,
  poison: bool = False,
  block_n: int | None = None,
  swiglu_tile: int | None = None,
  num_warps: int | None = None,
  num_stages: int = 3,
):
  """Routed rows times their experts' FP4 weights, expert-major, in tile order.

  Tile t holds up to block_m rows of expert routing.tile_expert[t]; its output rows are
  x_row @ w[expert], where x_row is x[r // top_k] (x [tokens, K]: the routed rows'
  tokens, gathered) or x[t, p] (x [T, block_m, K]: already in tile order, as the first
  grouped GEMM writes it). Results and records come in tile order; `routing.to_rows`
  (or `first_slots`, per token) puts them in row order.

  Args:
    x: [tokens, K] or [T, block_m, K] activations.
    w: stacked experts `fp4.QArray` [E, K, N] (one global scale per expert), or a gate|up
      `layout.FusedWeight` (SwiGLU: the output is [..., N / 2]); or bf16 [E, K, N] (the
      fair bf16 baseline of `experiments/gpu_check.py`: the same grid over bf16 weights,
      gate|up interleaved by `layout.fuse_arrays` with `swiglu_tile`).
    routing: `routing.route_tiles` of the rows.
    quantize, record: as `fp4_gemm`.

  Returns:
    (y [T, block_m, N or N / 2] `out_dtype`, record [T, block_m, ...] or None). Places
    past a tile's rows hold 0 (or garbage in a tile no expert uses).
  """
  qw, k, n = _check(x, w, quantize, record)
  tiled = x.ndim == 3
  w_fmt = "bf16" if not isinstance(qw, fp4.QArray) else qw.fmt
  w_ndim = qw.ndim if w_fmt == "bf16" else qw.packed.ndim
  if w_ndim != 3 or x.ndim not in (2, 3):
    raise ValueError(
      f"fp4_grouped_gemm: w must be [E, K, N] and x [tokens, K] or [T, block_m, K]; got "
      f"{getattr(qw, 'packed', qw).shape}, {x.shape}"
    )
  if tiled and x.shape[:2] != routing.tile_rows.shape:
    raise ValueError(
      f"fp4_grouped_gemm: tiled x {x.shape} must be [T, block_m] = {routing.tile_rows.shape}"
    )
  swiglu = isinstance(w, layout.FusedWeight) and w.tile is not None
  tile = w.tile if swiglu else swiglu_tile
  swiglu = swiglu or swiglu_tile is not None
  bm = routing.block_m
  cap = max_block_n(bm, _block_k(k, bm, quantize, w_fmt))
  bn = tile if swiglu else (block_n or next(b for b in (64, 32, 16) if n % b == 0 and b <= cap))
  spec = _Spec(
    w_fmt=w_fmt,
    quantize=quantize,
    record=record,
    rows="tiled" if tiled else "gather",
    swiglu=swiglu,
    block_m=bm,
    block_n=bn,
    block_k=_block_k(k, bm, quantize, w_fmt),
    steps=k // _block_k(k, bm, quantize, w_fmt),
    k_steps=k // _block_k(k, bm, quantize, w_fmt),
    split=False,
    num_rows=routing.num_rows,
    row_div=routing.top_k,
    out_dtype=jnp.dtype(out_dtype),
  )
  launch = (dispatch.interpret_default(interpret), poison, num_warps or (8 if bm >= 32 else 4))
  y, record_out = _grouped_call(x, qw, routing, spec, *launch, num_stages)
  return y, _record(record_out, spec, routing.tile_rows.shape)


@functools.partial(jax.jit, static_argnums=tuple(range(3, 8)))
def _grouped_call(x, qw, routing, spec, interpret, poison, num_warps, num_stages):
  k = x.shape[-1]
  bf16 = spec.w_fmt == "bf16"
  num_experts, _, n = qw.shape if bf16 else qw.packed.shape
  n_out = n // 2 if spec.swiglu else n
  wn = 2 * spec.block_n if spec.swiglu else spec.block_n
  tiles_shape = routing.tile_rows.shape
  whole = lambda a: pl.BlockSpec(a.shape, lambda t, j: (0,) * a.ndim)  # noqa: E731
  if bf16:
    inputs = [routing.tile_expert, routing.tile_rows, x, qw]
    in_specs = [whole(a) for a in inputs[:-1]]
    in_specs.append(pl.BlockSpec((num_experts, k, wn), lambda t, j: (0, 0, j)))
  else:
    inputs, in_specs = _grouped_fp4_inputs(routing, x, qw, k, wn, whole)
  records = _record_shapes(spec, tiles_shape, k)
  out = dispatch.pallas_call(
    functools.partial(_kernel, spec=spec),
    out_shape=[jax.ShapeDtypeStruct((*tiles_shape, n_out), spec.out_dtype), *records],
    grid=(routing.num_tiles, n // wn),
    in_specs=in_specs,
    out_specs=[
      pl.BlockSpec((*tiles_shape, spec.block_n), lambda t, j: (0, 0, j)),
      *(pl.BlockSpec(r.shape, lambda t, j: (0, 0, 0)) for r in records),
    ],
    inputs=inputs,
    interpret=interpret,
    poison=poison,
    name="fp4_grouped_gemm",
    num_warps=num_warps,
    num_stages=num_stages,
  )
  return out[0], out[1:]


def _grouped_fp4_inputs(routing, x, qw, k, wn, whole):
  num_experts = qw.packed.shape[0]
  inputs = [routing.tile_expert, routing.tile_rows, x, qw.packed, qw.scales]
  inputs.append(qw.global_scale.reshape(num_experts).astype(_F32))
  in_specs = [whole(a) for a in inputs[:3]] + [
    pl.BlockSpec((num_experts, k // 2, wn), lambda t, j: (0, 0, j)),
    pl.BlockSpec((num_experts, qw.scales.shape[1], wn), lambda t, j: (0, 0, j)),
    whole(inputs[-1]),
  ]
  return inputs, in_specs


def reference(x, w, *, quantize=None, record="none", out_dtype=jnp.bfloat16):
  """`fp4_gemm` in plain XLA: `fp4.quantize` per row, one float32 dot of the block-scaled
  values, then the global scales (SwiGLU on the gate and up halves)."""
  qw, k, _ = _check(x, w, quantize, record)
  parts = w.parts() if isinstance(w, layout.FusedWeight) else (qw,)
  xq = fp4.quantize(x, quantize, global_group="row") if quantize else None
  xv = fp4.block_scaled_values(xq) if quantize else x.astype(_F32)
  ys = []
  for part in parts:
    y = jnp.einsum(
      "...k,kn->...n",
      xv,
      fp4.block_scaled_values(part),
      precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=_F32,
    )
    scale = part.global_scale.astype(_F32).reshape(())
    ys.append(y / (xq.global_scale * scale) if quantize else y / scale)
  if isinstance(w, layout.FusedWeight) and w.tile is not None:
    gate, up = (y.astype(out_dtype).astype(_F32) for y in ys)
    y = gate * jax.nn.sigmoid(gate) * up
  else:
    y = jnp.concatenate(ys, axis=-1)
  return y.astype(out_dtype), _reference_record(xq, record)


def _reference_record(xq, record):
  if record == "none":
    return None
  return xq if record == "full" else fp4.compact_guidance(xq)


def grouped_reference(
  x, w, experts, *, row_div, quantize=None, record="none", out_dtype=jnp.bfloat16
):
  """`fp4_grouped_gemm` in plain XLA, in row order: routed row r = token * k + slot is
  x[r // row_div] times its expert's weight, from `experts` int [tokens, k] (row_div = k
  for x per token, 1 for x per routed row); the record covers x's rows."""
  qw, _, _ = _check(x, w, quantize, record)
  parts = w.parts() if isinstance(w, layout.FusedWeight) else (qw,)
  flat = experts.reshape(-1)
  xq = fp4.quantize(x, quantize, global_group="row") if quantize else None
  xv = fp4.block_scaled_values(xq) if quantize else x.astype(_F32)
  xv = xv[jnp.arange(flat.shape[0]) // row_div]  # [R, K]
  gs_x = xq.global_scale[jnp.arange(flat.shape[0]) // row_div] if quantize else 1.0
  ys = []
  for part in parts:
    wv = fp4.block_scaled_values(part)[flat]  # [R, K, N]
    y = jnp.einsum("rk,rkn->rn", xv, wv, precision=jax.lax.Precision.HIGHEST)
    ys.append(y / (gs_x * part.global_scale.reshape(-1)[flat][:, None]))
  if isinstance(w, layout.FusedWeight) and w.tile is not None:
    gate, up = (y.astype(out_dtype).astype(_F32) for y in ys)
    y = gate * jax.nn.sigmoid(gate) * up
  else:
    y = jnp.concatenate(ys, axis=-1)
  return y.astype(out_dtype), _reference_record(xq, record)
