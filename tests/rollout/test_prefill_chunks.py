"""RolloutConfig.prefill_chunk: a prompt fed a chunk at a time is the prompt fed at once."""

import jax
import numpy as np
import pytest

from trace_jax import rollout as R

# `policy` (the tiny preset) comes from conftest.py.


def _rollout(policy, prompts, chunk, precision, new_tokens, key):
  config = R.RolloutConfig(
    precision=precision,
    guidance="full" if precision == "fp4" else "none",
    guided_layers="all",
    max_len=64,
    prompt_bucket=16,
    prefill_chunk=chunk,
    compute_dtype="float32",
    sampling=R.SamplingConfig(max_new_tokens=new_tokens),
  )
  return R.RolloutEngine(policy, config).generate(prompts, key)


def _prompts(policy, rng):
  """Four prompts left-padded to 48 slots: fed at once, in 16-slot chunks (three whole
  chunks) and in 7-slot chunks (a first chunk of 6, all padding, then six)."""
  vocab = policy.cfg.vocab_size
  return [[int(t) for t in rng.integers(1, vocab, n)] for n in (40, 23, 9, 33)]


def test_chunked_prefill_is_the_whole_prompt_prefill(policy):
  """Unquantized (bf16 weights, float32 compute): every slot sees the same cache entries,
  positions and mask, so the rollouts agree to float32 rounding (XLA:CPU sums a chunk's
  rows in another order than the prompt's): the same tokens, masks and routing, the
  log-probabilities and the cache within 1e-5."""
  rng = np.random.default_rng()
  prompts = _prompts(policy, rng)
  key = jax.random.key(int(rng.integers(1 << 30)))
  whole = _rollout(policy, prompts, 0, "bf16", 6, key)
  assert whole.tokens.shape[1] == 64 and int(np.asarray(whole.prompt_mask).sum()) == 105
  held = np.asarray(whole.prompt_mask | whole.response_mask)
  for chunk in (16, 7):
    chunked = _rollout(policy, prompts, chunk, "bf16", 6, key)
    for name in ("tokens", "positions", "prompt_mask", "response_mask", "finish"):
      np.testing.assert_array_equal(getattr(chunked, name), getattr(whole, name), err_msg=name)
    np.testing.assert_allclose(chunked.logprobs, whole.logprobs, atol=1e-5)
    routing = np.asarray(chunked.routing), np.asarray(whole.routing)
    np.testing.assert_array_equal(routing[0][:, held], routing[1][:, held])
    for name in ("k", "v"):
      for a, b in zip(getattr(chunked.cache, name), getattr(whole.cache, name)):
        np.testing.assert_allclose(np.asarray(a)[held], np.asarray(b)[held], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_chunked_fp4_prefill_records_the_whole_prompt_prefill(policy):
  """FP4 (float32 compute, full guidance at every layer), the prompt and one sampled token:
  the same positions and masks; the guidance and cache codes of every prompt slot equal but
  for the few whose value lay within float32 rounding of a rounding boundary (at most 2%: a
  wrong slot, position or mask changes most of them), their global scales within 5% (to
  rounding but where a code flipped upstream, which moves what follows by ~1e-3; the
  log-probabilities, which a flip moves by about 1e-2, are compared unquantized, above)."""
  rng = np.random.default_rng()
  prompts = _prompts(policy, rng)
  key = jax.random.key(int(rng.integers(1 << 30)))
  whole = _rollout(policy, prompts, 0, "fp4", 1, key)
  prompt = np.asarray(whole.prompt_mask)
  for chunk in (7,):  # a first chunk of 6 slots, then a scan over six
    chunked = _rollout(policy, prompts, chunk, "fp4", 1, key)
    for name in ("positions", "prompt_mask"):
      np.testing.assert_array_equal(getattr(chunked, name), getattr(whole, name), err_msg=name)
    assert set(chunked.guidance.sites) == set(whole.guidance.sites)
    pairs = [(site, chunked.guidance.sites[site], q) for site, q in whole.guidance.sites.items()]
    pairs += [
      (name, a, b)
      for name in ("k", "v")
      for a, b in zip(getattr(chunked.cache, name), getattr(whole.cache, name))
    ]
    for what, a, b in pairs:
      for field in ("packed", "scales"):
        x, y = (np.asarray(getattr(q, field))[prompt] for q in (a, b))
        assert np.mean(x != y) <= 0.02, (what, field, int(np.sum(x != y)), x.size)
      # Global scales to rounding, or near it after a code flipped upstream: the flip moves
      # every later slot of its sequence (a layer-1 scale moved 7e-4 on one draw).
      x, y = (np.asarray(q.global_scale)[prompt] for q in (a, b))
      np.testing.assert_allclose(x, y, rtol=5e-2, err_msg=str(what))


def test_prefill_chunk_is_refused_when_negative():
  for bad in (-1, 2.5):
    with pytest.raises(ValueError, match="prefill_chunk"):
      R.RolloutConfig(prefill_chunk=bad)
