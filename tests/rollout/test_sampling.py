"""Sampling: nucleus and top-k never sample outside their sets; log-probabilities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import rollout as R


def _nucleus(logits, p):
  """Independent nucleus: sort descending, keep tokens until the mass reaches p."""
  probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
  order = np.argsort(-probs)
  kept, mass = [], 0.0
  for token in order:
    kept.append(token)
    mass += probs[token]
    if mass >= p:
      break
  return set(int(t) for t in kept)


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
def test_top_p_never_samples_outside_the_nucleus(top_p):
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((4, 50)).astype(np.float32) * 2
  sampling = R.SamplingConfig(top_p=top_p)
  keys = jax.random.split(jax.random.key(1), 2000)
  tokens = jax.jit(jax.vmap(lambda k: R.sample(jnp.asarray(logits), k, sampling)[0]))(keys)
  tokens = np.asarray(tokens)
  for row in range(4):
    nucleus = _nucleus(logits[row], top_p)
    seen = set(tokens[:, row].tolist())
    assert seen <= nucleus
    if len(nucleus) > 1:
      assert len(seen) > 1  # it does sample, not just argmax


def test_top_k_and_temperature():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.standard_normal((3, 40)).astype(np.float32))
  sampling = R.SamplingConfig(top_k=5, temperature=0.7)
  keys = jax.random.split(jax.random.key(2), 1000)
  tokens, logp, sampling_logp = jax.vmap(lambda k: R.sample(logits, k, sampling))(keys)
  top5 = np.argsort(-np.asarray(logits), axis=-1)[:, :5]
  for row in range(3):
    assert set(np.asarray(tokens[:, row]).tolist()) <= set(top5[row].tolist())
  # logprobs: the full tempered distribution; sampling_logprobs: renormalised over the top 5.
  scaled = np.asarray(logits) / 0.7
  full = scaled - np.log(np.exp(scaled).sum(-1, keepdims=True))
  chosen = np.asarray(tokens)
  np.testing.assert_allclose(
    logp,
    np.take_along_axis(full[None].repeat(1000, 0), chosen[..., None], -1)[..., 0],
    rtol=1e-5,
    atol=1e-5,
  )
  kept = np.take_along_axis(scaled, top5, -1)
  norm = np.log(np.exp(kept).sum(-1))
  expected = np.take_along_axis(scaled[None].repeat(1000, 0), chosen[..., None], -1)[..., 0] - norm
  np.testing.assert_allclose(sampling_logp, expected, rtol=1e-5, atol=1e-5)


def test_greedy_is_argmax_with_temperature_one_logprobs():
  logits = jnp.asarray([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
  tokens, logp, _ = R.sample(logits, jax.random.key(0), R.SamplingConfig(greedy=True))
  np.testing.assert_array_equal(tokens, [1, 0])
  np.testing.assert_allclose(logp, jax.nn.log_softmax(logits)[jnp.arange(2), tokens], rtol=1e-6)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(temperature=0.0), "temperature=0.0"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
  ],
)
def test_bad_sampling_configs(kwargs, match):
  with pytest.raises(ValueError, match=match):
    R.SamplingConfig(**kwargs)


def test_a_row_keyed_by_its_sequence_draws_as_it_would_alone():
  """With keys [B] from `sequence_keys`, each row's token is the one its own key draws for
  it alone (batch of 1), whatever the other rows; the keys depend on the sequence id and
  the position, not on the row."""
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.standard_normal((5, 30)).astype(np.float32) * 3)
  key = jax.random.key(7)
  sequences = jnp.asarray([9, 2, 40, 2, 9], jnp.uint32)
  positions = jnp.asarray([3, 3, 0, 4, 3], jnp.int32)
  keys = R.sequence_keys(key, sequences, positions)
  tokens = np.asarray(R.sample(logits, keys, R.SamplingConfig())[0])
  for row in range(5):
    alone = R.sequence_keys(key, sequences[row : row + 1], positions[row : row + 1])
    assert tokens[row] == int(R.sample(logits[row : row + 1], alone, R.SamplingConfig())[0][0])
  data = lambda k: np.asarray(jax.random.key_data(k))  # noqa: E731
  np.testing.assert_array_equal(data(keys[0]), data(keys[4]))  # same (sequence, position)
  assert not np.array_equal(data(keys[1]), data(keys[3]))  # same sequence, next position
  assert not np.array_equal(data(keys[0]), data(keys[1]))  # same position, other sequence
