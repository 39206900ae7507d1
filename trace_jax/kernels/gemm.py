"""The FP4 GEMM: x @ w with w packed FP4 and x quantized to FP4 in the kernel's prologue.

  y[m, n] = sum_k (c_x s_bx)[m, k] (c_w s_bw)[k, n] / (gs_x[m] gs_w)   (quantize=fmt: W4A4)
  y[m, n] = sum_k x[m, k] (c_w s_bw)[k, n] / gs_w                      (quantize=None: W4A16)

w is the rollout's packed weight [K, N] along K (`fp4.QArray`, or a `layout.FusedWeight`
of siblings sharing one global scale: q|k|v in one call, gate|up with SwiGLU). This module
is the dense grid (row tiles, column blocks, K splits) over the rows m of x; the kernel body
(`gemm_body`) also serves the grouped grid over experts (`grouped_gemm`).
At decode a dense weight is split along K until the GPU has ~2 programs per SM; each split
writes its scaled float32 partial sum and XLA adds the partials (in a fixed order).
"""

from __future__ import annotations

import functools
import math

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
  row_tile,
)

_F32 = jnp.float32
TARGET_PROGRAMS = 264  # two programs per SM of an H100 / H200 (132 SMs)


def dense_tiling(m: int, n: int, k: int, *, quantize=None, w_fmt="nvfp4", swiglu_tile=None):
  """(block_m, block_n, block_k, k_splits) of a dense GEMM. Decode (m <= 256: up to four
  row tiles): the widest column block (128, 64, 32, 16) and fewest K splits that make
  `TARGET_PROGRAMS` programs with at least two K steps each; prefill: 128-wide blocks,
  unsplit."""
  block_m = row_tile(m)
  block_k = loop_block_k(k, block_m, quantize, w_fmt)
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
  qw, k, n = check_operands(x, w, quantize, record)
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
  spec = Spec(
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
  y, record_out = _dense_call(
    x2,
    qw,
    spec=spec,
    splits=splits,
    interpret=launch.interpret_default(interpret),
    poison=poison,
    num_warps=num_warps or (8 if bm >= 32 else 4),
    num_stages=num_stages,
  )
  return y.reshape(*lead, y.shape[-1]), record_output(record_out, spec, lead)


@functools.partial(
  jax.jit, static_argnames=("spec", "splits", "interpret", "poison", "num_warps", "num_stages")
)
def _dense_call(x2, qw, *, spec, splits, interpret, poison, num_warps, num_stages):
  m, k = x2.shape
  n = qw.packed.shape[-1]
  n_out = n // 2 if spec.swiglu else n
  wn = 2 * spec.block_n if spec.swiglu else spec.block_n
  bm, bn = spec.block_m, spec.block_n
  # each program (row tile i, column block j, K split s) its own slices: bm rows of x, of y
  # and of the records; the column block of w; the last row tile may run past m (masked)
  rows = lambda a: pl.BlockSpec((bm, a.shape[1]), lambda i, j, s: (i, 0))  # noqa: E731
  inputs = [x2, qw.packed, qw.scales]
  inputs.append(qw.global_scale.reshape(1).astype(_F32))
  in_specs = [
    rows(x2),
    pl.BlockSpec((k // 2, wn), lambda i, j, s: (0, j)),
    pl.BlockSpec((qw.scales.shape[0], wn), lambda i, j, s: (0, j)),
    pl.BlockSpec((1,), lambda i, j, s: (0,)),
  ]
  if spec.split:
    y_shape = jax.ShapeDtypeStruct((splits, m, n_out), _F32)
    y_spec = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
  else:
    y_shape = jax.ShapeDtypeStruct((m, n_out), spec.out_dtype)
    y_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
  records = record_shapes(spec, (m,), k)
  out = launch.pallas_call(
    functools.partial(kernel, spec=spec),
    out_shape=[y_shape, *records],
    grid=(-(-m // spec.block_m), n // wn, splits),
    in_specs=in_specs,
    out_specs=[y_spec, *(rows(r) for r in records)],
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


def reference(x, w, *, quantize=None, record="none", out_dtype=jnp.bfloat16):
  """`fp4_gemm` in plain XLA: `fp4.quantize` per row, one float32 dot of the block-scaled
  values, then the global scales (SwiGLU on the gate and up halves)."""
  qw, k, _ = check_operands(x, w, quantize, record)
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
  return y.astype(out_dtype), reference_record(xq, record)
