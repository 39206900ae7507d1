"""Pallas kernels in interpret mode: parity with their references and with independent
definitions (dequantize-then-compute, `jax.lax.ragged_dot`, the model's attention,
`fp4.quantize`), on fresh random inputs, with outputs poisoned before each call."""

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
  decode_attention_lib,
  dispatch,
  fp4_matmul_lib,
  moe_gmm_lib,
  quantize_lib,
)
from trace_jax.model.attention import attend


def _rand(seed, shape, scale=1.0):
  """Normal values with a spread of row magnitudes (exercises scales and subnormals)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  rows = jnp.exp(2.0 * jax.random.normal(k2, (*shape[:-1], 1)))
  return scale * rows * jax.random.normal(k1, shape)


def _close(actual, desired, rtol=1e-5):
  actual, desired = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
  assert not np.isnan(actual).any(), "the kernel left elements unwritten (NaN poison)"
  np.testing.assert_allclose(actual, desired, rtol=rtol, atol=rtol * np.abs(desired).max())


@pytest.mark.parametrize(
  "m, k, n, fmt", [(1, 64, 48, "nvfp4"), (5, 128, 32, "nvfp4"), (33, 64, 16, "mxfp4")]
)
def test_fp4_matmul_w4a16_matches_reference_and_dequantized_dot(m, k, n, fmt):
  x = _rand(m, (m, k))
  w = fp4.quantize(_rand(k + n, (k, n), 0.1), fmt, axis=0)
  y = kernels.fp4_matmul(x, w, poison=True)
  _close(y, fp4_matmul_lib.reference(x, w))
  _close(y, x @ fp4.dequantize(w))  # the definition: dequantize, then dot


def test_fp4_matmul_w4a4_and_bf16_inputs():
  x = _rand(3, (2, 3, 64))  # leading batch axes
  w = fp4.quantize(_rand(4, (64, 32), 0.1), "nvfp4", axis=0)
  xq = fp4.quantize(x, "nvfp4", global_group="row")
  y = kernels.fp4_matmul(xq, w, poison=True)
  assert y.shape == (2, 3, 32)
  _close(y, fp4_matmul_lib.reference(xq, w))
  _close(y, fp4.dequantize(xq) @ fp4.dequantize(w))
  # bf16 activations: c * s_b is exact in bf16, so only the accumulation order differs.
  xb = x.astype(jnp.bfloat16)
  _close(kernels.fp4_matmul(xb, w, poison=True), fp4_matmul_lib.reference(xb, w), rtol=1e-5)
  assert kernels.fp4_matmul(xb, w, out_dtype=jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("sizes", [(3, 0, 20, 0, 7), (0, 0, 16, 0, 0), (1, 2, 3, 4, 5)])
def test_moe_gmm_ragged_groups_including_empty(sizes):
  sizes = jnp.array(sizes, jnp.int32)
  rows, k, n = 36, 64, 48  # rows past sum(sizes) must come out 0
  lhs = _rand(int(sizes.sum()), (rows, k))
  w = fp4.quantize(_rand(7, (5, k, n), 0.1), "nvfp4", axis=1, global_group=0)
  y = kernels.moe_gmm(lhs, w, sizes, poison=True, block_m=16)
  _close(y, moe_gmm_lib.reference(lhs, w, sizes))
  _close(y, jax.lax.ragged_dot(lhs, fp4.dequantize(w), sizes, precision=jax.lax.Precision.HIGHEST))
  assert not np.asarray(y[int(sizes.sum()) :]).any()


def test_split_k_partial_sums_match_the_references(k_splits=4):
  """K split over programs (the decode default on a GPU): float32 partial sums, added and
  scaled after the kernel, give the same products."""
  x = _rand(11, (5, 256))
  w = fp4.quantize(_rand(12, (256, 32), 0.1), "mxfp4", axis=0)
  xq = fp4.quantize(x, "nvfp4", global_group="row")
  for xx in (x, xq):
    y = kernels.fp4_matmul(xx, w, poison=True, block_k=64, k_splits=k_splits)
    _close(y, fp4_matmul_lib.reference(xx, w))
  sizes = jnp.array([3, 0, 9, 4], jnp.int32)
  we = fp4.quantize(_rand(13, (4, 256, 16), 0.1), "nvfp4", axis=1, global_group=0)
  y = kernels.moe_gmm(x.repeat(4, 0), we, sizes, poison=True, block_k=64, k_splits=k_splits)
  _close(y, moe_gmm_lib.reference(x.repeat(4, 0), we, sizes))
  assert not np.asarray(y[16:]).any()
  with pytest.raises(ValueError, match="k_splits=3"):
    kernels.fp4_matmul(x, w, block_k=64, k_splits=3)


def _cache_entry(seed, shape):
  return fp4.quantize(_rand(seed, shape), "nvfp4", global_group="row")


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_decode_attention_gqa_lengths_and_masks(groups):
  b, length, hkv, dh = 3, 40, 2, 32
  q = _rand(groups, (b, hkv * groups, dh))
  k, v = _cache_entry(10 + groups, (b, length, hkv, dh)), _cache_entry(20, (b, length, hkv, dh))
  lengths = jnp.array([7, 40, 23])  # odd lengths, one full
  valid = jax.random.bernoulli(jax.random.key(groups), 0.7, (b, length)).at[:, 0].set(True)
  out = kernels.decode_attention(q, k, v, lengths, valid, poison=True, num_splits=5, chunk=8)
  _close(out, decode_attention_lib.reference(q, k, v, lengths, valid))
  # The definition: the model's attention over the dequantized cache.
  keep = (jnp.arange(length)[None] < lengths[:, None]) & valid
  expected = attend(q[:, None], fp4.dequantize(k), fp4.dequantize(v), keep[:, None])
  _close(out, expected[:, 0])


def test_decode_attention_without_valid_slots_gives_zero():
  q = _rand(0, (2, 4, 16))
  k, v = _cache_entry(1, (2, 16, 2, 16)), _cache_entry(2, (2, 16, 2, 16))
  out = kernels.decode_attention(q, k, v, jnp.array([0, 16]), poison=True, num_splits=2)
  assert not np.asarray(out[0]).any()
  _close(out, decode_attention_lib.reference(q, k, v, jnp.array([0, 16])))


def _poison_slots(entry, masked):
  """`entry` with NaN global scales and NaN E4M3 block scales (0x7F) in the `masked` slots."""
  nan_scale = jnp.where(masked[:, :, None, None], jnp.nan, entry.global_scale)
  nan_bits = jnp.where(masked[:, :, None, None], jnp.uint8(0x7F), entry.scales)
  return dataclasses.replace(entry, global_scale=nan_scale, scales=nan_bits)


def test_decode_attention_nan_in_masked_slots_does_not_leak():
  """A NaN left in a slot that is masked (past the length, or not valid) must not reach the
  output through 0 * NaN or p / NaN, in the kernel or in its reference; the output equals
  the one with those slots holding ordinary values."""
  b, length, hkv, dh = 2, 32, 2, 32
  q = _rand(7, (b, 2 * hkv, dh))
  k, v = _cache_entry(8, (b, length, hkv, dh)), _cache_entry(9, (b, length, hkv, dh))
  lengths = jnp.array([21, 32])
  valid = jax.random.bernoulli(jax.random.key(3), 0.7, (b, length)).at[:, 0].set(True)
  masked = ~((jnp.arange(length)[None] < lengths[:, None]) & valid)
  assert masked.any()
  clean = decode_attention_lib.reference(q, k, v, lengths, valid)
  k_nan, v_nan = _poison_slots(k, masked), _poison_slots(v, masked)
  out = kernels.decode_attention(
    q, k_nan, v_nan, lengths, valid, poison=True, num_splits=2, chunk=8
  )
  _close(out, clean)
  _close(decode_attention_lib.reference(q, k_nan, v_nan, lengths, valid), clean)
  # NaN in an attended slot stays visible.
  attended = jnp.zeros_like(masked).at[0, 0].set(True)
  out = kernels.decode_attention(
    q, k, _poison_slots(v, attended), lengths, valid, num_splits=2, chunk=8
  )
  assert np.isnan(np.asarray(out[0])).all() and np.isfinite(np.asarray(out[1])).all()


@pytest.mark.parametrize(
  "fmt, dtype", [("nvfp4", jnp.float32), ("nvfp4", jnp.bfloat16), ("mxfp4", jnp.float32)]
)
def test_fused_quantize_is_bit_exact(fmt, dtype):
  x = _rand(5, (3, 11, 64)).astype(dtype)
  x = x.at[0, 0].set(0.0).at[1, 2, 5].set(jnp.nan).at[2, 3, 7].set(1e-30)
  q, bits = kernels.quantize(x, fmt, poison=True)
  ref, ref_bits = quantize_lib.reference(x, fmt)
  for got, want in zip(jax.tree.leaves((q, bits)), jax.tree.leaves((ref, ref_bits))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert np.isnan(np.asarray(q.global_scale[1, 2])).all()  # NaN stays visible
  np.testing.assert_array_equal(np.asarray(bits), np.asarray(fp4.mantissa_bits(ref)))


def test_bad_input_names_what_is_wrong():
  w = fp4.quantize(_rand(0, (64, 32)), "nvfp4", axis=0)
  with pytest.raises(ValueError, match="K=48 but w has K=64"):
    kernels.fp4_matmul(jnp.ones((2, 48)), w)
  with pytest.raises(ValueError, match="2-D fp4.QArray"):
    kernels.fp4_matmul(jnp.ones((2, 64)), jnp.ones((64, 32)))
  with pytest.raises(ValueError, match="group_sizes must be"):
    kernels.moe_gmm(
      jnp.ones((4, 64)),
      fp4.quantize(jnp.ones((3, 64, 16)), axis=1, global_group=0),
      jnp.ones((2,), jnp.int32),
    )
  with pytest.raises(ValueError, match="multiple of 16"):
    kernels.quantize(jnp.ones((2, 40)))
  with pytest.raises(ValueError, match="kernels='cuda'"):
    kernels.resolve("cuda")
  with pytest.raises(ValueError, match="kernels"):
    R.RolloutConfig(kernels="triton")
  assert kernels.resolve("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")


@pytest.mark.slow  # ~1 min; each kernel is checked against its reference() in the default suite
def test_generation_with_pallas_kernels_equals_the_xla_path(monkeypatch):
  """A whole tiny-model FP4 generation (prefill and decode, FP4 cache) with every kernel in
  interpret mode gives the XLA path's tokens and log-probabilities (float32 compute: the
  two differ only in summation order)."""
  calls = {name: 0 for name in ("fp4_matmul", "moe_gmm", "decode_attention", "quantize")}
  for name in calls:
    original = getattr(kernels, name)

    def counted(*args, _original=original, _name=name, **kw):
      calls[_name] += 1
      return _original(*args, **kw)

    monkeypatch.setattr(kernels, name, counted)
  policy = M.Transformer(M.tiny(), rngs=nnx.Rngs(3))
  prompts = [[5, 17, 3], [9, 2, 44, 7, 61, 8, 30], [100]]
  results = {}
  for mode in ("xla", "pallas"):
    config = R.RolloutConfig(
      precision="fp4",
      compute_dtype="float32",
      guidance="none",
      max_len=16,
      prompt_bucket=8,
      kernels=mode,
      sampling=R.SamplingConfig(greedy=True, max_new_tokens=5),
    )
    results[mode] = R.RolloutEngine(policy, config).generate(prompts, jax.random.key(0))
  assert all(calls.values()), calls  # every kernel ran in the pallas generation
  xla_run, pallas_run = results["xla"], results["pallas"]
  np.testing.assert_array_equal(np.asarray(pallas_run.tokens), np.asarray(xla_run.tokens))
  np.testing.assert_array_equal(
    np.asarray(pallas_run.response_mask), np.asarray(xla_run.response_mask)
  )
  np.testing.assert_allclose(
    np.asarray(pallas_run.logprobs), np.asarray(xla_run.logprobs), atol=1e-4
  )


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
  for kernel in ("fp4_matmul", "moe_gmm", "decode_attention", "quantize"):
    assert f"| {kernel} | 1 | pallas" in result.stdout


def test_auto_probe_checks_every_kernel_even_when_first_asked_inside_a_trace():
  """`kernels="auto"` on a GPU first checks that the kernels compile and agree with their
  references (else it falls back to XLA with a warning); the check must run eagerly even
  when it is first needed while the model is being traced."""
  dispatch.probe_failure.cache_clear()
  assert jax.jit(lambda x: x * dispatch.probe(True))(1.0) == 1.0


def test_probe_failure_names_the_kernel_and_the_differing_field(monkeypatch):
  """The probe holds the fused quantize to bit-exactness: one flipped guidance bit is a
  failure, and its reason (which `resolve_with_reason` and the run records) says where."""

  def off_by_one_bit(x, fmt="nvfp4", **kw):
    q, bits = quantize_lib.reference(x, fmt)
    return q, bits.at[0, 0].set(bits[0, 0] ^ 1)

  monkeypatch.setattr(quantize_lib, "quantize", off_by_one_bit)
  dispatch.probe_failure.cache_clear()
  try:
    reason = dispatch.probe_failure(True)
  finally:
    dispatch.probe_failure.cache_clear()
  assert "quantize (nvfp4): mantissa_bits differ" in reason
  assert kernels.resolve_with_reason("pallas") == ("pallas", None)
  if jax.default_backend() != "gpu":
    implementation, why = kernels.resolve_with_reason("auto")
    assert implementation == "xla" and "not a GPU" in why
