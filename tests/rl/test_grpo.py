"""GRPO loss and advantages against hand-computed cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.rl.grpo import LossConfig, aggregate, correction_weights, group_advantages, grpo_loss

NONE = LossConfig(rollout_correction="none")


def test_group_advantages_with_and_without_std():
  rewards = jnp.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
  np.testing.assert_allclose(group_advantages(rewards, 4), [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5)
  np.testing.assert_allclose(
    group_advantages(rewards, 4, std_norm=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
  )
  with pytest.raises(ValueError, match="groups of 3"):
    group_advantages(rewards, 3)


def _single_token(ratio, advantage, config=NONE, rollout_ratio=1.0):
  old = jnp.log(jnp.asarray([[0.5]]))
  logp = old + math.log(ratio)
  rollout = old - math.log(rollout_ratio)  # pi_old / pi_rollout = rollout_ratio
  return grpo_loss(logp, old, rollout, jnp.asarray([advantage]), jnp.asarray([[True]]), config)


def test_clipped_ratio_hand_cases():
  loss, stats = _single_token(1.5, 1.0)  # above 1 + 0.28: max(-1.5, -1.28) = -1.28
  assert float(loss) == pytest.approx(-1.28) and float(stats["pg_clipfrac"]) == 1.0
  loss, stats = _single_token(0.5, -1.0)  # below 1 - 0.2: max(0.5, 0.8) = 0.8
  assert float(loss) == pytest.approx(0.8) and float(stats["pg_clipfrac"]) == 1.0
  loss, stats = _single_token(1.1, 1.0)  # inside: -1.1, not clipped
  assert float(loss) == pytest.approx(-1.1) and float(stats["pg_clipfrac"]) == 0.0
  loss, _ = _single_token(0.5, 1.0)  # A > 0 and ratio below: the unclipped term wins, -0.5
  assert float(loss) == pytest.approx(-0.5)
  loss, _ = _single_token(1.25, 1.0, LossConfig(rollout_correction="none", clip_high=0.2))
  assert float(loss) == pytest.approx(-1.2)  # a symmetric clip would cut at 1.2


def test_truncated_importance_sampling_and_masking():
  old = jnp.log(jnp.asarray([[0.9, 0.2, 0.5]]))
  rollout = jnp.log(jnp.asarray([[0.3, 0.5, 0.5]]))  # w = 3, 0.4, 1
  w, corrected = correction_weights(old, rollout, "tis", 2.0)
  np.testing.assert_allclose(w, [[2.0, 0.4, 1.0]], rtol=1e-6)
  np.testing.assert_array_equal(corrected, [[True, False, False]])
  w, corrected = correction_weights(old, rollout, "mask", 2.0)
  np.testing.assert_array_equal(w, [[0.0, 0.0, 1.0]])
  np.testing.assert_array_equal(corrected, [[True, True, False]])
  # TIS multiplies the token loss: ratio 1, A = 1 -> -w, token-mean over 3 tokens.
  loss, stats = grpo_loss(
    old,
    old,
    rollout,
    jnp.asarray([1.0]),
    jnp.ones((1, 3), bool),
    LossConfig(rollout_correction="tis"),
  )
  assert float(loss) == pytest.approx(-(2.0 + 0.4 + 1.0) / 3, rel=1e-6)
  assert float(stats["rollout_correction_frac"]) == pytest.approx(1 / 3)


def test_token_and_sequence_aggregation():
  values = jnp.asarray([[1.0, 0.0, 0.0], [2.0, 4.0, 6.0]])
  mask = jnp.asarray([[True, False, False], [True, True, True]])
  assert float(aggregate(values, mask, "token")) == pytest.approx((1 + 2 + 4 + 6) / 4)
  assert float(aggregate(values, mask, "sequence")) == pytest.approx((1 + 4) / 2)


def test_kl_to_reference_k3_and_gradient():
  logp = jnp.log(jnp.asarray([[0.5, 0.25]]))
  ref = jnp.log(jnp.asarray([[0.25, 0.25]]))
  config = LossConfig(rollout_correction="none", kl_coef=0.5)
  loss, stats = grpo_loss(logp, logp, logp, jnp.asarray([0.0]), jnp.ones((1, 2), bool), config, ref)
  k3 = (0.5 - math.log(0.5) - 1) / 2  # delta = log(0.25/0.5) for token 1, 0 for token 2
  assert float(stats["kl_ref"]) == pytest.approx(k3)
  assert float(loss) == pytest.approx(0.5 * k3)
  with pytest.raises(ValueError, match="ref_logp"):
    grpo_loss(logp, logp, logp, jnp.asarray([0.0]), jnp.ones((1, 2), bool), config)


def test_policy_gradient_direction():
  # d loss / d logp = -A * ratio / N inside the clip range (token mean over N = 2 tokens).
  old = jnp.log(jnp.asarray([[0.5, 0.5]]))
  grad = jax.grad(
    lambda lp: grpo_loss(lp, old, old, jnp.asarray([2.0]), jnp.ones((1, 2), bool), NONE)[0]
  )(old)
  np.testing.assert_allclose(grad, [[-1.0, -1.0]], rtol=1e-6)


def test_bad_loss_config():
  with pytest.raises(ValueError, match="aggregation='seq'"):
    LossConfig(aggregation="seq")
  with pytest.raises(ValueError, match="rollout_correction='is'"):
    LossConfig(rollout_correction="is")
  with pytest.raises(ValueError, match="tis_threshold"):
    LossConfig(tis_threshold=1.0)


def test_the_geometric_mean_sequence_mask_drops_whole_responses():
  """A response is kept iff the geometric mean of its tokens' ratios, (prod w)^(1/n) over
  its response tokens, lies in [1/C, C]; every token of a dropped response weighs 0."""
  rng = np.random.default_rng()
  b, s, threshold = 16, 12, 1.05
  old = jnp.asarray(np.log(rng.uniform(0.05, 1.0, (b, s))), jnp.float32)
  rollout = old + jnp.asarray(rng.normal(0, 0.08, (b, s)), jnp.float32)
  lengths = rng.integers(0, s + 1, b)
  mask = jnp.asarray(np.arange(s)[None] < lengths[:, None])
  w, corrected = correction_weights(old, rollout, "geo_mask", threshold, mask)
  ratios = np.exp(np.asarray(old, np.float64) - np.asarray(rollout, np.float64))
  for i in range(b):
    n = lengths[i]
    geo = np.prod(ratios[i, :n]) ** (1 / n) if n else 1.0
    keep = 1 / threshold <= geo <= threshold
    np.testing.assert_array_equal(np.asarray(w[i]), np.full(s, float(keep)))
    np.testing.assert_array_equal(np.asarray(corrected[i]), np.full(s, not keep))
  # The loss reads it: a dropped response contributes nothing.
  cfg = LossConfig(rollout_correction="geo_mask", geo_threshold=threshold)
  adv = jnp.asarray(rng.normal(size=b), jnp.float32)
  loss, stats = grpo_loss(old, old, rollout, adv, mask, cfg)
  kept = np.asarray(w[:, 0]) > 0
  want = -np.sum(np.asarray(adv)[kept] * lengths[kept]) / max(lengths.sum(), 1)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
  dropped_tokens = lengths[~kept].sum() / max(lengths.sum(), 1)
  np.testing.assert_allclose(float(stats["rollout_correction_frac"]), dropped_tokens, rtol=1e-6)


def test_a_geometric_threshold_at_or_below_one_is_refused():
  with pytest.raises(ValueError, match="geo_threshold=1.0 must be > 1"):
    LossConfig(geo_threshold=1.0)
