"""A skewed rollout engine (RolloutConfig.skew): 0 is the plain engine bit for bit; decode
and prefill hash the same counters; the skew moves the rollout's log-probs away from the
training path's, more with a larger skew."""

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax import rollout as R
from trace_jax.model.skew import Skew
from trace_jax.rl.metrics import mismatch_metrics
from trace_jax.training.forward import training_forward

PROMPTS = [[5, 17, 3], [9, 2, 44, 7, 61, 8, 30], [100], [1, 2]]


def _config(precision="bf16", **changes):
  base = dict(
    precision=precision,
    compute_dtype="float32",
    guidance="compact" if precision == "fp4" else "none",
    guided_layers="all",
    record_routing=True,
    max_len=48,
    prompt_bucket=8,
    sampling=R.SamplingConfig(max_new_tokens=12),
  )
  return R.RolloutConfig(**{**base, **changes})


def _same(a, b):
  leaves = lambda r: jax.tree.leaves(r.without_cache())  # noqa: E731
  assert len(leaves(a)) == len(leaves(b))
  for x, y in zip(leaves(a), leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp4", marks=pytest.mark.slow)])
def test_skew_zero_is_the_plain_engine_bit_for_bit(policy, precision):
  key = jax.random.key(int(np.random.default_rng().integers(1 << 30)))
  ids = [4, 3, 2, 1]  # (the sampling keys' counters too)
  plain = R.RolloutEngine(policy, _config(precision)).generate(PROMPTS, key, sequences=ids)
  zero = R.RolloutEngine(policy, _config(precision, skew=0.0))
  _same(zero.generate(PROMPTS, key, version=9, sequences=ids), plain)
  skewed = R.RolloutEngine(policy, _config(precision, skew=2**-5))
  skewed = skewed.generate(PROMPTS, key, sequences=ids)
  assert not np.array_equal(np.asarray(skewed.logprobs), np.asarray(plain.logprobs))


def _teacher_forced_logp(engine, rollout, skew):
  """The engine's own weights and call config over the whole sequences at once (no cache):
  log-probabilities of each slot's token given the slots before it."""
  model = nnx.merge(engine.graphdef, engine.params)
  out = model(
    rollout.tokens,
    positions=rollout.positions,
    mask=rollout.mask,
    quant=engine.statics.config.quant,
    options=engine.statics.options,
    skew=skew,
  )
  logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
  tokens = np.asarray(rollout.tokens)[:, 1:, None]
  return np.take_along_axis(np.asarray(logp), tokens, axis=-1)[..., 0]


def test_decode_and_prefill_hash_the_same_counters(policy):
  """The prefilled prompt and the decoded tokens' skew is the skew of a teacher-forced
  prefill of the whole sequences at the same (version, sequence) counters, in float32;
  other counters (or none) give another forward."""
  rng = np.random.default_rng()
  version, sequences = int(rng.integers(0, 1000)), rng.integers(0, 10**6, len(PROMPTS))
  amount = 2**-4
  engine = R.RolloutEngine(policy, _config(skew=amount))
  rollout = engine.generate(PROMPTS, jax.random.key(1), version=version, sequences=sequences)
  response = np.asarray(rollout.response_mask)[:, 1:]
  decoded = np.asarray(rollout.logprobs)[:, 1:][response]

  def gap(skew):
    return np.abs(_teacher_forced_logp(engine, rollout, skew)[response] - decoded).max()

  assert gap(Skew.of(amount, version, sequences)) < 2e-5
  assert gap(None) > 1e-3
  assert gap(Skew.of(amount, version + 1, sequences)) > 1e-3
  assert gap(Skew.of(amount, version, sequences[::-1])) > 1e-3


def test_multi_turn_continuation_keeps_the_counters(policy):
  """A continued rollout (an observation, then more decoding) is skewed at the same
  counters as a teacher-forced prefill of everything it holds."""
  amount, version, sequences = 2**-4, 3, [11, 12, 13, 14]
  engine = R.RolloutEngine(policy, _config(skew=amount, max_len=64))
  first = engine.generate(PROMPTS, jax.random.key(2), version=version, sequences=sequences)
  rollout = engine.continue_(
    first, [[7, 8], [], [9], [3, 4, 5]], jax.random.key(3), version=version, sequences=sequences
  )
  response = np.asarray(rollout.response_mask)[:, 1:]
  tf = _teacher_forced_logp(engine, rollout, Skew.of(amount, version, sequences))
  np.testing.assert_allclose(
    tf[response], np.asarray(rollout.logprobs)[:, 1:][response], rtol=0, atol=2e-5
  )


@pytest.mark.slow
def test_the_mismatch_with_the_training_path_grows_with_the_skew(policy):
  """k3 and |log-prob difference| of the rollout against the training path (the policy's
  own float32 forward of the sampled tokens) rise with the skew, and at 0 are the bf16
  weights' alone."""
  prompts = [[int(t) for t in row] for row in np.random.default_rng(0).integers(1, 100, (16, 5))]
  key = jax.random.key(int(np.random.default_rng().integers(1 << 30)))
  k3, diff = [], []
  for amount in (0.0, 2**-8, 2**-6, 2**-4):
    rollout = R.RolloutEngine(policy, _config(skew=amount)).generate(prompts, key, version=1)
    logp, _ = training_forward(policy, rollout.tokens, rollout.positions, rollout.mask, quant=None)
    m = mismatch_metrics(rollout.logprobs, logp, rollout.response_mask)
    k3.append(m["mismatch/k3_kl"])
    diff.append(m["mismatch/logp_abs_diff"])
  assert all(a < b for a, b in zip(k3, k3[1:])), k3
  assert all(a < b for a, b in zip(diff, diff[1:])), diff
  assert k3[-1] > 100 * k3[0]


def test_bad_skews_and_counters_are_refused(policy):
  for bad in (-1e-3, float("nan"), float("inf")):
    with pytest.raises(ValueError, match=r"RolloutConfig\.skew=.* finite number >= 0"):
      _config(skew=bad)
  engine = R.RolloutEngine(policy, _config(skew=0.01))
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="sequences must be 4 integer sequence ids"):
    engine.generate(PROMPTS, key, sequences=[0, 1])
  with pytest.raises(ValueError, match="sequences must be 4 integer sequence ids"):
    engine.generate(PROMPTS, key, sequences=[0, 1, 2, -3])
  with pytest.raises(ValueError, match="version=-1 must be an integer >= 0"):
    engine.generate(PROMPTS, key, version=-1)
