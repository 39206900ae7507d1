"""Mismatch metrics against hand-computed values."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax.rl import metrics


def test_mismatch_metrics_hand_case():
  # Two response tokens: pi_rollout = 0.5, 0.25; pi_train = 0.25, 0.25. A third slot is masked.
  rollout = jnp.log(jnp.asarray([[0.5, 0.25, 0.9]]))
  train = jnp.log(jnp.asarray([[0.25, 0.25, 0.1]]))
  mask = jnp.asarray([[True, True, False]])
  m = metrics.mismatch_metrics(rollout, train, mask, tis_threshold=0.75)
  # r = pi_train / pi_rollout = 0.5, 1.0
  assert m["mismatch/kl"] == pytest.approx(math.log(2) / 2)
  assert m["mismatch/k3_kl"] == pytest.approx(((0.5 - 1 - math.log(0.5)) + 0.0) / 2)
  assert m["mismatch/logp_abs_diff"] == pytest.approx(math.log(2) / 2)
  assert m["mismatch/prob_diff_mean"] == pytest.approx(0.125)
  assert m["mismatch/prob_diff_max"] == pytest.approx(0.25)
  assert m["is_ratio/mean"] == pytest.approx(0.75)
  assert m["is_ratio/max"] == pytest.approx(1.0)
  assert m["is_ratio/min"] == pytest.approx(0.5)
  assert m["tis/clip_frac"] == pytest.approx(0.5)  # r = 1.0 > 0.75


def test_the_tails_against_a_loop_over_tokens_and_responses():
  """k3 and ratio percentiles, the extreme-token share and the sequence log-ratio, each
  computed here token by token and response by response (linear-interpolated percentiles,
  as numpy's default), on fresh draws with heavy tails and empty responses."""
  rng = np.random.default_rng()
  b, s = 24, 17
  rollout = np.log(rng.uniform(0.01, 1.0, (b, s)))
  train = rollout + rng.standard_t(2, (b, s)) * 0.3
  lengths = rng.integers(0, s + 1, b)
  lengths[0] = 0
  mask = np.arange(s)[None] < lengths[:, None]
  m = metrics.mismatch_metrics(jnp.asarray(rollout), jnp.asarray(train), jnp.asarray(mask))
  ratios, k3s, sums = [], [], []
  for i in range(b):
    total = 0.0
    for t in range(lengths[i]):
      log_r = float(np.float32(train[i, t]) - np.float32(rollout[i, t]))
      ratios.append(math.exp(log_r))
      k3s.append(math.exp(log_r) - 1 - log_r)
      total += log_r
    if lengths[i]:
      sums.append(abs(total))

  def percentile(values, q):
    values = sorted(values)
    position = (len(values) - 1) * q / 100
    low = int(math.floor(position))
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)

  assert m["mismatch/k3_p99"] == pytest.approx(percentile(k3s, 99), rel=1e-4)
  assert m["is_ratio/p99"] == pytest.approx(percentile(ratios, 99), rel=1e-4)
  extreme = sum(r > 2 or r < 0.5 for r in ratios) / len(ratios)
  assert m["mismatch/extreme_frac"] == pytest.approx(extreme)
  assert m["mismatch/seq_logratio_mean"] == pytest.approx(np.mean(sums), rel=1e-4)
  assert m["mismatch/seq_logratio_p90"] == pytest.approx(percentile(sums, 90), rel=1e-4)
  empty = metrics.mismatch_metrics(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2, 3), bool))
  assert math.isnan(empty["mismatch/extreme_frac"])


