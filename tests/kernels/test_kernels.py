"""Pallas kernels in interpret mode: parity with their references and with independent
definitions (dequantize-then-compute, the model's attention, `fp4.quantize`), on fresh
random inputs, with outputs poisoned before each call.

Tolerances: the quantized records (codes, block scales, global scales, guidance bits) and
the cache entries are bit-exact (the kernels share `fp4.tiles`' format math with
`fp4.quantize`, and every division is exact). Products are float32 sums of exact bf16
products, in another order than the references' single dot: within 1e-5 relative before
the bf16 output cast, so bf16 outputs match to one bf16 rounding (1e-2 relative).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4, kernels
from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.kernels import (
  decode_attention as decode_attention_lib,
  dispatch,
  probe,
  gemm as gemm_lib,
  kv_write as kv_write_lib,
  layout,
  moe as moe_lib,
  quantize as quantize_lib,
  routing,
)
from trace_jax.model.attention import attend


def _rand(seed, shape, scale=1.0):
  """Normal values with a spread of row magnitudes (exercises scales and subnormals)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  rows = jnp.exp(2.0 * jax.random.normal(k2, (*shape[:-1], 1)))
  return scale * rows * jax.random.normal(k1, shape)


def _close(actual, desired, rtol=1e-2):
  actual, desired = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
  assert not np.isnan(actual).any(), "the kernel left elements unwritten (NaN poison)"
  np.testing.assert_allclose(actual, desired, rtol=rtol, atol=rtol * np.abs(desired).max())


