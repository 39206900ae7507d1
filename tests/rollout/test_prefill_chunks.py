"""RolloutConfig.prefill_chunk: a prompt fed a chunk at a time is the prompt fed at once."""

import jax
import numpy as np
import pytest

from trace_jax import rollout as R

# `policy` (the tiny preset) comes from conftest.py.


def _rollout(policy, prompts, chunk, compute_dtype, key):
  config = R.RolloutConfig(
    precision="fp4",
    guidance="full",
    guided_layers="all",
    max_len=64,
    prompt_bucket=16,
    prefill_chunk=chunk,
    compute_dtype=compute_dtype,
    sampling=R.SamplingConfig(max_new_tokens=6),
  )
  return R.RolloutEngine(policy, config).generate(prompts, key)


def _close(a, b, held, what):
  """Leaves at the slots that hold a token: float fields to float32 rounding; codes equal
  but for the few whose value lay within that rounding of a rounding boundary (at most
  2%: a wrong slot, position or mask changes most of them)."""
  a, b = np.asarray(a)[held], np.asarray(b)[held]
  if a.dtype.kind == "f":
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-30, err_msg=what)
  else:
    assert np.mean(a != b) <= 0.02, (what, int(np.sum(a != b)), a.size)


def test_chunked_prefill_is_the_whole_prompt_prefill(policy):
  """Prompts left-padded to 48 slots, fed at once, in 16-slot chunks (three whole chunks)
  and in 7-slot chunks (a first chunk of 6, all padding, then six): float32 compute gives
  the same tokens, masks, positions and routing, log-probabilities and scales equal to
  float32 rounding (XLA:CPU sums a chunk's rows in another order than the prompt's: a scale
  moves by up to ~1e-6), and the guidance and cache codes but for a few at a boundary."""
  rng = np.random.default_rng()
  vocab = policy.cfg.vocab_size
  prompts = [[int(t) for t in rng.integers(1, vocab, n)] for n in (40, 23, 9, 33)]
  key = jax.random.key(int(rng.integers(1 << 30)))
  whole = _rollout(policy, prompts, 0, "float32", key)
  assert whole.tokens.shape[1] == 64 and int(np.asarray(whole.prompt_mask).sum()) == 105
  held = np.asarray(whole.prompt_mask | whole.response_mask)
  for chunk in (16, 7):
    chunked = _rollout(policy, prompts, chunk, "float32", key)
    for name in ("tokens", "positions", "prompt_mask", "response_mask", "finish"):
      np.testing.assert_array_equal(getattr(chunked, name), getattr(whole, name), err_msg=name)
    np.testing.assert_allclose(chunked.logprobs, whole.logprobs, atol=1e-5)
    routing = np.asarray(chunked.routing), np.asarray(whole.routing)
    np.testing.assert_array_equal(routing[0][:, held], routing[1][:, held])
    assert set(chunked.guidance.sites) == set(whole.guidance.sites)
    for site, record in whole.guidance.sites.items():
      for a, b in zip(jax.tree.leaves(chunked.guidance.sites[site]), jax.tree.leaves(record)):
        _close(a, b, held, site)
    for name in ("k", "v"):
      for a, b in zip(
        jax.tree.leaves(getattr(chunked.cache, name)), jax.tree.leaves(getattr(whole.cache, name))
      ):
        _close(a, b, held, name)


def test_prefill_chunk_is_refused_when_negative():
  for bad in (-1, 2.5):
    with pytest.raises(ValueError, match="prefill_chunk"):
      R.RolloutConfig(prefill_chunk=bad)
