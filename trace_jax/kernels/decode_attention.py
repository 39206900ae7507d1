"""Decode attention over the FP4 KV cache: one query token per sequence (flash-decoding).

  out[b, h] = sum_s softmax_s(q[b, h] . k[b, s, h // G] / sqrt(Dh)) v[b, s, h // G]

over the slots s < lengths[b] that `valid` marks (G = H / Hkv query heads per KV head).
K and V are the cache's `fp4.QArray`s [B, L, Hkv, Dh]: packed codes, E4M3 scales per 16
elements of a head, one global scale per (token, KV head). The kernel reads the packed
bytes, forms c * s_b in registers and divides by each token's global scale after the dot
over Dh (for K, on the scores; for V, folded into the probabilities), so a cache entry is
never dequantized in memory. Masked slots are zeroed before every product, so a NaN left in
a slot that is not attended to (0 * NaN) cannot reach the output; NaN in an attended slot
stays visible.

Grid: (B, Hkv, splits). Each program takes one split of the slots, walks it in chunks with
an online softmax (skipping chunks past the sequence's length) and writes an unnormalised
partial (out, max, sum); a small XLA step combines the splits. A sequence with no valid
slot gets 0 (the engine never asks for one: a decode step attends to itself).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax import fp4
from trace_jax.fp4 import tiles
from trace_jax.kernels import dispatch

_F32 = jnp.float32
_NEG = -1e30  # the running max before any valid slot (finite: no inf - inf)


def _check(q, k, v, lengths, valid):
  for name, entry in (("k", k), ("v", v)):
    if not isinstance(entry, fp4.QArray) or entry.packed.ndim != 4 or entry.axis != -1:
      raise ValueError(
        f"decode_attention: {name} must be an FP4 cache entry, an fp4.QArray "
        f"[B, L, Hkv, Dh] quantized along Dh; got {type(entry).__name__}"
      )
  b, length, hkv, half = k.packed.shape
  if v.packed.shape != k.packed.shape:
    raise ValueError(f"decode_attention: k and v differ: {k.packed.shape} vs {v.packed.shape}")
  if q.ndim != 3 or q.shape[0] != b or q.shape[2] != 2 * half or q.shape[1] % hkv:
    raise ValueError(
      f"decode_attention: q must be [B={b}, H (a multiple of Hkv={hkv}), "
      f"Dh={2 * half}]; got {q.shape}"
    )
  if lengths.shape != (b,):
    raise ValueError(f"decode_attention: lengths must be [B={b}]; got {lengths.shape}")
  if valid is not None and valid.shape != (b, length):
    raise ValueError(f"decode_attention: valid must be [B={b}, L={length}]; got {valid.shape}")
  return b, length, hkv, 2 * half


def _kernel(
  len_ref,
  qe_ref,
  qo_ref,
  kp_ref,
  ks_ref,
  kg_ref,
  vp_ref,
  vs_ref,
  vg_ref,
  valid_ref,
  oe_ref,
  oo_ref,
  m_ref,
  l_ref,
  *,
  fmt,
  split,
  chunk,
  dtype,
):
  b, s = pl.program_id(0), pl.program_id(2)
  groups, half = qe_ref.shape
  first = s * split
  scale = (2 * half) ** -0.5
  chunks = jnp.clip((len_ref[b] - first + chunk - 1) // chunk, 0, split // chunk)
  q_even, q_odd = qe_ref[...].astype(dtype), qo_ref[...].astype(dtype)
  contract_last = (((1,), (1,)), ((), ()))

  def step(c, carry):
    out_even, out_odd, m, l = carry
    slots = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    k_even, k_odd = tiles.scaled_pairs(kp_ref[slots, :], ks_ref[slots, :], fmt, axis=1)
    scores = jax.lax.dot_general(
      q_even, k_even.astype(dtype), contract_last, preferred_element_type=_F32
    ) + jax.lax.dot_general(
      q_odd, k_odd.astype(dtype), contract_last, preferred_element_type=_F32
    )  # [G, chunk]
    scores = scores / kg_ref[slots, :].reshape(1, chunk) * scale
    position = first + c * chunk + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
    keep = (position < len_ref[b]) & (valid_ref[slots].reshape(1, chunk) != 0)
    m_new = jnp.maximum(m, jnp.max(jnp.where(keep, scores, _NEG), axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(keep, jnp.exp(scores - m_new), 0.0)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    # Masked slots may hold anything (a NaN global or block scale of a skipped token): zero
    # them before the products, since p = 0 there and 0 * NaN (or 0 / NaN) would be NaN.
    v_scale = jnp.where(keep, vg_ref[slots, :].reshape(1, chunk), 1.0)
    pv = (p / v_scale).astype(dtype)  # V's global scale, folded
    v_even, v_odd = tiles.scaled_pairs(vp_ref[slots, :], vs_ref[slots, :], fmt, axis=1)
    row = first + c * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    keep_rows = (row < len_ref[b]) & (valid_ref[slots].reshape(chunk, 1) != 0)  # keep, as a column
    v_even, v_odd = jnp.where(keep_rows, v_even, 0.0), jnp.where(keep_rows, v_odd, 0.0)
    out_even = alpha * out_even + jnp.dot(pv, v_even.astype(dtype), preferred_element_type=_F32)
    out_odd = alpha * out_odd + jnp.dot(pv, v_odd.astype(dtype), preferred_element_type=_F32)
    return out_even, out_odd, m_new, l

  init = (
    jnp.zeros((groups, half), _F32),
    jnp.zeros((groups, half), _F32),
    jnp.full((groups, 1), _NEG, _F32),
    jnp.zeros((groups, 1), _F32),
  )
  out_even, out_odd, m, l = jax.lax.fori_loop(0, chunks, step, init)
  oe_ref[...], oo_ref[...] = out_even, out_odd
  m_ref[...], l_ref[...] = m, l


@functools.partial(
  jax.jit, static_argnames=("interpret", "poison", "num_splits", "chunk", "num_warps", "num_stages")
)
def decode_attention(
  q: jax.Array,
  k: fp4.QArray,
  v: fp4.QArray,
  lengths: jax.Array,
  valid: jax.Array | None = None,
  *,
  interpret: bool | None = None,
  poison: bool = False,
  num_splits: int | None = None,
  chunk: int | None = None,
  num_warps: int | None = None,
  num_stages: int = 2,
) -> jax.Array:
  """One decode step of grouped-query attention over an FP4 KV cache.

  Args:
    q: [B, H, Dh] queries (after RoPE), bf16 or float32.
    k, v: FP4 cache entries, `fp4.QArray` [B, L, Hkv, Dh] along Dh.
    lengths: int [B]: slots [0, length) may be attended to.
    valid: optional bool [B, L]: which of those slots hold real tokens (left padding).
    interpret, poison: as in `fp4_matmul`.
    num_splits: splits of the L slots (flash-decoding); default up to 8.
    chunk: slots per inner step; default the largest power of two up to 128 dividing L.
    num_warps, num_stages: Triton params (compiled only). Default 8 warps for 128-slot
      chunks (at 4 warps a thread holds 255 registers and spills, compiled for sm_90 at
      Qwen3-30B-A3B shapes) and 4 for smaller ones; 2 stages prefetch the next chunk's K
      and V bytes while this one is computed (the loop's trip count depends on the
      length, so deeper pipelines mostly prefetch past the end).

  Returns:
    [B, H, Dh] in q's dtype.
  """
  b, length, hkv, dh = _check(q, k, v, lengths, valid)
  h = q.shape[1]
  groups = h // hkv
  if num_splits is not None and (num_splits <= 0 or length % num_splits):
    raise ValueError(f"decode_attention: num_splits={num_splits} must divide L={length}")
  sizes = (128, 64, 32, 16, 8, 4, 2, 1)
  chunk = chunk or dispatch.block_size(length // (num_splits or 1), sizes, "L / num_splits")
  num_splits = num_splits or dispatch.block_size(length // chunk, (8, 4, 2, 1), "L / chunk")
  if length % (num_splits * chunk):
    raise ValueError(
      f"decode_attention: num_splits={num_splits} x chunk={chunk} must divide L={length}"
    )
  split = length // num_splits
  interpret = dispatch.interpret_default(interpret)
  padded = groups if interpret else max(16, groups)  # GPU dots want >= 16 rows
  qg = q.reshape(b, hkv, groups, dh)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded - groups), (0, 0)))
  valid = jnp.ones((b, length), jnp.int32) if valid is None else valid.astype(jnp.int32)
  dtype = q.dtype

  def cache_spec(last):
    return pl.BlockSpec((None, split, None, last), lambda i, j, s: (i, s, j, 0))

  head_spec = pl.BlockSpec((None, None, padded, dh // 2), lambda i, j, s: (i, j, 0, 0))
  part_spec = pl.BlockSpec((None, None, None, padded, dh // 2), lambda i, j, s: (i, j, s, 0, 0))
  stat_spec = pl.BlockSpec((None, None, None, padded, 1), lambda i, j, s: (i, j, s, 0, 0))
  part_shape = jax.ShapeDtypeStruct((b, hkv, num_splits, padded, dh // 2), _F32)
  stat_shape = jax.ShapeDtypeStruct((b, hkv, num_splits, padded, 1), _F32)
  kernel = functools.partial(_kernel, fmt=k.fmt, split=split, chunk=chunk, dtype=dtype)
  out_even, out_odd, m, l = dispatch.pallas_call(
    kernel,
    out_shape=[part_shape, part_shape, stat_shape, stat_shape],
    grid=(b, hkv, num_splits),
    in_specs=[
      pl.BlockSpec((b,), lambda i, j, s: (0,)),
      head_spec,
      head_spec,
      cache_spec(dh // 2),
      cache_spec(k.scales.shape[-1]),
      cache_spec(1),
      cache_spec(dh // 2),
      cache_spec(v.scales.shape[-1]),
      cache_spec(1),
      pl.BlockSpec((None, split), lambda i, j, s: (i, s)),
    ],
    out_specs=[part_spec, part_spec, stat_spec, stat_spec],
    inputs=(
      lengths.astype(jnp.int32),
      *tiles.even_odd(qg),
      k.packed,
      k.scales,
      k.global_scale.astype(_F32),
      v.packed,
      v.scales,
      v.global_scale.astype(_F32),
      valid,
    ),
    interpret=interpret,
    poison=poison,
    name="decode_attention",
    num_warps=num_warps or (8 if chunk >= 128 else 4),
    num_stages=num_stages,
  )
  # Combine the splits: rescale each partial to the overall max, then normalise.
  weight = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))  # [B, Hkv, S, G, 1]
  total = jnp.sum(weight * l, axis=2)  # [B, Hkv, G, 1]
  out = tiles.interleave(*(jnp.sum(weight * part, axis=2) for part in (out_even, out_odd)))
  out = jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)
  return out[:, :, :groups].reshape(b, h, dh).astype(q.dtype)


def reference(
  q: jax.Array, k: fp4.QArray, v: fp4.QArray, lengths: jax.Array, valid: jax.Array | None = None
) -> jax.Array:
  """The kernel's math in plain XLA, float32: c * s_b / gs for K and V, a masked softmax;
  0 for a sequence with no valid slot."""
  b, length, hkv, dh = _check(q, k, v, lengths, valid)
  h = q.shape[1]
  keys = fp4.block_scaled_values(k) / k.global_scale
  values = fp4.block_scaled_values(v) / v.global_scale
  qg = q.astype(_F32).reshape(b, hkv, h // hkv, dh)
  scores = jnp.einsum("bkgd,bskd->bkgs", qg, keys, precision=jax.lax.Precision.HIGHEST) * dh**-0.5
  keep = jnp.arange(length)[None, :] < lengths[:, None]
  if valid is not None:
    keep = keep & valid
  # Masked slots may hold NaN (a skipped token's scales): zero them before the product.
  values = jnp.where(keep[:, :, None, None], values, 0.0)
  keep = keep[:, None, None, :]
  scores = jnp.where(keep, scores, -jnp.inf)
  probs = jnp.exp(scores - jnp.max(jnp.where(keep, scores, 0.0), -1, keepdims=True))
  probs = jnp.where(keep, probs, 0.0)
  total = probs.sum(-1, keepdims=True)
  probs = probs / jnp.where(total > 0, total, 1.0)
  out = jnp.einsum("bkgs,bskd->bkgd", probs, values, precision=jax.lax.Precision.HIGHEST)
  return out.reshape(b, h, dh).astype(q.dtype)