def test_the_router_flip_rate_counts_differing_expert_sets_per_layer():
  rng = np.random.default_rng()
  layers, b, s, k, experts = 3, 4, 7, 2, 6
  rollout = np.stack([rng.permutation(experts)[:k] for _ in range(layers * b * s)])
  rollout = rollout.reshape(layers, b, s, k)
  train = rollout.copy()
  flip = rng.random((layers, b, s)) < 0.3
  for index in zip(*np.nonzero(flip)):
    train[index] = [(e + 1) % experts for e in train[index]]  # another set
  swap = rng.random((layers, b, s)) < 0.3
  train[swap] = train[swap][:, ::-1]  # the same set in another order is no flip
  mask = rng.random((b, s)) < 0.7
  mask[0, 0] = True
  got = metrics.router_flip_rate(rollout, np.concatenate([train, train[:, :, :2]], 2), mask)
  got = np.asarray(got)
  for layer in range(layers):
    want = [set(rollout[layer, i, t]) != set(train[layer, i, t]) for i, t in zip(*np.nonzero(mask))]
    assert got[layer] == pytest.approx(np.mean(want))


def test_the_router_flip_metrics_are_the_mean_and_the_largest_layer():
  rng = np.random.default_rng()
  rollout = rng.integers(0, 8, (3, 2, 5, 1))
  train = np.where(rng.random(rollout.shape) < 0.4, (rollout + 1) % 8, rollout)
  mask = np.ones((2, 5), bool)
  per_layer = (train != rollout)[..., 0].mean(axis=(1, 2))
  got = metrics.router_flip_metrics(rollout, train, mask)
  assert got["mismatch/router_flip_rate"] == pytest.approx(per_layer.mean())
  assert got["mismatch/router_flip_rate_max"] == pytest.approx(per_layer.max())
  assert metrics.router_flip_metrics(rollout[:0], train[:0], mask) == {}  # no MoE layer
  assert metrics.router_flip_metrics(None, train, mask) == {}


def test_identical_paths_have_zero_mismatch():
  logp = jnp.log(jnp.asarray([[0.3, 0.6], [0.2, 0.9]]))
  m = metrics.mismatch_metrics(logp, logp, jnp.ones((2, 2), bool))
  assert m["mismatch/k3_kl"] == 0 and m["mismatch/kl"] == 0 and m["is_ratio/mean"] == 1


def test_code_disagreement_counts_elements_of_real_tokens():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 3, 32)).astype(np.float32)
  a = fp4.quantize(jnp.asarray(x), global_group="row")
  y = x.copy()
  y[0, 0] += rng.uniform(-0.5, 0.5, 32).astype(np.float32)  # changes codes of token (0, 0)
  y[1, 2] *= -1.0  # flips every nonzero sign of token (1, 2), which is masked out
  b = fp4.quantize(jnp.asarray(y), global_group="row")
  mask = np.ones((2, 3), bool)
  mask[1, 2] = False
  expected = np.sum((np.asarray(fp4.codes(a)) != np.asarray(fp4.codes(b)))[mask]) / (5 * 32)
  out = metrics.code_disagreement({(0, "attn_in"): a}, {(0, "attn_in"): b}, mask)
  assert out["code_disagree_frac"] == pytest.approx(expected)
  assert 0 < expected < 0.2
  assert out["per_layer"] == {0: pytest.approx(expected)}


def test_guidance_agreement():
  fallbacks = {(1, "k"): np.zeros((2, 2, 2, 4), bool)}
  fallbacks[(1, "k")][0, 1, 0, :3] = True
  fallbacks[(1, "k")][1, 1] = True  # masked token
  mask = np.asarray([[True, True], [True, False]])
  out = metrics.guidance_agreement(fallbacks, mask)
  assert out == {"guidance/followed_frac": pytest.approx(1 - 3 / 24), "guidance/fallbacks": 3}
  assert metrics.guidance_agreement({}, mask) == {}


