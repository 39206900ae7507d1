"""Sparse guidance captured by the rollout engine (fixed-size slot buffers, decode steps)
is what the rollout's own site inputs and their quantization make of it, and drives the
training path (slow, ~2-3 min on 2 loaded cores: `pytest -m slow tests/rollout/test_sparse_capture.py`)."""

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax import guidance as G
from trace_jax import rollout as R
from trace_jax.model.quant import QuantConfig, Recording, call_config
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
  # The training path follows it under jit, with gradients.
  quant = QuantConfig(rounding="guided", guided_layers="all")
  quant = call_config(quant, recording=Recording(form="full"))
  logp, out = nnx.jit(
    lambda m, g: training_forward(
      m, sparse.tokens, sparse.positions, sparse.mask, quant=quant, guidance=g, routing_replay=True
    )
  )(policy, sparse.guidance)
  chex.assert_tree_all_finite(logp)
  assert set(out.fallbacks) == set(sparse.guidance.sites)
