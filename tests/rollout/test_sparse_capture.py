"""Sparse guidance captured by the rollout engine (fixed-size slot buffers, decode steps)
is what the rollout's own site inputs and their quantization make of it, and drives the
training path (slow, ~2-3 min on 2 loaded cores: `pytest -m slow tests/rollout/test_sparse_capture.py`)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax import guidance as G
from trace_jax import rollout as R
from trace_jax.model.quant import CallOptions, QuantConfig, Recording
from trace_jax.training.forward import training_forward


@pytest.mark.slow
def test_engine_capture_round_trip_and_training_path(policy):
  spec = fp4.SparseSpec(delta=0.05, capacity_frac=0.125)
  base = R.RolloutConfig(
    max_len=32,
    prompt_bucket=8,
    guided_layers="all",
    kernels="xla",
    sampling=R.SamplingConfig(max_new_tokens=6),
    sparse=spec,
  )
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
  sparse = R.RolloutEngine(policy, base.replace(guidance="sparse"), capture_inputs=True).generate(
    prompts, jax.random.key(4)
  )
  # What the rollout quantized at each site (its inputs, bf16) and flagged of it.
  inputs = sparse.site_inputs
  full = G.Guidance(
    sites={k: fp4.quantize(x, global_group="row") for k, x in inputs.items()},
    routing=None,
    mode="full",
    layers=sparse.guidance.layers,
  )
  derived = full.to_sparse(inputs, spec)
  assert sparse.guidance.mode == "sparse" and set(sparse.guidance.sites) == set(derived.sites)
  mask = np.asarray(sparse.mask)
  assert mask[:, 8:].sum() >= 6  # decode steps were captured into the slot buffers
  for key, g in sparse.guidance.sites.items():
    d = derived.sites[key]
    rows = np.broadcast_to(mask.reshape(mask.shape + (1,) * (g.count.ndim - 3)), g.count.shape[:-1])
    for field in ("count", "block_count", "index", "block_index", "block_scales", "mantissa_bits"):
      got, want = np.asarray(getattr(g, field))[rows], np.asarray(getattr(d, field))[rows]
      if field in ("index", "mantissa_bits", "block_index", "block_scales"):  # stored slots only
        cap = got.shape[-1] * (8 if field == "mantissa_bits" else 1)
        counts = np.asarray(g.count if field in ("index", "mantissa_bits") else g.block_count)[rows]
        valid = np.arange(cap)[None] < np.minimum(counts, cap)
        if field == "mantissa_bits":
          got, want = fp4.unpack_bits(got), fp4.unpack_bits(want)
        got, want = np.where(valid, got, 0), np.where(valid, want, 0)
      np.testing.assert_array_equal(got, want, err_msg=f"{key} {field}")
  stats = sparse.guidance.sparse_stats(mask)
  assert 0.02 < stats["guidance/sparse_density"] < 0.3
  # Overflow: flags beyond each row's buffer, over the real slots, from the derived record.
  overflow = 0
  for d in derived.sites.values():
    rows = np.broadcast_to(mask.reshape(mask.shape + (1,) * (d.count.ndim - 3)), d.count.shape[:-1])
    overflow += int(np.maximum(np.asarray(d.count)[..., 0] - d.capacity, 0)[rows].sum())
  assert stats["guidance/sparse_overflow"] == overflow
  # The training path follows it under jit: its records are the fp4 functions' guided
  # quantization of its own inputs, it takes the recorded bit at every flagged element, and
  # so the rollout's code wherever that code is a grid neighbour of its own value (the
  # recorded bit picks it). A training value that drifted past a grid point from the
  # rollout's may land two steps away with the same bit; that happens rarely.
  quant = QuantConfig(rounding="guided", guided_layers="all")
  options = CallOptions(recording=Recording(form="full", inputs=True))
  logp, out = nnx.jit(
    lambda m, g: training_forward(
      m,
      sparse.tokens,
      sparse.positions,
      sparse.mask,
      quant=quant,
      guidance=g,
      routing_replay=True,
      options=options,
    )
  )(policy, sparse.guidance)
  chex.assert_tree_all_finite(logp)
  assert set(out.fallbacks) == set(sparse.guidance.sites)
  flagged = neighbours = reproduced = 0
  for key, g in sparse.guidance.sites.items():
    x, train = out.site_inputs[key], out.sites[key]
    want, want_fell = fp4.quantize_with_fallbacks(
      x, global_group="row", rounding="guided", guidance=g
    )
    index = np.asarray(g.index).astype(np.int64)  # [..., C]
    rows = np.broadcast_to(mask.reshape(mask.shape + (1,) * (index.ndim - 3)), index.shape[:-1])
    for field in ("packed", "scales", "global_scale"):  # at the real tokens' rows
      np.testing.assert_array_equal(
        np.asarray(getattr(train, field))[rows],
        np.asarray(getattr(want, field))[rows],
        err_msg=f"{key} {field}",
      )
    np.testing.assert_array_equal(np.asarray(out.fallbacks[key])[rows], np.asarray(want_fell)[rows])
    # The training value's grid neighbours under the scales it used: v = x / (s_b / gs).
    step = fp4.numerics.true_divide(fp4.e4m3_decode(train.scales), train.global_scale)
    step = jnp.repeat(step, 16, axis=-1)
    v = jnp.where(step > 0, fp4.numerics.true_divide(x.astype(jnp.float32), step), 0.0)
    lo, hi = fp4.numerics.e2m1_neighbours(jnp.abs(v))
    # The flagged elements of the real rows: stored slots j < min(count, capacity).
    stored = (np.arange(g.capacity) < np.minimum(np.asarray(g.count), g.capacity)) & rows[..., None]
    at = lambda a: np.take_along_axis(np.asarray(a), index, axis=-1)[stored]  # noqa: E731
    train_codes, rollout_codes = at(fp4.codes(train)), at(fp4.codes(full.sites[key]))
    bits = np.asarray(fp4.unpack_bits(g.mantissa_bits))[..., : g.capacity][stored]
    fell_back = at(out.fallbacks[key])
    np.testing.assert_array_equal(rollout_codes & 1, bits, err_msg=f"{key} stored bits")
    np.testing.assert_array_equal(
      (train_codes & 1)[~fell_back], bits[~fell_back], err_msg=f"{key} bits followed"
    )
    magnitude = rollout_codes & 7
    reachable = (magnitude == at(lo)) | (magnitude == at(hi))
    np.testing.assert_array_equal(
      (train_codes & 7)[reachable], magnitude[reachable], err_msg=f"{key} flagged codes"
    )
    flagged += train_codes.size
    neighbours += int(reachable.sum())
    reproduced += int((train_codes == rollout_codes).sum())
  assert flagged > 100  # many flagged elements were checked
  assert neighbours >= 0.95 * flagged and reproduced >= 0.95 * flagged, (
    flagged,
    neighbours,
    reproduced,
  )