def _hand_counts(a_codes, b_codes, mask):
  """Disagreeing codes and those one signed grid step apart, by explicit value lookups."""
  values = np.asarray(fp4.E2M1_GRID)
  signed = lambda c: np.where(c & 8, -1, 1) * np.searchsorted(values, values[c & 7])  # noqa: E731
  differ, one = 0, 0
  for idx in zip(*np.nonzero(a_codes != b_codes)):
    if mask[idx[:2]]:
      differ += 1
      one += abs(int(signed(a_codes[idx])) - int(signed(b_codes[idx]))) == 1
  return differ, one


def test_fp4_disagreement_bits_scales_codes_and_one_step_share():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 4, 64)).astype(np.float32)
  y = x * (1 + rng.uniform(-0.15, 0.15, x.shape)).astype(np.float32)  # nearby values
  y[1, 1] *= 3.0  # a token whose scales change
  y[0, 2, :5] *= -1  # sign flips: two or more grid steps apart
  a = fp4.quantize(jnp.asarray(x), global_group="row")
  b = fp4.quantize(jnp.asarray(y), global_group="row")
  mask = np.ones((2, 4), bool)
  mask[1, 3] = False
  a_codes, b_codes = np.asarray(fp4.codes(a)), np.asarray(fp4.codes(b))
  differ, one = _hand_counts(a_codes, b_codes, mask)
  assert 0 < one < differ
  bits = ((a_codes & 1) != (b_codes & 1))[mask].sum() / (7 * 64)
  scales = (np.asarray(a.scales) != np.asarray(b.scales)) | (
    np.asarray(a.global_scale) != np.asarray(b.global_scale)
  )
  out = metrics.fp4_disagreement({(3, "moe_in"): a}, {(3, "moe_in"): b}, mask)
  assert out["code_disagree_frac"] == pytest.approx(differ / (7 * 64))
  assert out["one_step_frac"] == pytest.approx(one / differ)
  assert out["mantissa_disagree_frac"] == pytest.approx(bits)
  assert out["scale_disagree_frac"] == pytest.approx(scales[mask].sum() / (7 * 4))
  assert out["per_layer"][3]["one_step_frac"] == pytest.approx(one / differ)
  # Compact guidance: bits and scales are measurable, codes are not.
  compact = metrics.fp4_disagreement(
    {(3, "moe_in"): fp4.compact_guidance(a)}, {(3, "moe_in"): b}, mask
  )
  assert compact["mantissa_disagree_frac"] == pytest.approx(bits)
  assert compact["scale_disagree_frac"] == out["scale_disagree_frac"]
  assert compact["code_disagree_frac"] is None and compact["one_step_frac"] is None
  flat = metrics.disagreement_metrics(
    {(3, "moe_in"): fp4.compact_guidance(a)}, {(3, "moe_in"): b}, mask
  )
  assert set(flat) == {
    "mismatch/mantissa_disagree_frac",
    "mismatch/mantissa_disagree/layer_3",
    "mismatch/scale_disagree_frac",
    "mismatch/scale_disagree/layer_3",
  }


def test_group_reward_metrics_against_a_loop():
  rng = np.random.default_rng(118)
  group_size = int(rng.integers(2, 6))
  rewards = rng.integers(0, 2, size=group_size * 7).astype(float)
  rewards[:group_size] = 1.0  # one all-solved group
  rewards[group_size : 2 * group_size] = 0.0  # one all-failed group
  m = metrics.group_reward_metrics(rewards, group_size)
  groups = [rewards[i : i + group_size] for i in range(0, rewards.size, group_size)]
  mixed = sum(len(set(g.tolist())) > 1 for g in groups) / len(groups)
  solved = sum(any(g > 0) for g in groups) / len(groups)
  assert m["reward/mixed_group_frac"] == pytest.approx(mixed)
  assert m["reward/solved_group_frac"] == pytest.approx(solved)
  assert m["reward/unsolved_group_frac"] == pytest.approx(1 - solved)
  assert m["reward/mixed_group_frac"] <= 5 / 7
  with pytest.raises(ValueError, match="groups of"):
    metrics.group_reward_metrics(rewards[:-1], group_size)
