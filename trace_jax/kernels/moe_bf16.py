"""A MoE layer's routed experts on bf16 weights, four ways: the fair bf16 baselines that the
FP4 MoE (`moe.moe_experts`) is timed against.

  h[r] = silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])     r = t * k + slot, e = experts[t, slot]
  y[r] = h[r] @ w_down[e]

  grouped     the FP4 path's expert-major grouped GEMMs (`grouped_gemm`, sort-free tiles,
              SwiGLU epilogue) on bf16 weights: each routed expert read once per column block
  gather      each routed row's expert weights gathered and multiplied (one read per row:
              best at small batch, where rows rarely share an expert)
  ragged_dot  routed rows sorted by expert and multiplied by `jax.lax.ragged_dot` (XLA's own
              grouped GEMM)
  dense       every expert on every token (one einsum over all experts), the routed slots
              taken after: close to the roofline once nearly every expert is routed (decode
              at batch 128 of a 128-expert, top-8 model)

Each kind lays out its weights once (`prepare`, at weight sync: gate|up interleaved in the
grouped GEMM's SwiGLU tiles, or side by side), so the timed call (`apply`) reads weights and
does no re-layout. Rounding points, as the model's bf16 experts: gate and up in bf16, SwiGLU,
h in bf16, float32 accumulation, y in bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.kernels import grouped_gemm, layout, routing
from trace_jax.kernels.moe import swiglu_tile

CANDIDATES = ("grouped", "gather", "ragged_dot", "dense")
_F32 = jnp.float32


def check_kind(kind: str) -> None:
  if kind not in CANDIDATES:
    raise ValueError(f"bf16 MoE kind={kind!r} is not allowed; use one of {CANDIDATES}")


def prepare(kind: str, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array):
  """The weights [E, d, f], [E, d, f], [E, f, d] as `kind` reads them: (gate_up, down),
  gate_up [E, d, 2f] interleaved in SwiGLU tiles (grouped) or side by side (the others)."""
  check_kind(kind)
  if kind == "grouped":
    return layout.fuse_arrays([w_gate, w_up], swiglu_tile(w_gate.shape[-1])), w_down
  return jnp.concatenate([w_gate, w_up], axis=-1), w_down


def apply(kind: str, x, experts, gate_up, down, *, interpret=None, block_m=None):
  """Routed experts of x [N, d] (bf16) for `experts` int [N, k], on `prepare(kind, ...)`'s
  weights. Returns y [N, k, d] in (token, slot) order, in x's dtype."""
  check_kind(kind)
  return _APPLY[kind](x, experts, gate_up, down, interpret=interpret, block_m=block_m)


def _swiglu(gate_up, dtype):
  """[..., 2f] side by side, float32 -> h [..., f] in `dtype` (gate and up rounded first)."""
  gate, up = jnp.split(gate_up.astype(dtype), 2, axis=-1)
  return (jax.nn.silu(gate) * up).astype(dtype)


def _grouped(x, experts, gate_up, down, *, interpret, block_m):
  n, top_k = experts.shape
  num_experts = down.shape[0]
  tiles = routing.route_tiles(
    experts, num_experts, block_m or grouped_gemm.grouped_tile_rows(n * top_k, num_experts)
  )
  tile = swiglu_tile(down.shape[1])
  launch = dict(interpret=interpret, out_dtype=x.dtype)
  h, _ = grouped_gemm.fp4_grouped_gemm(x, gate_up, tiles, swiglu_tile=tile, **launch)
  y, _ = grouped_gemm.fp4_grouped_gemm(h, down, tiles, **launch)
  return tiles.to_rows(y).reshape(n, top_k, -1)


def _gather(x, experts, gate_up, down, *, interpret, block_m):
  del interpret, block_m
  gu = jnp.einsum("nd,nkdf->nkf", x, gate_up[experts], preferred_element_type=_F32)
  h = _swiglu(gu, x.dtype)
  y = jnp.einsum("nkf,nkfd->nkd", h, down[experts], preferred_element_type=_F32)
  return y.astype(x.dtype)


def _ragged_dot(x, experts, gate_up, down, *, interpret, block_m):
  del interpret, block_m
  n, top_k = experts.shape
  flat = experts.reshape(-1)
  order = jnp.argsort(flat)  # routed rows grouped by expert
  sizes = jnp.bincount(flat, length=down.shape[0]).astype(jnp.int32)
  rows = x[order // top_k]  # [R, d]
  gu = jax.lax.ragged_dot(rows, gate_up, sizes, preferred_element_type=_F32)
  y = jax.lax.ragged_dot(_swiglu(gu, x.dtype), down, sizes, preferred_element_type=_F32)
  y = jnp.zeros_like(y).at[order].set(y)  # back to (token, slot) order
  return y.reshape(n, top_k, -1).astype(x.dtype)


def _dense(x, experts, gate_up, down, *, interpret, block_m):
  del interpret, block_m
  # bf16 products (float32 accumulation inside the dot): the same rounding points, as
  # gate, up and y are rounded to bf16 right after
  gu = jnp.einsum("nd,edf->nef", x, gate_up)
  y = jnp.einsum("nef,efd->ned", _swiglu(gu, x.dtype), down)
  return jnp.take_along_axis(y, experts[..., None], axis=1).astype(x.dtype)


_APPLY = {"grouped": _grouped, "gather": _gather, "ragged_dot": _ragged_dot, "dense": _dense}


def reference(x, experts, w_gate, w_up, w_down):
  """The routed experts row by row in plain XLA, from the unfused weights, with the same
  rounding points. Returns y [N, k, d] in x's dtype."""
  hi = jax.lax.Precision.HIGHEST
  xs = x.astype(_F32)
  gate = jnp.einsum("nd,nkdf->nkf", xs, w_gate[experts].astype(_F32), precision=hi)
  up = jnp.einsum("nd,nkdf->nkf", xs, w_up[experts].astype(_F32), precision=hi)
  h = _swiglu(jnp.concatenate([gate, up], axis=-1), x.dtype).astype(_F32)
  y = jnp.einsum("nkf,nkfd->nkd", h, w_down[experts].astype(_F32), precision=hi)
  return y.astype(x.dtype)
