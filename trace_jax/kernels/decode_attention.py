"""Decode attention over the FP4 KV cache: one query token per sequence (flash-decoding).

  out[b, h] = sum_s softmax_s(q[b, h] . k[b, s, h // G] / sqrt(Dh)) v[b, s, h // G]

over the slots s < lengths[b] that `valid` marks (G = H / Hkv query heads per KV head).
K and V are the cache's `fp4.QArray`s [B, L, Hkv, Dh]: packed codes, E4M3 scales per 16
elements of a head, one global scale per (token, KV head). The kernel reads the packed
bytes, forms c * s_b in bf16 registers (`fp4.tiles.scaled_pairs_bf16`) and divides by each
token's global scale after the dot over Dh (for K, on the scores; for V, folded into the
probabilities), so a cache entry is never dequantized in memory. Masked slots are zeroed
before every product, so a NaN left in a slot that is not attended to (0 * NaN) cannot
reach the output; NaN in an attended slot stays visible.

Programs: both kernels are written for one KV head of one sequence, and `jax.vmap` over
the sequences and the KV heads gives each pair its own programs and BlockSpec slices (the
cache is read in place). The slots, any length L, are cut into `chunk`-slot chunks (the last
one partial: L = context + 1 is odd) and S splits of whole chunks, one program each, with S
chosen from B * Hkv and L so that there are at least `TARGET_PROGRAMS` programs (two per SM
of an H100/H200) whenever L has that many 32-slot chunks (`num_splits`, `default_chunk`):
grid (B, Hkv, S). Each program walks its split with an online softmax (stopping at the
sequence's length) and writes an unnormalised partial (out, max, sum); a second small kernel
(grid B x Hkv x G, one program a query head) combines the splits. A sequence with no valid
slot gets 0 (the engine never asks for one: a step attends to itself).

K and V may be the stacks of every layer's entries [N, B, L, Hkv, ...] (`model.cache`'s
`LayerEntries`) with the layer's position in them given (`layer`, traced inside a scan over
layers): the kernel reads that layer's slots straight from the stacks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from trace_jax import fp4
from trace_jax.fp4 import numerics, tiles
from trace_jax.kernels import launch

_F32 = jnp.float32
_NEG = -1e30  # the running max before any valid slot (finite: no inf - inf)
TARGET_PROGRAMS = 264  # two programs per SM of an H100 / H200 (132 SMs)


def _check(q, k, v, lengths, valid, stacked=False):
  form = "[N, B, L, Hkv, Dh] (with layer=)" if stacked else "[B, L, Hkv, Dh]"
  for name, entry in (("k", k), ("v", v)):
    ndim = 5 if stacked else 4
    if not isinstance(entry, fp4.QArray) or entry.packed.ndim != ndim or entry.axis != -1:
      raise ValueError(
        f"decode_attention: {name} must be an FP4 cache entry, an fp4.QArray "
        f"{form} quantized along Dh; got {type(entry).__name__}"
      )
  b, length, hkv, half = k.packed.shape[-4:]
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


def default_chunk(length: int, batch: int = 1, kv_heads: int = 1) -> int:
  """Slots per inner step: 128 (a short cache: the smallest power of two >= 16 holding it),
  halved down to 32 while the cache has too few chunks for `TARGET_PROGRAMS` programs."""
  chunk = 128 if length >= 128 else max(16, 1 << (length - 1).bit_length())
  while chunk > 32 and -(-length // chunk) * batch * kv_heads < TARGET_PROGRAMS:
    chunk //= 2
  return chunk


def num_splits(batch: int, kv_heads: int, length: int, chunk: int) -> tuple[int, int]:
  """(splits, chunks per split) for B x Hkv heads over L slots: the longest splits of whole
  chunks that still give every SM two programs (`TARGET_PROGRAMS`), or one chunk a split
  when the cache is too short for that."""
  chunks = -(-length // chunk)
  wanted = -(-TARGET_PROGRAMS // (batch * kv_heads))  # splits per head for the target
  per_split = max(1, chunks // wanted)
  return -(-chunks // per_split), per_split


def _attention_kernel(
  layer_ref,  # [1] int32: the layer's entry in the stacks
  len_ref,  # [] int32: the sequence's length
  q_ref,  # [G, Dh]: the query heads of this KV head
  kp_ref,  # [N, span, Dh/2] uint8: K's codes in this split's slots, two a byte
  ks_ref,  # [N, span, Dh/block] uint8: K's E4M3 (E8M0) block scales
  kg_ref,  # [N, span, 1] f32: K's global scale per token
  vp_ref,  # [N, span, Dh/2] uint8: V's codes
  vs_ref,  # [N, span, Dh/block] uint8: V's block scales
  vg_ref,  # [N, span, 1] f32: V's global scale per token
  valid_ref,  # [span] int8: the split's slots that hold real tokens
  o_ref,  # [G, Dh] f32 out: the split's unnormalised output
  m_ref,  # [G] f32 out: the split's running max of the scores
  l_ref,  # [G] f32 out: the split's sum of exp(score - max)
  *, fmt, rows, chunk, per_split, length, dtype,
):  # fmt: skip
  """One KV head of one sequence over one split (`per_split` chunks of `chunk` slots):
  an online softmax over the split's valid slots, stopping at the sequence's length."""
  groups, dh = q_ref.shape
  first = pl.program_id(0) * per_split * chunk  # the split's first slot in the cache
  layer, n = layer_ref[0], len_ref[()]
  steps = jnp.clip((jnp.minimum(n, length) - first + chunk - 1) // chunk, 0, per_split)
  head_rows = jax.lax.broadcasted_iota(jnp.int32, (rows, dh), 0) < groups
  q = plgpu.load(q_ref.at[pl.ds(0, rows), :], mask=head_rows, other=0)
  q_even, q_odd = (a.reshape(rows, dh // 2) for a in jnp.split(q.reshape(rows, dh // 2, 2), 2, 2))
  q_even, q_odd = q_even.astype(dtype), q_odd.astype(dtype)
  scale = dh**-0.5
  contract_last = (((1,), (1,)), ((), ()))

  def step(c, carry):
    out_even, out_odd, m, l = carry
    start = pl.multiple_of(c * chunk, chunk)  # within the split
    slots = pl.ds(start, chunk)
    position = first + start + jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    inside = position < length  # the last chunk may run past the cache
    keep = inside & (position < n) & (plgpu.load(valid_ref.at[slots], mask=inside, other=0) != 0)

    def load(ref, width):
      mask = jnp.broadcast_to(inside[:, None], (chunk, width))
      return plgpu.load(ref.at[layer, slots, :], mask=mask, other=0)

    k_even, k_odd = tiles.scaled_pairs_bf16(
      load(kp_ref, dh // 2), load(ks_ref, ks_ref.shape[-1]), fmt, axis=1
    )
    scores = jax.lax.dot_general(
      q_even, k_even.astype(dtype), contract_last, preferred_element_type=_F32
    ) + jax.lax.dot_general(q_odd, k_odd.astype(dtype), contract_last, preferred_element_type=_F32)
    k_scale = jnp.where(keep, load(kg_ref, 1).reshape(chunk), 1.0)
    # every division correctly rounded (numerics.true_divide): a plain `/` lowers to
    # Triton's approximate div.full.f32
    scores = numerics.true_divide(scores, k_scale[None, :]) * scale  # [rows, chunk]
    m_new = jnp.maximum(m, jnp.max(jnp.where(keep[None, :], scores, _NEG), axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(keep[None, :], jnp.exp(scores - m_new), 0.0)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    # Masked slots may hold anything (a NaN global or block scale of a skipped token): zero
    # them before the products, since p = 0 there and 0 * NaN (or 0 / NaN) would be NaN.
    v_scale = jnp.where(keep, load(vg_ref, 1).reshape(chunk), 1.0)
    pv = numerics.true_divide(p, v_scale[None, :]).astype(dtype)  # V's global scale, folded
    v_even, v_odd = tiles.scaled_pairs_bf16(
      load(vp_ref, dh // 2), load(vs_ref, vs_ref.shape[-1]), fmt, axis=1
    )
    kept = keep[:, None]
    v_even, v_odd = (
      jnp.where(kept, v_even, 0).astype(dtype),
      jnp.where(kept, v_odd, 0).astype(dtype),
    )
    out_even = alpha * out_even + jnp.dot(pv, v_even, preferred_element_type=_F32)
    out_odd = alpha * out_odd + jnp.dot(pv, v_odd, preferred_element_type=_F32)
    return out_even, out_odd, m_new, l

  init = (
    jnp.zeros((rows, dh // 2), _F32),
    jnp.zeros((rows, dh // 2), _F32),
    jnp.full((rows, 1), _NEG, _F32),
    jnp.zeros((rows, 1), _F32),
  )
  out_even, out_odd, m, l = jax.lax.fori_loop(0, steps, step, init)
  out = jnp.stack([out_even, out_odd], axis=-1).reshape(rows, dh)  # even/odd interleaved
  plgpu.store(o_ref.at[pl.ds(0, rows), :], out, mask=head_rows)
  stat_rows = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) < groups
  plgpu.store(m_ref.at[pl.ds(0, rows)], m.reshape(rows), mask=stat_rows)
  plgpu.store(l_ref.at[pl.ds(0, rows)], l.reshape(rows), mask=stat_rows)


def _combine_kernel(
  o_ref,  # [S, Dh] f32: the query head's unnormalised partial per split
  m_ref,  # [S] f32: each split's max score
  l_ref,  # [S] f32: each split's sum
  out_ref,  # [Dh] out: the query head's output
  *, width,
):  # fmt: skip
  """One query head of one sequence: the splits' partials rescaled to the overall max,
  summed and normalised (0 when no slot was valid). `width`: the splits, rounded up to a
  power of two (loads are powers of two: the rest is masked)."""
  splits, dh = o_ref.shape
  used = jax.lax.broadcasted_iota(jnp.int32, (width,), 0) < splits
  m = plgpu.load(m_ref.at[pl.ds(0, width)], mask=used, other=_NEG)
  l = plgpu.load(l_ref.at[pl.ds(0, width)], mask=used, other=0.0)
  parts = plgpu.load(
    o_ref.at[pl.ds(0, width), :], mask=jnp.broadcast_to(used[:, None], (width, dh)), other=0.0
  )
  weight = jnp.where(used, jnp.exp(m - jnp.max(m)), 0.0)
  total = jnp.sum(weight * l)
  out = jnp.sum(weight[:, None] * parts, axis=0)  # [Dh]
  out = jnp.where(total > 0, numerics.true_divide(out, jnp.where(total > 0, total, 1.0)), 0.0)
  out_ref[...] = out.astype(out_ref.dtype)


def decode_attention(
  q: jax.Array,
  k: fp4.QArray,
  v: fp4.QArray,
  lengths: jax.Array,
  valid: jax.Array | None = None,
  *,
  layer: jax.Array | int | None = None,
  interpret: bool | None = None,
  poison: bool = False,
  chunk: int | None = None,
  splits: int | None = None,
  num_warps: int | None = None,
  num_stages: int = 2,
) -> jax.Array:
  """One decode step of grouped-query attention over an FP4 KV cache.

  Args:
    q: [B, H, Dh] queries (after RoPE), bf16 or float32.
    k, v: FP4 cache entries, `fp4.QArray` [B, L, Hkv, Dh] along Dh; any L.
    lengths: int [B]: slots [0, length) may be attended to.
    valid: optional bool [B, L]: which of those slots hold real tokens (left padding).
    layer: k and v are stacks [N, B, L, Hkv, Dh] of N layers' entries; attend over entry
      `layer` (an int or an int32 scalar) of them.
    interpret, poison: as the other kernels.
    chunk: slots per inner step (a power of two; default `default_chunk`).
    splits: splits of the slots (default `num_splits`: enough programs for the GPU).
    num_warps, num_stages: Triton params (compiled only): 8 warps for 128-slot chunks
      (at 4 a thread needs more than 255 registers), 4 below; 2 stages prefetch the next
      chunk's K and V bytes while this one is computed.

  Returns:
    [B, H, Dh] in q's dtype.
  """
  b, length, hkv, dh = _check(q, k, v, lengths, valid, stacked=layer is not None)
  chunk = chunk or default_chunk(length, b, hkv)
  if chunk < 1 or chunk & (chunk - 1):
    raise ValueError(f"decode_attention: chunk={chunk} must be a power of two")
  chunks = -(-length // chunk)
  if splits is None:
    splits, per_split = num_splits(b, hkv, length, chunk)
  elif not 1 <= splits <= chunks:
    raise ValueError(f"decode_attention: splits={splits} must lie in [1, {chunks}] for L={length}")
  else:
    per_split = -(-chunks // splits)
    splits = -(-chunks // per_split)
  valid = jnp.ones((b, length), jnp.int8) if valid is None else valid.astype(jnp.int8)
  if layer is None:
    k, v = (jax.tree.map(lambda a: a[None], entry) for entry in (k, v))
  return _attention(
    q,
    k,
    v,
    jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1),
    lengths.astype(jnp.int32),
    valid,
    chunk=chunk,
    splits=splits,
    per_split=per_split,
    interpret=launch.interpret_default(interpret),
    poison=poison,
    num_warps=num_warps or (8 if chunk >= 128 else 4),
    num_stages=num_stages,
  )


_STATIC = ("chunk", "splits", "per_split", "interpret", "poison", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _attention(q, k, v, layer, lengths, valid, **static):
  """Both kernels, each written for one KV head of one sequence; `jax.vmap` over the
  sequences and then the KV heads gives each (sequence, KV head) its own programs and its
  own slices of q, the cache and the outputs (the cache is read in place: no copy)."""
  b, h, dh = q.shape
  hkv = k.packed.shape[3]
  heads = q.reshape(b, hkv, h // hkv, dh)
  fields = lambda e: (e.packed, e.scales, e.global_scale.astype(_F32))  # noqa: E731
  head = functools.partial(_one_head, layer=layer, fmt=k.fmt, **static)
  # the cache fields are [N, B, L, Hkv, ...]: B is axis 1, then Hkv is axis 2
  per_kv_head = jax.vmap(head, in_axes=(0, 2, 2, 2, 2, 2, 2, None, None))
  per_sequence = jax.vmap(per_kv_head, in_axes=(0, 1, 1, 1, 1, 1, 1, 0, 0))
  out = per_sequence(heads, *fields(k), *fields(v), lengths, valid)  # [B, Hkv, G, Dh]
  return out.reshape(b, h, dh)


def _one_head(
  q, kp, ks, kg, vp, vs, vg, length_b, valid, *, layer, fmt, chunk, splits, per_split,
  interpret, poison, num_warps, num_stages,
):  # fmt: skip
  """q [G, Dh] of one KV head over its cache fields [N, L, ...] -> [G, Dh]: the attention
  kernel over (split) and the combine kernel over (query head)."""
  groups, dh = q.shape
  length = kp.shape[1]
  rows = groups if interpret else max(16, groups)  # GPU dots want >= 16 rows
  span = per_split * chunk  # a split's slots (the last split's may run past the cache)
  whole = lambda a: pl.BlockSpec(a.shape, lambda s: (0,) * a.ndim)  # noqa: E731
  slots = lambda a: pl.BlockSpec((a.shape[0], span, a.shape[2]), lambda s: (0, s, 0))  # noqa: E731
  cache = (kp, ks, kg, vp, vs, vg)
  part = jax.ShapeDtypeStruct((splits, groups, dh), _F32)
  stat = jax.ShapeDtypeStruct((splits, groups), _F32)
  kernel = functools.partial(
    _attention_kernel,
    fmt=fmt,
    rows=rows,
    chunk=chunk,
    per_split=per_split,
    length=length,
    dtype=q.dtype,
  )
  parts, m, l = launch.pallas_call(
    kernel,
    out_shape=[part, stat, stat],
    grid=(splits,),
    in_specs=[
      whole(layer),
      pl.BlockSpec((), lambda s: ()),
      whole(q),
      *(slots(a) for a in cache),
      pl.BlockSpec((span,), lambda s: (s,)),
    ],
    out_specs=[
      pl.BlockSpec((None, groups, dh), lambda s: (s, 0, 0)),
      pl.BlockSpec((None, groups), lambda s: (s, 0)),
      pl.BlockSpec((None, groups), lambda s: (s, 0)),
    ],
    inputs=(layer, length_b, q, *cache, valid),
    interpret=interpret,
    poison=poison,
    name="decode_attention",
    num_warps=num_warps,
    num_stages=num_stages,
  )
  width = 1 << max(0, splits - 1).bit_length()
  out_shape = jax.ShapeDtypeStruct((groups, dh), q.dtype)
  (out,) = launch.pallas_call(
    functools.partial(_combine_kernel, width=width),
    out_shape=[out_shape],
    grid=(groups,),
    in_specs=[
      pl.BlockSpec((splits, None, dh), lambda g: (0, g, 0)),
      pl.BlockSpec((splits, None), lambda g: (0, g)),
      pl.BlockSpec((splits, None), lambda g: (0, g)),
    ],
    out_specs=[pl.BlockSpec((None, dh), lambda g: (g, 0))],
    inputs=(parts, m, l),
    interpret=interpret,
    poison=poison,
    name="decode_attention_combine",
    num_warps=8 if width * dh >= 8192 else 4,
    num_stages=1,
  )
  return out


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
  top = jnp.max(scores, -1, keepdims=True)  # over the kept slots only
  top = jnp.where(jnp.isfinite(top), top, 0.0)  # a sequence with no valid slot
  probs = jnp.where(keep, jnp.exp(scores - top), 0.0)
  total = probs.sum(-1, keepdims=True)
  probs = probs / jnp.where(total > 0, total, 1.0)
  out = jnp.einsum("bkgs,bskd->bkgd", probs, values, precision=jax.lax.Precision.HIGHEST)
  return out.reshape(b, h, dh).astype(q.dtype)
