"""The FP4 GEMM grouped over experts: routed rows times their experts' FP4 weights.

The grid is (expert tiles, column blocks): the rows of one expert per tile, gathered by
`routing.RoutingTiles` (sort-free, expert-major: each expert's weight block is read once per
column block, however many rows chose it). The kernel body is the dense GEMM's
(`gemm_body`); `grouped_reference` is the same math in plain XLA, in row order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax import fp4
from trace_jax.kernels import launch, layout
from trace_jax.kernels.gemm_body import (
  Spec,
  check_operands,
  kernel,
  loop_block_k,
  max_block_n,
  record_output,
  record_shapes,
  reference_record,
)
from trace_jax.kernels.routing import RoutingTiles

_F32 = jnp.float32


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
  qw, k, n = check_operands(x, w, quantize, record)
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
  cap = max_block_n(bm, loop_block_k(k, bm, quantize, w_fmt))
  bn = tile if swiglu else (block_n or next(b for b in (64, 32, 16) if n % b == 0 and b <= cap))
  spec = Spec(
    w_fmt=w_fmt,
    quantize=quantize,
    record=record,
    rows="tiled" if tiled else "gather",
    swiglu=swiglu,
    block_m=bm,
    block_n=bn,
    block_k=loop_block_k(k, bm, quantize, w_fmt),
    steps=k // loop_block_k(k, bm, quantize, w_fmt),
    k_steps=k // loop_block_k(k, bm, quantize, w_fmt),
    split=False,
    num_rows=routing.num_rows,
    row_div=routing.top_k,
    out_dtype=jnp.dtype(out_dtype),
  )
  y, record_out = _grouped_call(
    x,
    qw,
    routing,
    spec=spec,
    interpret=launch.interpret_default(interpret),
    poison=poison,
    num_warps=num_warps or (8 if bm >= 32 else 4),
    num_stages=num_stages,
  )
  return y, record_output(record_out, spec, routing.tile_rows.shape)


@functools.partial(
  jax.jit, static_argnames=("spec", "interpret", "poison", "num_warps", "num_stages")
)
def _grouped_call(x, qw, routing, *, spec, interpret, poison, num_warps, num_stages):
  k = x.shape[-1]
  bf16 = spec.w_fmt == "bf16"
  num_experts, _, n = qw.shape if bf16 else qw.packed.shape
  n_out = n // 2 if spec.swiglu else n
  wn = 2 * spec.block_n if spec.swiglu else spec.block_n
  tiles_shape = routing.tile_rows.shape
  bm = spec.block_m
  # each program (tile t, column block j) its own slices: the tile's places of tile_rows,
  # of x in tile order, of y and of the records; the column block of every expert's w
  # (the tile's expert is picked in the kernel). Gathered x stays whole: rows by token.
  tile = lambda a: pl.BlockSpec((None, bm, *a.shape[2:]), lambda t, j: (t, 0, 0)[: a.ndim])  # noqa: E731
  whole = lambda a: pl.BlockSpec(a.shape, lambda t, j: (0,) * a.ndim)  # noqa: E731
  operands = [
    (routing.tile_expert, whole(routing.tile_expert)),
    (routing.tile_rows, tile(routing.tile_rows)),
    (x, tile(x) if spec.rows == "tiled" else whole(x)),
  ]
  if bf16:
    operands.append((qw, pl.BlockSpec((num_experts, k, wn), lambda t, j: (0, 0, j))))
  else:
    operands += _grouped_fp4_operands(qw, k, wn, whole)
  inputs, in_specs = zip(*operands)
  records = record_shapes(spec, tiles_shape, k)
  out = launch.pallas_call(
    functools.partial(kernel, spec=spec),
    out_shape=[jax.ShapeDtypeStruct((*tiles_shape, n_out), spec.out_dtype), *records],
    grid=(routing.num_tiles, n // wn),
    in_specs=in_specs,
    out_specs=[
      pl.BlockSpec((None, bm, spec.block_n), lambda t, j: (t, 0, j)),
      *(tile(r) for r in records),
    ],
    inputs=inputs,
    interpret=interpret,
    poison=poison,
    name="fp4_grouped_gemm",
    num_warps=num_warps,
    num_stages=num_stages,
  )
  return out[0], out[1:]


def _grouped_fp4_operands(qw, k, wn, whole):
  """(array, BlockSpec) of the FP4 experts: codes and block scales by column block, the
  experts' global scales whole."""
  num_experts = qw.packed.shape[0]
  global_scale = qw.global_scale.reshape(num_experts).astype(_F32)
  return [
    (qw.packed, pl.BlockSpec((num_experts, k // 2, wn), lambda t, j: (0, 0, j))),
    (qw.scales, pl.BlockSpec((num_experts, qw.scales.shape[1], wn), lambda t, j: (0, 0, j))),
    (global_scale, whole(global_scale)),
  ]


def grouped_reference(
  x, w, experts, *, row_div, quantize=None, record="none", out_dtype=jnp.bfloat16
):
  """`fp4_grouped_gemm` in plain XLA, in row order: routed row r = token * k + slot is
  x[r // row_div] times its expert's weight, from `experts` int [tokens, k] (row_div = k
  for x per token, 1 for x per routed row); the record covers x's rows."""
  qw, _, _ = check_operands(x, w, quantize, record)
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
  return y.astype(out_dtype), reference_record(xq, record)