def _equal(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _shared(*ws):
  """Siblings sharing the first one's global scale (as quantize_weight_group makes them)."""
  return [dataclasses.replace(w, global_scale=ws[0].global_scale) for w in ws]


@pytest.mark.parametrize(
  "m, k, n, quantize, w_fmt",
  [
    (1, 64, 48, "nvfp4", "nvfp4"),  # decode: a broadcast product, one row
    (5, 128, 32, None, "mxfp4"),  # W4A16, 8-row tile with 3 padded rows
    (20, 64, 32, "mxfp4", "nvfp4"),  # a tensor-core tile of 32 rows, 12 padded
  ],
)
def test_fp4_gemm_matches_the_definition(m, k, n, quantize, w_fmt):
  """y = q(x) @ dequantize(w), q the per-row quantization (or none), bf16 out."""
  x = _rand(m, (m, k)).astype(jnp.bfloat16)
  w = fp4.quantize(_rand(k + n, (k, n), 0.1), w_fmt, axis=0)
  y, _ = kernels.fp4_gemm(x, w, quantize=quantize, poison=True)
  assert y.shape == (m, n) and y.dtype == jnp.bfloat16
  xv = fp4.fake_quant(x.astype(jnp.float32), quantize, global_group="row") if quantize else x
  _close(y, jnp.dot(xv.astype(jnp.float32), fp4.dequantize(w), precision="highest"))
  _close(y, gemm_lib.reference(x, w, quantize=quantize)[0])


@pytest.mark.parametrize("record, m", [("compact", 3), ("full", 17)])
def test_fp4_gemm_records_the_rollouts_quantization_bit_for_bit(record, m):
  """The prologue's record (what guidance stores) is `fp4.quantize` of x per row, ties,
  zero rows, non-finite rows and padded rows included; a split K writes each part."""
  x = _rand(7, (m, 256)).astype(jnp.bfloat16)
  x = x.at[0].set(0.0).at[1, 5].set(jnp.nan).at[2, 9].set(-jnp.inf)
  w = fp4.quantize(_rand(8, (256, 32), 0.1), axis=0)
  y, got = kernels.fp4_gemm(x, w, quantize="nvfp4", record=record, k_splits=2, poison=True)
  q = fp4.quantize(x, "nvfp4", global_group="row")
  _equal(got, q if record == "full" else fp4.compact_guidance(q))
  assert np.isnan(np.asarray(y[1:3], np.float32)).all()  # NaN rows stay visible
  assert np.isfinite(np.asarray(y[3:], np.float32)).all() and not np.asarray(y[0]).any()


def test_fused_siblings_equal_the_separate_gemms():
  """q|k|v side by side and gate|up interleaved (SwiGLU) read the same bytes: the fused
  GEMM gives the per-matrix GEMMs' outputs, and `parts()` gives the matrices back."""
  x = _rand(1, (3, 64)).astype(jnp.bfloat16)
  qkv = _shared(
    *(fp4.quantize(_rand(s, (64, n), 0.1), axis=0) for s, n in ((2, 32), (3, 16), (4, 16)))
  )
  fused = layout.fuse(qkv)
  _equal(fused.parts(), qkv)
  y, _ = kernels.fp4_gemm(x, fused, quantize="nvfp4", poison=True)
  separate = [kernels.fp4_gemm(x, w, quantize="nvfp4")[0] for w in qkv]
  _close(y, jnp.concatenate(separate, axis=1), rtol=1e-6)
  gate, up = qkv[1:]
  pair = layout.fuse([gate, up], tile=8)
  _equal(pair.parts(), [gate, up])
  h, _ = kernels.fp4_gemm(x, pair, quantize="nvfp4", poison=True)
  g, u = (s.astype(jnp.float32) for s in separate[1:])
  _close(h, jax.nn.silu(g) * u)


def test_route_tiles_hold_every_row_once_without_a_sort():
  experts = jax.random.randint(jax.random.key(0), (9, 3), 0, 5)
  for block_m in (1, 2, 4):
    tiles = routing.route_tiles(experts, 5, block_m)
    rows = np.asarray(tiles.tile_rows)
    owner = np.asarray(tiles.tile_expert)
    flat = np.asarray(experts).reshape(-1)
    assert sorted(rows[rows >= 0].tolist()) == list(range(27))  # each row exactly once
    for t in range(tiles.num_tiles):
      mine = rows[t][rows[t] >= 0]
      assert (flat[mine] == owner[t]).all() and (np.diff(mine) > 0).all()
      assert (owner[t] >= 0) == (mine.size > 0)
    position = np.asarray(tiles.row_position)
    assert (rows.reshape(-1)[position] == np.arange(27)).all()
  jaxpr = jax.make_jaxpr(lambda e: routing.route_tiles(e, 5, 4))(experts)
  primitives = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
  assert not primitives & {"sort", "while", "cond"}, primitives


@pytest.mark.parametrize("block_m", [1, 4])
def test_moe_experts_match_the_dequantized_experts(block_m):
  """Two expert-major grouped GEMMs (gate|up with SwiGLU, down) against each routed row
  times its expert's dequantized weights; records of moe_in per token and of moe_mid per
  (token, slot) row equal `fp4.quantize` of those activations. An expert no row chose (4)
  is skipped."""
  n, k, d, f, e = 5, 2, 64, 32, 5
  x = _rand(10, (n, d)).astype(jnp.bfloat16)
  experts = jax.random.randint(jax.random.key(11), (n, k), 0, 4)  # expert 4 unused
  w_gate, w_up = _shared(
    *(fp4.quantize(_rand(s, (e, d, f), 0.1), axis=1, global_group=0) for s in (12, 13))
  )
  w_down = fp4.quantize(_rand(14, (e, f, d), 0.1), axis=1, global_group=0)
  y, h, rec_in, rec_mid = kernels.moe_experts(
    x, experts, (w_gate, w_up), w_down, quantize_in="nvfp4", quantize_mid="nvfp4",
    record="compact", poison=True, block_m=block_m,
  )  # fmt: skip
  y_ref, h_ref = moe_lib.reference(
    x, experts, w_gate, w_up, w_down, quantize_in="nvfp4", quantize_mid="nvfp4"
  )
  _close(h, h_ref)
  _close(y, y_ref)
  _equal(rec_in, fp4.compact_guidance(fp4.quantize(x, global_group="row")))
  _equal(rec_mid, fp4.compact_guidance(fp4.quantize(h, global_group="row")))
  # The definition, row by row.
  xq = fp4.fake_quant(x.astype(jnp.float32), global_group="row")
  wg, wu, wd = (fp4.dequantize(w) for w in (w_gate, w_up, w_down))
  for t in range(n):
    for s in range(k):
      ex = int(experts[t, s])
      gate = (xq[t] @ wg[ex]).astype(jnp.bfloat16).astype(jnp.float32)
      up = (xq[t] @ wu[ex]).astype(jnp.bfloat16).astype(jnp.float32)
      _close(h[t, s], jax.nn.silu(gate) * up)


def _cache_entry(seed, shape):
  return fp4.quantize(_rand(seed, shape), "nvfp4", global_group="row")


@pytest.mark.parametrize(
  "b, length, hkv, groups, lengths, chunk, splits",
  [
    (3, 41, 2, 2, [7, 41, 23], 16, None),  # odd L: the last chunk holds one slot
    (1, 33, 1, 4, [33], 16, 3),  # batch 1, one KV head: splits fill the GPU
    (2, 17, 2, 1, [17, 9], 16, 2),
  ],
)
def test_decode_attention_any_length(b, length, hkv, groups, lengths, chunk, splits):
  dh = 32
  q = _rand(groups, (b, hkv * groups, dh))
  k, v = _cache_entry(10 + b, (b, length, hkv, dh)), _cache_entry(20 + b, (b, length, hkv, dh))
  lengths = jnp.array(lengths)
  valid = jax.random.bernoulli(jax.random.key(b), 0.7, (b, length)).at[:, 0].set(True)
  out = kernels.fp4_decode_attention(
    q, k, v, lengths, valid, poison=True, chunk=chunk, splits=splits
  )
  _close(out, decode_attention_lib.reference(q, k, v, lengths, valid), rtol=1e-5)
  # The definition: the model's attention over the dequantized cache.
  keep = (jnp.arange(length)[None] < lengths[:, None]) & valid
  expected = attend(q[:, None], fp4.dequantize(k), fp4.dequantize(v), keep[:, None])
  _close(out, expected[:, 0], rtol=1e-5)


def test_attention_splits_fill_the_gpu_at_real_geometry():
  """At Qwen3-30B-A3B's 4 KV heads, an odd cache (context + 1) of any size gets at least
  two programs per SM of an H200 (132 SMs), each a run of whole chunks (128 slots, fewer
  for a short cache at batch 1)."""
  for b, length in ((1, 32769), (32, 32769), (128, 4097), (1, 4097), (8, 131073)):
    chunk = decode_attention_lib.default_chunk(length, b, 4)
    splits, per_split = decode_attention_lib.num_splits(b, 4, length, chunk)
    chunks = -(-length // chunk)
    assert b * 4 * splits >= 264, (b, length, chunk, splits)
    assert (splits - 1) * per_split < chunks <= splits * per_split
    assert chunk == (32 if (b, length) == (1, 4097) else 128)
  assert decode_attention_lib.num_splits(1, 4, 300, 128) == (3, 1)  # short: one chunk each


def test_decode_attention_without_valid_slots_gives_zero():
  q = _rand(0, (2, 4, 16))
  k, v = _cache_entry(1, (2, 16, 2, 16)), _cache_entry(2, (2, 16, 2, 16))
  out = kernels.fp4_decode_attention(q, k, v, jnp.array([0, 16]), poison=True, chunk=8, splits=2)
  assert not np.asarray(out[0]).any()
  _close(out, decode_attention_lib.reference(q, k, v, jnp.array([0, 16])), rtol=1e-5)


def test_decode_attention_of_one_slot_is_its_value_at_any_score():
  """Over one valid slot the softmax is 1 at any score, so the output is that slot's
  dequantized value (hand derivation), however negative the score: the reference shifted
  by a maximum that took 0 from the masked slots, so a score far below 0 underflowed to an
  output of 0. Fresh inputs; the scores scaled to about -1e3 and +1e3."""
  rng = np.random.default_rng()
  seed = int(rng.integers(1 << 20))
  b, length, hkv, dh = 2, 8, 2, 32
  k, v = _cache_entry(seed, (b, length, hkv, dh)), _cache_entry(seed + 1, (b, length, hkv, dh))
  keys = fp4.block_scaled_values(k) / k.global_scale
  values = fp4.block_scaled_values(v) / v.global_scale
  lengths = jnp.array([1, 1])
  for sign in (-1.0, 1.0):
    # each query head along its KV head's first key, sized for a score of sign * 1e3
    first = jnp.repeat(keys[:, 0], 2, axis=1)  # [b, 2 * hkv, dh]
    norm = jnp.sum(first * first, -1, keepdims=True)
    q = sign * 1e3 * dh**0.5 * first / norm
    want = jnp.repeat(values[:, 0], 2, axis=1)
    got = decode_attention_lib.reference(q, k, v, lengths)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"seed {seed}")
    _close(kernels.fp4_decode_attention(q, k, v, lengths), want, rtol=1e-5)


def _poison_slots(entry, masked):
  """`entry` with NaN global scales and NaN E4M3 block scales (0x7F) in the `masked` slots."""
  nan_scale = jnp.where(masked[:, :, None, None], jnp.nan, entry.global_scale)
  nan_bits = jnp.where(masked[:, :, None, None], jnp.uint8(0x7F), entry.scales)
  return dataclasses.replace(entry, global_scale=nan_scale, scales=nan_bits)


def test_decode_attention_nan_in_masked_slots_does_not_leak():
  """A NaN left in a slot that is masked (past the length, or not valid) must not reach the
  output through 0 * NaN or p / NaN; NaN in an attended slot stays visible."""
  b, length, hkv, dh = 2, 32, 2, 32
  q = _rand(7, (b, 2 * hkv, dh))
  k, v = _cache_entry(8, (b, length, hkv, dh)), _cache_entry(9, (b, length, hkv, dh))
  lengths = jnp.array([21, 32])
  valid = jax.random.bernoulli(jax.random.key(3), 0.7, (b, length)).at[:, 0].set(True)
  masked = ~((jnp.arange(length)[None] < lengths[:, None]) & valid)
  assert masked.any()
  clean = decode_attention_lib.reference(q, k, v, lengths, valid)
  k_nan, v_nan = _poison_slots(k, masked), _poison_slots(v, masked)
  out = kernels.fp4_decode_attention(q, k_nan, v_nan, lengths, valid, poison=True, chunk=16)
  _close(out, clean, rtol=1e-5)
  attended = jnp.zeros_like(masked).at[0, 0].set(True)
  out = kernels.fp4_decode_attention(q, k, _poison_slots(v, attended), lengths, valid, chunk=16)
  assert np.isnan(np.asarray(out[0])).all() and np.isfinite(np.asarray(out[1])).all()


@pytest.mark.parametrize(
  "record, keep, t", [("compact", True, 1), ("full", True, 3), ("none", False, 1)]
)
def test_write_kv_is_fp4_quantize_in_place(record, keep, t):
  """Entries and records bit for bit `fp4.quantize` per (token, KV head) row (NaN rows
  included); a chunk of padding only (keep False) writes blank slots."""
  b, length, hkv, dh = 2, 9, 3, 32
  cache_k, cache_v = _cache_entry(1, (b, length, hkv, dh)), _cache_entry(2, (b, length, hkv, dh))
  k = _rand(3, (b, t, hkv, dh)).astype(jnp.bfloat16).at[0, 0, 1, 3].set(jnp.nan)
  v = _rand(4, (b, t, hkv, dh)).astype(jnp.bfloat16)
  got = kernels.write_kv(k, v, cache_k, cache_v, 4, keep, record=record, poison=True)
  _equal(got, kv_write_lib.reference(k, v, cache_k, cache_v, 4, keep, record=record))
  written = got[0].global_scale[:, 4 : 4 + t]
  if keep:
    np.testing.assert_array_equal(written, fp4.quantize(k, global_group="row").global_scale)
  else:
    assert (np.asarray(written) == 1).all() and not np.asarray(got[0].packed[:, 4]).any()
  _equal([a[:, :4] for a in jax.tree.leaves(got[0])], [a[:, :4] for a in jax.tree.leaves(cache_k)])


@pytest.mark.parametrize("fmt, dtype", [("nvfp4", jnp.bfloat16), ("mxfp4", jnp.float32)])
def test_fused_quantize_is_bit_exact(fmt, dtype):
  x = _rand(5, (3, 11, 64)).astype(dtype)
  x = x.at[0, 0].set(0.0).at[1, 2, 5].set(jnp.nan).at[2, 3, 7].set(1e-30)
  q, bits = kernels.fused_quantize(x, fmt, poison=True)
  ref, ref_bits = quantize_lib.reference(x, fmt)
  _equal((q, bits), (ref, ref_bits))
  assert np.isnan(np.asarray(q.global_scale[1, 2])).all()  # NaN stays visible


def test_bad_input_names_what_is_wrong():
  w = fp4.quantize(_rand(0, (64, 32)), "nvfp4", axis=0)
  with pytest.raises(ValueError, match="K=48 but w has K=64"):
    kernels.fp4_gemm(jnp.ones((2, 48)), w)
  with pytest.raises(ValueError, match="fp4.QArray along K"):
    kernels.fp4_gemm(jnp.ones((2, 64)), jnp.ones((64, 32)))
  with pytest.raises(ValueError, match="record needs quantize"):
    kernels.fp4_gemm(jnp.ones((2, 64)), w, record="compact")
  with pytest.raises(ValueError, match="k_splits=3"):
    kernels.fp4_gemm(jnp.ones((2, 64)), w, k_splits=3)
  with pytest.raises(ValueError, match="tile=8 interleaves two siblings"):
    layout.fuse([w, w, w], tile=8)
  with pytest.raises(ValueError, match="splits=9"):
    cache = _cache_entry(0, (1, 16, 1, 16))
    kernels.fp4_decode_attention(jnp.ones((1, 1, 16)), cache, cache, jnp.array([4]), splits=9)
  with pytest.raises(ValueError, match="multiple of 16"):
    kernels.fused_quantize(jnp.ones((2, 40)))
  with pytest.raises(ValueError, match="kernels='cuda'"):
    kernels.resolve("cuda")
  with pytest.raises(ValueError, match="kernels"):
    R.RolloutConfig(kernels="triton")
  assert kernels.resolve("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")


def test_tie_oracle_flips_under_a_reciprocal_and_not_on_the_xla_path():
  """The probe's oracle has teeth (a reciprocal multiply rounds hundreds of its exact ties
  the other way), and XLA's own quantization matches the host's bit for bit."""
  from trace_jax.fp4 import ties  # noqa: PLC0415

  x = ties.tie_rows(rows=32)
  codes, scale_bits, gs, values = ties.host_quantize(x, "nvfp4")
  steps = np.asarray(fp4.e4m3_decode(jnp.asarray(scale_bits))) / gs  # [rows, blocks]
  xf = np.asarray(x, np.float32).reshape(len(x), -1, 16)
  reciprocal = ties.host_codes(xf * (np.float32(1) / steps)[..., None])
  assert (reciprocal.reshape(codes.shape) != codes).sum() > 100
  q = fp4.quantize(jnp.asarray(x), global_group="row")
  packed, bits = ties.pack_host(codes)
  _equal((q.packed, q.scales, q.global_scale, fp4.mantissa_bits(q)), (packed, scale_bits, gs, bits))
  np.testing.assert_array_equal(fp4.dequantize(q), values)


@pytest.mark.slow  # ~2 min in interpret mode: every kernel that quantizes, on the oracle
def test_probe_passes_here_and_names_the_path_and_field_that_differ(monkeypatch):
  """Every path is bit-equal on the tie oracle in interpret mode; one flipped guidance bit
  in one kernel fails the probe, and the reason (which "auto" records) says where."""
  verdicts = probe.tie_oracle(True, rows=4)
  assert verdicts and not any(verdicts.values()), verdicts
  original = quantize_lib.quantize

  def off_by_one_bit(x, fmt="nvfp4", **kw):
    q, bits = original(x, fmt, **kw)
    return q, bits.at[0, 0].set(bits[0, 0] ^ 1)

  monkeypatch.setattr(quantize_lib, "quantize", off_by_one_bit)
  verdicts = probe.tie_oracle(True, rows=4)
  assert verdicts["pallas quantize (nvfp4)"] == "bits (1 differ)"
  probe.probe_failure.cache_clear()
  try:
    reason = probe.probe_failure(True)
  finally:
    probe.probe_failure.cache_clear()
  assert "pallas quantize (nvfp4): bits (1 differ)" in reason


def test_probe_refuses_to_run_inside_a_trace_and_caches_nothing_there(monkeypatch):
  """`kernels="auto"` on a GPU first checks the kernels, eagerly: it is resolved outside
  jit. Asked inside a trace, the probe refuses (instead of caching a bogus failure), and
  the next eager call still runs it."""
  seen = []  # float() of a computed value fails inside a trace: the probe must be eager
  monkeypatch.setattr(probe, "_probe", lambda interpret: seen.append(float(jnp.ones(()) + 1)))
  probe.probe_failure.cache_clear()
  try:
    with pytest.raises(RuntimeError, match="outside jit"):
      jax.jit(lambda x: x * probe.probe(True))(1.0)
    assert seen == []
    assert probe.probe(True) and probe.probe(True)
  finally:
    probe.probe_failure.cache_clear()
  assert seen == [2.0]


def test_auto_is_resolved_once_where_the_rollout_is_set_up():
  """The engine resolves `kernels="auto"` and its model calls carry the result; a model
  call never sees "auto" (`CallOptions` refuses it, so nothing resolves it inside a trace)."""
  cfg = M.tiny(num_layers=1)
  policy = M.Transformer(cfg, rngs=nnx.Rngs(0))
  engine = R.RolloutEngine(policy, R.RolloutConfig(kernels="auto", max_len=16))
  assert engine.kernels in kernels.IMPLEMENTATIONS
  assert engine.statics.options.kernels == engine.kernels
  with pytest.raises(ValueError, match="CallOptions.kernels='auto'"):
    M.CallOptions(kernels="auto")


def test_kernels_on_a_layer_stack_touch_only_that_layer():
  """With `layer=` (traced, as in a scan over layers) the cache is the stack of every
  layer's entries [N, B, L, Hkv, ...]: write_kv writes that layer's slots and nothing else,
  and decode attention reads that layer, each exactly the kernel on the layer's own entry."""
  n, b, length, hkv, dh = 3, 2, 9, 2, 32
  rng = np.random.default_rng()
  seed = int(rng.integers(1 << 20))
  stack_k, stack_v = (_cache_entry(seed + i, (n, b, length, hkv, dh)) for i in (0, 1))
  k, v = (_rand(seed + i, (b, 1, hkv, dh)).astype(jnp.bfloat16) for i in (2, 3))
  q = _rand(seed + 4, (b, 2 * hkv, dh))
  layer, index = int(rng.integers(n)), int(rng.integers(length))
  entry = lambda stack, i: jax.tree.map(lambda a: a[i], stack)  # noqa: E731

  @jax.jit
  def on_stack(stack_k, stack_v, layer):
    sk, sv, rk, rv = kernels.write_kv(k, v, stack_k, stack_v, index, layer=layer, record="full")
    lengths = jnp.full((b,), index + 1)
    return sk, sv, rk, rv, kernels.fp4_decode_attention(q, sk, sv, lengths, layer=layer)

  sk, sv, rk, rv, out = on_stack(stack_k, stack_v, layer)
  ek, ev, ek_rec, ev_rec = kernels.write_kv(
    k, v, entry(stack_k, layer), entry(stack_v, layer), index, record="full"
  )
  _equal((entry(sk, layer), entry(sv, layer), rk, rv), (ek, ev, ek_rec, ev_rec))
  for other in set(range(n)) - {layer}:
    _equal((entry(sk, other), entry(sv, other)), (entry(stack_k, other), entry(stack_v, other)))
  lengths = jnp.full((b,), index + 1)
  _equal(out, kernels.fp4_decode_attention(q, ek, ev, lengths))
  _close(out, decode_attention_lib.reference(q, ek, ev, lengths), rtol=1e-5)


@pytest.mark.slow  # ~2 min: a whole generation with every kernel in interpret mode
def test_generation_with_pallas_kernels_equals_the_xla_path():
  """A whole tiny-model FP4 generation (prefill and decode, FP4 cache, compact guidance)
  with every kernel in interpret mode gives the XLA path's tokens and log-probabilities
  (float32 compute: the two differ only in summation order), and on each path every
  guidance record is, bit for bit, the FP4 of the site input that path quantized.

  What is bit-equal by construction is compared bit for bit: a record against `fp4` of
  its own input (the kernels share `fp4.tiles`' format math, and `fp4`'s functions round
  once per operation, so their bits do not depend on the CPU). The two paths' inputs
  differ in summation order after the attention kernel, by float32 rounding that depends
  on the CPU's code generation (vector width, FMA contraction); across paths they are
  compared within float32 tolerance, never their codes: FP4 rounding turns an ulp at a
  rounding boundary into a grid step (equal on an AMD EPYC, not on an Intel Xeon)."""
  policy = M.Transformer(M.tiny(), rngs=nnx.Rngs(3))
  prompts = [[5, 17, 3], [9, 2, 44, 7, 61, 8, 30], [100]]
  results = {}
  for mode in ("xla", "pallas"):
    config = R.RolloutConfig(
      precision="fp4",
      compute_dtype="float32",
      guidance="compact",
      guided_layers="all",
      max_len=16,
      prompt_bucket=8,
      kernels=mode,
      sampling=R.SamplingConfig(greedy=True, max_new_tokens=5),
    )
    engine = R.RolloutEngine(policy, config, capture_inputs=True)
    assert engine.kernels == mode
    results[mode] = engine.generate(prompts, jax.random.key(0))
  xla_run, pallas_run = results["xla"], results["pallas"]
  np.testing.assert_array_equal(np.asarray(pallas_run.tokens), np.asarray(xla_run.tokens))
  np.testing.assert_allclose(
    np.asarray(pallas_run.logprobs), np.asarray(xla_run.logprobs), atol=1e-4
  )
  mask = np.asarray(xla_run.mask)
  assert mask[:, 8:].any()  # decode steps were recorded
  assert set(pallas_run.guidance.sites) == set(xla_run.guidance.sites)
  for mode, run in results.items():
    for key, record in run.guidance.sites.items():
      want = fp4.compact_guidance(fp4.quantize(run.site_inputs[key], global_group="row"))
      for field in ("mantissa_bits", "scales", "global_scale"):
        got, expected = (np.asarray(getattr(r, field))[mask] for r in (record, want))
        np.testing.assert_array_equal(
          got.view(np.uint8), expected.view(np.uint8), err_msg=f"{mode} {key} {field}"
        )
  for key, x in xla_run.site_inputs.items():
    x, y = np.asarray(x)[mask], np.asarray(pallas_run.site_inputs[key])[mask]
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5 * np.abs(x).max(), err_msg=str(key))


