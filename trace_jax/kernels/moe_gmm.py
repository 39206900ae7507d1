"""Grouped matmul over experts with FP4 expert weights (`jax.lax.ragged_dot` semantics).

  y[r] = lhs[r] @ w[e(r)]   for rows r of group e (rows sorted by expert; group e holds
                            group_sizes[e] consecutive rows); rows past sum(group_sizes) are 0.

w is the rollout's stacked expert weight: [E, K, N] quantized along K with one global scale
per expert (packed [E, K/2, N], scales [E, K/16, N], global scale [E, 1, 1]).

Grid: (row tiles, N / block_n, k_splits). A row tile can straddle groups, so each program
loops over the experts whose rows meet its tile (from the group offsets, computed once
outside), skipping empty groups, and keeps each expert's product only on that expert's
rows. Within an expert it is `fp4_matmul`'s loop: nibbles times block scale in registers,
float32 accumulation over K, the expert's global scale after the accumulation. At decode
K is split as in `fp4_matmul` (few row tiles: one at batch 1 with top-8), and XLA adds the
float32 partial sums after the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax import fp4
from trace_jax.fp4 import tiles
from trace_jax.kernels import dispatch, fp4_matmul

_F32 = jnp.float32


def _check(lhs, w: fp4.QArray, group_sizes) -> tuple[int, int, int]:
  if not isinstance(w, fp4.QArray) or w.packed.ndim != 3 or w.axis != -2:
    raise ValueError(
      "moe_gmm: w must be a 3-D fp4.QArray [E, K, N] quantized along K "
      f"(axis=-2); got {type(w).__name__} with {getattr(w, 'packed', w).shape}"
    )
  e, k, n = w.packed.shape[0], w.packed.shape[1] * 2, w.packed.shape[2]
  if lhs.ndim != 2 or lhs.shape[1] != k:
    raise ValueError(f"moe_gmm: lhs must be [rows, K={k}]; got {lhs.shape}")
  if group_sizes.shape != (e,):
    raise ValueError(f"moe_gmm: group_sizes must be [E={e}]; got {group_sizes.shape}")
  return e, k, n


def _kernel(
  first_ref,
  last_ref,
  start_ref,
  end_ref,
  xe_ref,
  xo_ref,
  p_ref,
  s_ref,
  g_ref,
  o_ref,
  *,
  fmt,
  block_m,
  block_k,
  steps,
  dtype,
):
  tile, first_step = pl.program_id(0), pl.program_id(2) * steps
  rows = tile * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)

  def expert(e, out):
    start, end = start_ref[e], end_ref[e]

    def product(out):
      acc = fp4_matmul.accumulate(
        lambda i, ks: (xe_ref[:, ks], xo_ref[:, ks]),
        p_ref,
        s_ref,
        fmt=fmt,
        block_k=block_k,
        steps=steps,
        shape=out.shape,
        dtype=dtype,
        index=(e,),
        first=first_step,
      )
      mine = (rows >= start) & (rows < end)
      return out + jnp.where(mine, acc / g_ref[pl.ds(e, 1), :], 0.0)

    return jax.lax.cond(end > start, product, lambda out: out, out)

  out = jax.lax.fori_loop(first_ref[tile], last_ref[tile] + 1, expert, jnp.zeros(o_ref.shape, _F32))
  o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(
  jax.jit,
  static_argnames=(
    "out_dtype",
    "interpret",
    "poison",
    "block_n",
    "block_k",
    "block_m",
    "k_splits",
    "num_warps",
    "num_stages",
  ),
)
def moe_gmm(
  lhs: jax.Array,
  w: fp4.QArray,
  group_sizes: jax.Array,
  *,
  out_dtype=None,
  interpret: bool | None = None,
  poison: bool = False,
  block_m: int | None = None,
  block_n: int | None = None,
  block_k: int | None = None,
  k_splits: int | None = None,
  num_warps: int | None = None,
  num_stages: int | None = None,
) -> jax.Array:
  """Grouped FP4 matmul: lhs [R, K] sorted by group, w [E, K, N] FP4, group_sizes int [E].

  Returns [R, N] in `out_dtype` (default lhs's dtype), float32 accumulation; rows past
  sum(group_sizes) are 0, as in `jax.lax.ragged_dot`. `interpret`, `poison`, block sizes,
  k_splits, Triton params: as in `fp4_matmul` (block_m: row tile, default 16 rows for up to 512
  rows (decode: a 16-row tile meets few experts, and more tiles stream more weights in
  parallel), else up to 64).
  """
  num_experts, k, n = _check(lhs, w, group_sizes)
  out_dtype = out_dtype or lhs.dtype
  r = lhs.shape[0]
  block_m, rows = dispatch.row_tiling(r, block_m, largest=16 if r <= 512 else 64)
  defaults = fp4_matmul.tiling(block_m, n, k)
  block_n = block_n or defaults["block_n"]
  block_k = block_k or defaults["block_k"]
  tiles_m = rows // block_m
  k_splits = k_splits or fp4_matmul.split_k(block_m, tiles_m * (n // block_n), k // block_k)
  if k_splits < 1 or (k // block_k) % k_splits:
    raise ValueError(
      f"moe_gmm: k_splits={k_splits} must divide the {k // block_k} block_k steps of K={k}"
    )
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  tile_lo = jnp.arange(tiles_m, dtype=jnp.int32) * block_m
  # The groups that meet a tile: from the first ending after its first row to the one
  # holding its last row (rows past the total belong to no group: first > last).
  first = jnp.searchsorted(ends, tile_lo, side="right").astype(jnp.int32)
  last = jnp.minimum(
    jnp.searchsorted(ends, tile_lo + block_m - 1, side="right"), num_experts - 1
  ).astype(jnp.int32)
  x_even, x_odd = tiles.even_odd(dispatch.pad_rows(lhs, rows))
  gs = jnp.broadcast_to(w.global_scale.astype(_F32).reshape(num_experts, 1), (num_experts, n))
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, s: (0,) * a.ndim)  # noqa: E731
  kernel = functools.partial(
    _kernel,
    fmt=w.fmt,
    block_m=block_m,
    block_k=block_k,
    steps=k // block_k // k_splits,
    dtype=lhs.dtype,
  )
  if k_splits == 1:
    out_shape = jax.ShapeDtypeStruct((rows, n), out_dtype)
    out_spec = pl.BlockSpec((block_m, block_n), lambda i, j, s: (i, j))
  else:  # float32 partial sums, one [rows, n] slab per split of K
    out_shape = jax.ShapeDtypeStruct((k_splits, rows, n), _F32)
    out_spec = pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j))
  y = dispatch.pallas_call(
    kernel,
    out_shape=[out_shape],
    grid=(tiles_m, n // block_n, k_splits),
    in_specs=[
      whole(first),
      whole(last),
      whole(starts),
      whole(ends),
      pl.BlockSpec((block_m, k // 2), lambda i, j, s: (i, 0)),
      pl.BlockSpec((block_m, k // 2), lambda i, j, s: (i, 0)),
      pl.BlockSpec((num_experts, k // 2, block_n), lambda i, j, s: (0, 0, j)),
      pl.BlockSpec((num_experts, w.scales.shape[1], block_n), lambda i, j, s: (0, 0, j)),
      pl.BlockSpec((num_experts, block_n), lambda i, j, s: (0, j)),
    ],
    out_specs=[out_spec],
    inputs=(first, last, starts, ends, x_even, x_odd, w.packed, w.scales, gs),
    interpret=dispatch.interpret_default(interpret),
    poison=poison,
    name="moe_gmm",
    num_warps=num_warps or defaults["num_warps"],
    num_stages=num_stages or defaults["num_stages"],
  )[0]
  if k_splits > 1:
    y = jnp.sum(y, axis=0).astype(out_dtype)
  return y[:r]


def reference(lhs: jax.Array, w: fp4.QArray, group_sizes: jax.Array, *, out_dtype=None):
  """The kernel's math in plain XLA: ragged_dot over c * s_b, then each row's expert's
  global scale."""
  _check(lhs, w, group_sizes)
  y = jax.lax.ragged_dot(
    lhs.astype(_F32),
    fp4.block_scaled_values(w),
    group_sizes,
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=_F32,
  )
  expert_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(lhs.shape[0]), side="right")
  gs = jnp.concatenate([w.global_scale.reshape(-1).astype(_F32), jnp.ones((1,), _F32)])
  return (y / gs[expert_of_row][:, None]).astype(out_dtype or lhs.dtype)
