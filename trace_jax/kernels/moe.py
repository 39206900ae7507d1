"""A MoE layer's routed experts on FP4 weights: two grouped GEMMs, no sort, no XLA glue.

  h[r] = silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])     r = t * k + slot, e = experts[t, slot]
  y[r] = h[r] @ w_down[e]

1. `routing.route_tiles`: expert-major tiles of the routed rows (prefix sums, no sort);
2. gate|up: one `grouped_gemm.fp4_grouped_gemm` over the fused gate|up weight, x quantized
   per token in its prologue (moe_in), SwiGLU in its epilogue, h written in tile order;
3. down: one grouped GEMM over h in tile order, each routed row quantized in the prologue
   (moe_mid);
4. y back in row order (one gather), as the caller weights and sums each token's slots.
The records (guidance) of moe_in come per token, those of moe_mid per routed row, in the
(token, slot) order the rest of the model records them in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax import fp4
from trace_jax.kernels import grouped_gemm, layout, routing


def moe_experts(
  x: jax.Array,
  experts: jax.Array,
  w_gate_up,
  w_down: fp4.QArray,
  *,
  quantize_in: str | None,
  quantize_mid: str | None,
  record: str = "none",
  out_dtype=jnp.bfloat16,
  interpret: bool | None = None,
  poison: bool = False,
  block_m: int | None = None,
):
  """Routed experts of x [N, d] (bf16) for `experts` int [N, k].

  Args:
    w_gate_up: the fused gate|up `layout.FusedWeight` [E, d, 2f] (a SwiGLU tile), or the
      (gate, up) pair of `fp4.QArray`s sharing global scales (fused here).
    w_down: `fp4.QArray` [E, f, d].
    quantize_in, quantize_mid: FP4 formats of moe_in and moe_mid (None: unquantized).
    record: "none", "compact" or "full": the records of the quantized sites.

  Returns:
    (y [N, k, d] in (token, slot) order, h [N, k, f] (the down projection's input before
    quantization), record of moe_in [N, ...] or None, record of moe_mid [N, k, ...] or None).
  """
  if not isinstance(w_gate_up, layout.FusedWeight):
    w_gate_up = layout.fuse(w_gate_up, tile=swiglu_tile(w_gate_up[0].packed.shape[-1]))
  n, top_k = experts.shape
  num_experts = w_down.packed.shape[0]
  tiles = routing.route_tiles(
    experts, num_experts, block_m or grouped_gemm.grouped_tile_rows(n * top_k, num_experts)
  )
  launch = dict(interpret=interpret, poison=poison, out_dtype=out_dtype)
  h, rec_in = grouped_gemm.fp4_grouped_gemm(
    x, w_gate_up, tiles, quantize=quantize_in, record=record if quantize_in else "none", **launch
  )
  y, rec_mid = grouped_gemm.fp4_grouped_gemm(
    h, w_down, tiles, quantize=quantize_mid, record=record if quantize_mid else "none", **launch
  )
  f, d = h.shape[-1], y.shape[-1]
  rows = lambda a: tiles.to_rows(a).reshape(n, top_k, *a.shape[2:])  # noqa: E731
  rec_in = None if rec_in is None else jax.tree.map(tiles.first_slots, rec_in)
  rec_mid = None if rec_mid is None else jax.tree.map(rows, rec_mid)
  return rows(y).reshape(n, top_k, d), rows(h).reshape(n, top_k, f), rec_in, rec_mid


def swiglu_tile(width: int) -> int:
  """The gate|up interleave tile (= the grouped GEMM's column block) for ffn width f."""
  return next(t for t in (64, 32, 16, 8) if width % t == 0)


def reference(
  x, experts, w_gate, w_up, w_down, *, quantize_in, quantize_mid, out_dtype=jnp.bfloat16
):
  """`moe_experts` in plain XLA: per-row dequantized experts, the same rounding points
  (gate and up in `out_dtype`, SwiGLU, h in `out_dtype`)."""
  n, top_k = experts.shape
  pair = layout.fuse([w_gate, w_up], tile=swiglu_tile(w_gate.packed.shape[-1]))
  h, _ = grouped_gemm.grouped_reference(
    x, pair, experts, row_div=top_k, quantize=quantize_in, out_dtype=out_dtype
  )
  y, _ = grouped_gemm.grouped_reference(
    h, w_down, experts, row_div=1, quantize=quantize_mid, out_dtype=out_dtype
  )
  return y.reshape(n, top_k, -1), h.reshape(n, top_k, -1)