@pytest.mark.slow
def test_bench_kernels_smoke_runs():
  import os
  import subprocess
  import sys

  script = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "bench_kernels.py")
  result = subprocess.run(
    [sys.executable, script, "--smoke", "--batches=1", "--repeats=1"],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  for kernel in ("fp4_gemm", "moe_experts", "decode_attention", "quantize"):
    assert f"| {kernel} | 1 | pallas" in result.stdout


def test_auto_probe_failure_on_a_gpu_prints_one_line(monkeypatch, capsys):
  """On a GPU backend a failing probe makes "auto" run XLA and says so in one printed line,
  once per process (however many engines resolve "auto"), besides the reason runs record."""

  def failing(interpret):
    raise RuntimeError("Triton lowering\nfailed here")

  monkeypatch.setattr(probe, "_probe", failing)
  monkeypatch.setattr(probe, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  probe.probe_failure.cache_clear()
  try:
    first = dispatch.resolve_with_reason("auto")
    again = dispatch.resolve_with_reason("auto")
  finally:
    probe.probe_failure.cache_clear()
  assert first == again == ("xla", "auto: probe failed: RuntimeError: Triton lowering\nfailed here")
  assert capsys.readouterr().out.splitlines() == [
    "kernels: auto probe failed (RuntimeError: Triton lowering failed here), using xla"
  ]


def test_auto_probe_failure_off_a_gpu_prints_nothing(monkeypatch, capsys):
  """Off a GPU "auto" takes XLA without probing, and a probe asked directly (interpret
  mode, tests) that fails prints nothing: only a GPU run has lost kernels."""

  def failing(interpret):
    raise RuntimeError("no kernels")

  monkeypatch.setattr(probe, "_probe", failing)
  monkeypatch.setattr(probe, "on_gpu", lambda: False)
  monkeypatch.setattr(dispatch, "on_gpu", lambda: False)
  probe.probe_failure.cache_clear()
  try:
    assert dispatch.resolve_with_reason("auto")[0] == "xla"
    assert probe.probe_failure(True) == "RuntimeError: no kernels"
  finally:
    probe.probe_failure.cache_clear()
  assert capsys.readouterr().out == ""
