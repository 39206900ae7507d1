"""New K and V entries quantized and written into the FP4 cache in place, in one kernel.

  cache[b, index + t, h] = fp4.quantize(x[b, t, h], fmt, global_group="row")

for x = K (after RoPE) and V, each row one (token, KV head) of Dh elements (one global
group), written straight into the cache buffers (aliased: no XLA dynamic-update-slices of
the cache's six arrays), with the rollout's record of both (compact guidance bits and scales,
or the full codes) as side outputs. A chunk whose every token is masked (`keep` false: a
decode step after all sequences stopped) writes blank entries (codes 0, scales 0, global
scale 1), exactly what a never-written slot holds, so an extra step leaves no trace.

Grid: (B, T), one program per written slot of one sequence: its Hkv rows (padded to a power
of two) are quantized with `fp4.tiles.quantize_pairs` (bit for bit `fp4.quantize`).

The cache may be the stack of every layer's entries [N, B, L, Hkv, ...] (`model.cache`'s
`LayerEntries`) with the layer's position in it given (`layer`, traced inside a scan over
layers): the kernel writes that layer's slots of the whole stack in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from trace_jax import fp4
from trace_jax.fp4 import tiles
from trace_jax.kernels import launch

_F32 = jnp.float32
_FIELDS = ("packed", "scales", "global_scale")
_RECORD_FIELDS = {"none": (), "compact": ("scales", "global_scale", "bits"), "full": _FIELDS}


def _check(k_new, v_new, cache_k, cache_v, record, stacked=False):
  form = "[N, B, L, Hkv, Dh] (with layer=)" if stacked else "[B, L, Hkv, Dh]"
  for name, entry in (("cache_k", cache_k), ("cache_v", cache_v)):
    ndim = 5 if stacked else 4
    if not isinstance(entry, fp4.QArray) or entry.packed.ndim != ndim or entry.axis != -1:
      raise ValueError(f"write_kv: {name} must be an FP4 cache entry {form} along Dh")
  b, _, hkv, half = cache_k.packed.shape[-4:]
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.ndim != 4 or x.shape[0] != b or x.shape[2:] != (hkv, 2 * half):
      raise ValueError(
        f"write_kv: {name} must be [B={b}, T, Hkv={hkv}, Dh={2 * half}]; got {x.shape}"
      )
  if record not in _RECORD_FIELDS:
    raise ValueError(f"write_kv: record={record!r} is not one of {tuple(_RECORD_FIELDS)}")


def _kernel(layer_ref, index_ref, keep_ref, k_ref, v_ref, *refs, fmt, rows, heads, length, record):
  # refs: the six cache stacks as inputs, the same six as (aliased) outputs, the records.
  cache_refs, record_refs = refs[6:12], refs[12:]
  b, t = pl.program_id(0), pl.program_id(1)
  layer = layer_ref[0]
  dh = k_ref.shape[-1]
  slot = index_ref[0] + t
  keep = keep_ref[0] != 0
  head = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < heads
  fields = _RECORD_FIELDS[record]
  for x_ref, cache, recs in (
    (k_ref, cache_refs[:3], record_refs[: len(fields)]),
    (v_ref, cache_refs[3:], record_refs[len(fields) :]),
  ):
    x = plgpu.load(
      x_ref.at[b, t, pl.ds(0, rows), :], mask=jnp.broadcast_to(head, (rows, dh)), other=0
    ).astype(_F32)
    # A max may drop NaN in a kernel: mark non-finite rows through the amax explicitly.
    finite = jnp.min(jnp.isfinite(x).astype(jnp.int32), axis=1, keepdims=True) == 1
    amax = jnp.where(finite, jnp.max(jnp.abs(x), axis=1, keepdims=True), jnp.nan)
    gs = tiles.row_global_scale(amax, fmt)
    even, odd = jnp.split(x.reshape(rows, dh // 2, 2), 2, axis=2)
    _, scale_bits, _, packed, bits = tiles.quantize_pairs(
      even.reshape(rows, dh // 2), odd.reshape(rows, dh // 2), gs, fmt
    )
    values = {"packed": packed, "scales": scale_bits, "global_scale": gs, "bits": bits}
    blank = {"packed": 0, "scales": 0, "global_scale": 1.0}
    for name, ref in zip(_FIELDS, cache):
      value = jnp.where(keep, values[name], blank[name]).astype(ref.dtype)
      width = value.shape[1]
      mask = jnp.broadcast_to(head & (slot < length), (rows, width))[None]
      plgpu.store(ref.at[layer, b, pl.ds(slot, 1), pl.ds(0, rows), :], value[None], mask=mask)
    for name, ref in zip(fields, recs):
      value = values[name].astype(ref.dtype)
      mask = jnp.broadcast_to(head, value.shape)
      plgpu.store(ref.at[b, t, pl.ds(0, rows), :], value, mask=mask)


def write_kv(
  k_new: jax.Array,
  v_new: jax.Array,
  cache_k: fp4.QArray,
  cache_v: fp4.QArray,
  index: jax.Array,
  keep: jax.Array | bool = True,
  *,
  layer: jax.Array | int | None = None,
  record: str = "none",
  interpret: bool | None = None,
  poison: bool = False,
):
  """Quantize K and V [B, T, Hkv, Dh] per row and write them at slots [index, index + T)
  of the FP4 cache entries (in place where the caller donates them).

  `layer`: the cache entries are stacks [N, B, L, Hkv, ...] of N layers' entries, and the
  rows are written into entry `layer` (an int or an int32 scalar) of them.

  Returns:
    (cache_k, cache_v, record_k, record_v): the updated entries (stacks, with `layer`) and,
    per `record` ("none", "compact", "full"), the records of the written rows
    [B, T, Hkv, ...] as `fp4.CompactGuidance` / `fp4.QArray`, or None.
  """
  stacked = layer is not None
  _check(k_new, v_new, cache_k, cache_v, record, stacked)
  interpret = launch.interpret_default(interpret)
  index = jnp.asarray(index, jnp.int32).reshape(1)
  keep = jnp.asarray(keep).astype(jnp.int32).reshape(1)
  static = dict(record=record, interpret=interpret, poison=poison)
  if stacked:
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return _write(k_new, v_new, cache_k, cache_v, layer, index, keep, **static)
  one = lambda entry: jax.tree.map(lambda a: a[None], entry)  # noqa: E731
  layer = jnp.zeros((1,), jnp.int32)
  k, v, rk, rv = _write(k_new, v_new, one(cache_k), one(cache_v), layer, index, keep, **static)
  return jax.tree.map(lambda a: a[0], k), jax.tree.map(lambda a: a[0], v), rk, rv


@functools.partial(jax.jit, static_argnames=("record", "interpret", "poison"))
def _write(k_new, v_new, cache_k, cache_v, layer, index, keep, *, record, interpret, poison):
  b, t, hkv, dh = k_new.shape
  length = cache_k.packed.shape[2]
  rows = 1 << max(0, hkv - 1).bit_length()
  fmt = cache_k.fmt
  block = fp4.get_format(fmt).block_size
  widths = {"packed": (dh // 2, jnp.uint8), "scales": (dh // block, jnp.uint8)}
  widths.update({"global_scale": (1, _F32), "bits": (dh // 8, jnp.uint8)})
  records = [
    jax.ShapeDtypeStruct((b, t, hkv, widths[n][0]), widths[n][1]) for n in _RECORD_FIELDS[record]
  ] * 2
  caches = [getattr(entry, n) for entry in (cache_k, cache_v) for n in _FIELDS]
  caches = [c.astype(_F32) if n == "global_scale" else c for c, n in zip(caches, _FIELDS * 2)]
  inputs = [layer, index, keep, k_new, v_new, *caches]
  whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * len(a.shape))  # noqa: E731
  out = launch.pallas_call(
    functools.partial(_kernel, fmt=fmt, rows=rows, heads=hkv, length=length, record=record),
    out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches] + records,
    grid=(b, t),
    in_specs=[whole(a) for a in inputs],
    out_specs=[whole(a) for a in [*caches, *records]],
    inputs=inputs,
    interpret=interpret,
    poison=poison,
    name="fp4_write_kv",
    num_warps=4,
    num_stages=1,
    aliases={5 + i: i for i in range(6)},
  )
  entries = [
    fp4.QArray(packed=p, scales=s, global_scale=g, fmt=fmt, axis=-1)
    for p, s, g in (out[0:3], out[3:6])
  ]
  recs = [None, None]
  if record != "none":
    n = len(_RECORD_FIELDS[record])
    for i, fields in enumerate((out[6 : 6 + n], out[6 + n :])):
      named = dict(zip(_RECORD_FIELDS[record], fields))
      recs[i] = (
        fp4.CompactGuidance(
          global_scale=named["global_scale"],
          scales=named["scales"],
          mantissa_bits=named["bits"],
          fmt=fmt,
          axis=-1,
        )
        if record == "compact"
        else fp4.QArray(
          packed=named["packed"],
          scales=named["scales"],
          global_scale=named["global_scale"],
          fmt=fmt,
          axis=-1,
        )
      )
  return entries[0], entries[1], recs[0], recs[1]


def reference(k_new, v_new, cache_k, cache_v, index, keep=True, *, record="none"):
  """`write_kv` in plain XLA: `fp4.quantize` per row and dynamic-update-slices."""
  _check(k_new, v_new, cache_k, cache_v, record)
  out, recs = [], []
  for x, entry in ((k_new, cache_k), (v_new, cache_v)):
    q = fp4.quantize(x, entry.fmt, global_group="row")
    blank = fp4.QArray(
      packed=jnp.zeros_like(q.packed),
      scales=jnp.zeros_like(q.scales),
      global_scale=jnp.ones_like(q.global_scale),
      fmt=q.fmt,
      axis=-1,
    )
    new = jax.tree.map(lambda a, z: jnp.where(keep, a, z), q, blank)
    out.append(
      jax.tree.map(
        lambda old, n: jax.lax.dynamic_update_slice_in_dim(old, n.astype(old.dtype), index, 1),
        entry,
        new,
      )
    )
    recs.append(None if record == "none" else q if record == "full" else fp4.compact_guidance(q))
  return out[0], out[1], recs[0], recs[1]
