"""FP4 weight x activation matmul: y [M, N] = x [M, K] @ w [K, N], w in packed FP4.

W4A16: x in bf16 (or float32). W4A4: x an FP4 `QArray` quantized per token (the rollout's
activations). The kernel reads the packed weight bytes and E4M3 block scales, turns each
nibble into value * s_b in registers (exact in bf16, DESIGN.md section 7), multiplies with
float32 accumulation and applies the global scales once, after the accumulation:

  y[m, n] = sum_k x[m, k] * (c[k, n] * s_b[k, n]) / gs_w        (W4A16)
  y[m, n] = sum_k (c_x * s_bx)[m, k] * (c * s_b)[k, n] / (gs_x[m] * gs_w)   (W4A4)

Grid: (M / block_m, N / block_n, k_splits); each program loops over its 1/k_splits of K
in block_k steps. Rows are padded to a power-of-two tile (decode batches are small). At
decode a weight of a few thousand columns makes only tens of (row, column) tiles, too few
to keep a GPU's memory busy, so K is split until there are about two programs per SM of
an H100/H200 (`tiling`); the float32 partial sums are then added, and the global scales
applied, by XLA after the kernel. The weight is the rollout's
`quantize_weight` layout: [K, N] quantized along K (packed [K/2, N], scales [K/16, N]).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax import fp4
from trace_jax.fp4 import tiles
from trace_jax.kernels import dispatch

_F32 = jnp.float32


def _check(x, w: fp4.QArray) -> tuple[int, int, int]:
  if not isinstance(w, fp4.QArray) or w.packed.ndim != 2 or w.axis != -2:
    raise ValueError(
      "fp4_matmul: w must be a 2-D fp4.QArray [K, N] quantized along K "
      f"(axis=-2); got {type(w).__name__} with "
      f"{getattr(w, 'packed', w).shape} and axis={getattr(w, 'axis', None)}"
    )
  k, n = w.packed.shape[0] * 2, w.packed.shape[1]
  x_k = x.packed.shape[-1] * 2 if isinstance(x, fp4.QArray) else x.shape[-1]
  if x_k != k:
    raise ValueError(f"fp4_matmul: x has K={x_k} but w has K={k}")
  if isinstance(x, fp4.QArray) and x.axis != -1:
    raise ValueError(
      f"fp4_matmul: a quantized x must be quantized along its last axis; got axis={x.axis}"
    )
  return x_k, k, n


def accumulate(
  load_x, w_packed_ref, w_scales_ref, *, fmt, block_k, steps, shape, dtype, index=(), first=0
):
  """The K loop of one output tile, shared with `moe_gmm`: sum over K of x @ (c * s_b).

  Args:
    load_x: (step, packed rows) -> the (even, odd) elements of x's tile for those rows.
    w_packed_ref, w_scales_ref: the weight's packed codes [..., K/2, bn] and scales.
    steps: block_k steps to take, from step `first` (this program's split of K).
    index: leading indices into the weight refs (the expert, for `moe_gmm`).
  """
  w_block = fp4.get_format(fmt).block_size
  half = block_k // 2
  every = slice(None)

  def step(i, acc):
    rows = pl.ds(pl.multiple_of(i * half, half), half)
    scales = pl.ds(i * (block_k // w_block), block_k // w_block)
    w_even, w_odd = tiles.scaled_pairs(
      w_packed_ref[(*index, rows, every)], w_scales_ref[(*index, scales, every)], fmt, axis=0
    )
    x_even, x_odd = load_x(i, rows)
    acc += jnp.dot(x_even.astype(dtype), w_even.astype(dtype), preferred_element_type=_F32)
    acc += jnp.dot(x_odd.astype(dtype), w_odd.astype(dtype), preferred_element_type=_F32)
    return acc

  return jax.lax.fori_loop(first, first + steps, step, jnp.zeros(shape, _F32))


def _kernel(*refs, fmt, x_fmt, block_k, steps, dtype, scaled):
  if x_fmt is None:
    xe_ref, xo_ref, p_ref, s_ref, g_ref, o_ref = refs
  else:
    xp_ref, xs_ref, xg_ref, p_ref, s_ref, g_ref, o_ref = refs

  def load_x(i, rows):
    if x_fmt is None:
      return xe_ref[:, rows], xo_ref[:, rows]
    x_block = fp4.get_format(x_fmt).block_size
    scales = pl.ds(i * (block_k // x_block), block_k // x_block)
    return tiles.scaled_pairs(xp_ref[:, rows], xs_ref[:, scales], x_fmt, axis=1)

  acc = accumulate(
    load_x,
    p_ref,
    s_ref,
    fmt=fmt,
    block_k=block_k,
    steps=steps,
    shape=o_ref.shape,
    dtype=dtype,
    first=pl.program_id(2) * steps,
  )
  if scaled:  # one split: the whole sum is here
    scale = g_ref[...] if x_fmt is None else xg_ref[...] * g_ref[...]
    o_ref[...] = (acc / scale).astype(o_ref.dtype)
  else:  # a partial sum over this split of K
    o_ref[...] = acc


# Programs to aim for at decode: two per SM of an H100/H200 (132 SMs).
TARGET_PROGRAMS = 264


def tiling(m: int, n: int, k: int) -> dict[str, int]:
  """Default tiles, K splits and Triton params for an [m, k] @ [k, n] product (also
  `moe_gmm`'s, per row tile).

  Decode (m <= 64 rows) is bound by the weight bytes: 64-column tiles, and K split
  (`split_k`) until there are `TARGET_PROGRAMS` programs (or every split is one block_k
  step), so that enough programs stream the weight at once; prefill tiles are 128 wide,
  unsplit. 8 warps: each K step decodes a [block_k/2, block_n] byte tile (and, for
  W4A4, the x tile) into bf16 values in registers; compiled for sm_90 at Qwen3-30B-A3B
  decode shapes, 4 warps need 235 registers a thread for W4A16 and spill 10 KiB for W4A4,
  8 warps 122 and 4 bytes. 3 stages keep three K steps of weight bytes in flight (51 KiB
  of shared memory at the decode defaults, of 227).
  """
  decode = m <= 64
  block_n = dispatch.block_size(n, (64, 32, 16) if decode else (128, 64, 32, 16), "N")
  block_k = dispatch.block_size(k, (256, 128, 64, 32), "K")
  return dict(
    block_n=block_n,
    block_k=block_k,
    num_warps=8,
    num_stages=3,
    k_splits=split_k(m, n // block_n, k // block_k),
  )


def split_k(m: int, column_tiles: int, steps: int) -> int:
  """Parts to split K's `steps` block_k steps into, for m rows (see `tiling`): at decode
  the fewest (a divisor of `steps`) that make `TARGET_PROGRAMS` programs, else one a step."""
  programs = -(-m // dispatch.row_tiling(m)[0]) * column_tiles
  if m > 64:
    return 1
  return next(
    (d for d in range(1, steps + 1) if steps % d == 0 and programs * d >= TARGET_PROGRAMS), steps
  )


@functools.partial(
  jax.jit,
  static_argnames=(
    "out_dtype",
    "interpret",
    "poison",
    "block_n",
    "block_k",
    "k_splits",
    "num_warps",
    "num_stages",
  ),
)
def fp4_matmul(
  x,
  w: fp4.QArray,
  *,
  out_dtype=jnp.float32,
  interpret: bool | None = None,
  poison: bool = False,
  block_n: int | None = None,
  block_k: int | None = None,
  k_splits: int | None = None,
  num_warps: int | None = None,
  num_stages: int | None = None,
):
  """x [..., K] (array, or per-token `fp4.QArray`) @ FP4 w [K, N] -> [..., N] `out_dtype`.

  Args:
    x: activations, bf16/float32 (W4A16) or an `fp4.QArray` along the last axis (W4A4).
    w: packed weight from `fp4.quantize(w, fmt, axis=0)`.
    out_dtype: output dtype (the accumulation is float32 either way).
    interpret: run in Pallas interpret mode; default: on unless the backend is a GPU.
    poison: fill the output before the kernel so unwritten elements show (tests).
    block_n, block_k: tile sizes; k_splits: parts of K summed by separate programs;
      num_warps, num_stages: Triton params (compiled only). Defaults: `tiling`.
  """
  _, k, n = _check(x, w)
  quantized_x = isinstance(x, fp4.QArray)
  lead = (x.packed if quantized_x else x).shape[:-1]
  m = math.prod(lead)
  defaults = tiling(m, n, k)
  block_n = block_n or defaults["block_n"]
  block_k = block_k or defaults["block_k"]
  if n % block_n:
    raise ValueError(f"fp4_matmul: block_n={block_n} must divide N={n}")
  if k % block_k or block_k % 32:
    raise ValueError(f"fp4_matmul: block_k={block_k} must divide K={k} and be a multiple of 32")
  k_splits = k_splits or split_k(m, n // block_n, k // block_k)
  if k_splits < 1 or (k // block_k) % k_splits:
    raise ValueError(
      f"fp4_matmul: k_splits={k_splits} must divide the {k // block_k} block_k steps of K={k}"
    )
  block_m, rows = dispatch.row_tiling(m)
  gs_w = jnp.broadcast_to(w.global_scale.astype(_F32).reshape(1, -1), (1, n))  # per tensor
  if quantized_x:
    xp = dispatch.pad_rows(x.packed.reshape(m, k // 2), rows)
    xs = dispatch.pad_rows(x.scales.reshape(m, -1), rows)
    xg = dispatch.pad_rows(x.global_scale.astype(_F32).reshape(m, 1), rows, 1.0)
    x_inputs = (xp, xs, xg)
    x_specs = [
      pl.BlockSpec((block_m, k // 2), lambda i, j, s: (i, 0)),
      pl.BlockSpec((block_m, xs.shape[1]), lambda i, j, s: (i, 0)),
      pl.BlockSpec((block_m, 1), lambda i, j, s: (i, 0)),
    ]
    # c * s_b is exact in bf16 for both formats (<= 6 significant bits; an E8M0 scale is a
    # power of two inside bf16's exponent range, as float32's), so the dots run in bf16 on
    # the tensor cores; float32 operands would take Triton's FMA path, which spills.
    dtype = jnp.bfloat16
  else:
    x_inputs = tiles.even_odd(dispatch.pad_rows(x.reshape(m, k), rows))  # see fp4.tiles
    x_specs = [pl.BlockSpec((block_m, k // 2), lambda i, j, s: (i, 0))] * 2
    dtype = x.dtype
  scaled = k_splits == 1
  kernel = functools.partial(
    _kernel,
    fmt=w.fmt,
    x_fmt=x.fmt if quantized_x else None,
    block_k=block_k,
    steps=k // block_k // k_splits,
    dtype=dtype,
    scaled=scaled,
  )
  w_specs = [
    pl.BlockSpec((k // 2, block_n), lambda i, j, s: (0, j)),
    pl.BlockSpec((w.scales.shape[0], block_n), lambda i, j, s: (0, j)),
    pl.BlockSpec((1, block_n), lambda i, j, s: (0, j)),
  ]
  if scaled:
    out_shape = jax.ShapeDtypeStruct((rows, n), out_dtype)
    out_spec = pl.BlockSpec((block_m, block_n), lambda i, j, s: (i, j))
  else:  # float32 partial sums, one [rows, n] slab per split
    out_shape = jax.ShapeDtypeStruct((k_splits, rows, n), _F32)
    out_spec = pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j))
  y = dispatch.pallas_call(
    kernel,
    out_shape=[out_shape],
    grid=(rows // block_m, n // block_n, k_splits),
    in_specs=[*x_specs, *w_specs],
    out_specs=[out_spec],
    inputs=(*x_inputs, w.packed, w.scales, gs_w),
    interpret=dispatch.interpret_default(interpret),
    poison=poison,
    name="fp4_matmul",
    num_warps=num_warps or defaults["num_warps"],
    num_stages=num_stages or defaults["num_stages"],
  )[0]
  if not scaled:
    scale = gs_w if not quantized_x else x_inputs[2] * gs_w  # [1 or rows, n]
    y = (jnp.sum(y, axis=0) / scale).astype(out_dtype)
  return y[:m].reshape(*lead, n)


def reference(x, w: fp4.QArray, *, out_dtype=jnp.float32):
  """The kernel's math in plain XLA: one float32 dot, then the global scales."""
  _check(x, w)
  if isinstance(x, fp4.QArray):
    xv, gs_x = fp4.block_scaled_values(x), x.global_scale.astype(_F32)
  else:
    xv, gs_x = x.astype(_F32), jnp.ones((), _F32)
  y = jnp.einsum(
    "...k,kn->...n",
    xv,
    fp4.block_scaled_values(w),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=_F32,
  )
  return (y / (gs_x * w.global_scale.astype(_F32))).astype(out_dtype)
