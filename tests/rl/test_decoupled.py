"""Decoupled PPO objective against grpo_loss (w = 1) and against a numpy hand computation."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.rl.decoupled import DecoupledConfig, behaviour_weights, decoupled_loss
from trace_jax.rl.grpo import LossConfig, grpo_loss


def _inputs(seed, batch=5, length=9, spread=1.4):
  """Random log-probs where ratios fall on both sides of the clip range and w = pi_prox /
  pi_behav exceeds 5 for a few tokens; one sequence has no response token."""
  rng = np.random.default_rng(seed)
  proximal = np.log(rng.uniform(0.05, 0.95, (batch, length))).astype(np.float32)
  logp = (proximal + rng.normal(0.0, 0.4, (batch, length))).astype(np.float32)
  behaviour = (proximal - rng.normal(0.0, spread, (batch, length))).astype(np.float32)
  ref = (proximal + rng.normal(0.0, 0.3, (batch, length))).astype(np.float32)
  advantages = rng.normal(0.0, 1.0, batch).astype(np.float32)
  mask = rng.uniform(size=(batch, length)) < 0.7
  mask[1] = False
  return logp, proximal, behaviour, ref, advantages, mask


def _hand_loss(logp, proximal, behaviour, ref, advantages, mask, lc, dc):
  """Token by token in float64, from the AReaL objective's definition."""
  logp, proximal, behaviour, ref = (np.float64(x) for x in (logp, proximal, behaviour, ref))
  batch, length = logp.shape
  token_loss = np.zeros((batch, length))
  clipped = np.zeros((batch, length))
  w_raw = np.ones((batch, length))
  for b, t in itertools.product(range(batch), range(length)):
    if not mask[b, t]:
      continue
    a = float(advantages[b])
    rho = math.exp(logp[b, t] - proximal[b, t])
    rho_clip = min(max(rho, 1 - lc.clip_low), 1 + lc.clip_high)
    pg = max(-a * rho, -a * rho_clip)
    clipped[b, t] = -a * rho_clip > -a * rho
    w = math.exp(proximal[b, t] - behaviour[b, t])
    w_raw[b, t] = w
    if dc.is_cap_mode == "mask":
      weight = 0.0 if w > dc.is_cap else w
    else:
      weight = min(w, dc.is_cap)
    delta = ref[b, t] - logp[b, t]
    kl = math.exp(delta) - delta - 1
    token_loss[b, t] = weight * pg + lc.kl_coef * kl
  n = mask.sum()
  if lc.aggregation == "token":
    loss = token_loss[mask].sum() / n
  else:
    rows = [token_loss[b][mask[b]].mean() for b in range(batch) if mask[b].any()]
    loss = sum(rows) / len(rows)
  capped = (w_raw > dc.is_cap) & mask
  return loss, {
    "pg_clipfrac": clipped[mask].mean(),
    "decoupled/is_weight_mean": w_raw[mask].mean(),
    "decoupled/is_weight_max": w_raw[mask].max(),
    "decoupled/capped_frac": capped[mask].mean(),
    "decoupled/masked_frac": capped[mask].mean() if dc.is_cap_mode == "mask" else 0.0,
  }


@pytest.mark.parametrize(
  "aggregation, mode, seed",
  [("token", "mask", 1), ("token", "clamp", 2), ("sequence", "mask", 3)]
  + [("sequence", "clamp", 4)],
)
def test_matches_hand_computation(aggregation, mode, seed):
  logp, proximal, behaviour, ref, advantages, mask = _inputs(seed=seed)
  lc = LossConfig(clip_low=0.2, clip_high=0.28, aggregation=aggregation, kl_coef=0.05)
  dc = DecoupledConfig(is_cap=5.0, is_cap_mode=mode)
  loss, stats = decoupled_loss(
    jnp.asarray(logp),
    jnp.asarray(proximal),
    jnp.asarray(behaviour),
    jnp.asarray(advantages),
    jnp.asarray(mask),
    lc,
    dc,
    jnp.asarray(ref),
  )
  want_loss, want_stats = _hand_loss(logp, proximal, behaviour, ref, advantages, mask, lc, dc)
  # The draw exercises what is tested: some tokens clipped, some above the cap, some not.
  assert 0 < want_stats["pg_clipfrac"] < 1
  assert 0 < want_stats["decoupled/capped_frac"] < 0.5
  np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5, atol=1e-6)
  for name, want in want_stats.items():
    np.testing.assert_allclose(float(stats[name]), want, rtol=2e-5, atol=1e-7, err_msg=name)


def test_mask_and_clamp_hand_case():
  """w = 3, 0.4, 8 at ratio 1 and A = 1: the mask drops the third token (keeping it in the
  denominator); the clamp weighs it 5."""
  proximal = jnp.log(jnp.asarray([[0.9, 0.2, 0.8]]))
  behaviour = jnp.log(jnp.asarray([[0.3, 0.5, 0.1]]))
  args = (proximal, proximal, behaviour, jnp.asarray([1.0]), jnp.ones((1, 3), bool), LossConfig())
  loss, stats = decoupled_loss(*args, DecoupledConfig(is_cap_mode="mask"))
  assert float(loss) == pytest.approx(-(3 + 0.4 + 0) / 3, rel=1e-6)
  assert float(stats["decoupled/masked_frac"]) == pytest.approx(1 / 3)
  assert float(stats["decoupled/is_weight_mean"]) == pytest.approx((3 + 0.4 + 8) / 3, rel=1e-6)
  assert float(stats["decoupled/is_weight_max"]) == pytest.approx(8, rel=1e-6)
  loss, stats = decoupled_loss(*args, DecoupledConfig(is_cap_mode="clamp"))
  assert float(loss) == pytest.approx(-(3 + 0.4 + 5) / 3, rel=1e-6)
  assert float(stats["decoupled/masked_frac"]) == 0.0
  assert float(stats["decoupled/capped_frac"]) == pytest.approx(1 / 3)


def test_gradient_is_weighted_and_masked():
  """Inside the clip range d loss / d logp = -A w rho / N; a dropped token has none."""
  proximal = jnp.log(jnp.asarray([[0.5, 0.5, 0.5]]))
  behaviour = jnp.log(jnp.asarray([[0.25, 0.5, 0.05]]))  # w = 2, 1, 10
  logp = proximal + jnp.log(jnp.asarray([[1.1, 0.9, 1.0]]))
  mask = jnp.ones((1, 3), bool)
  adv = jnp.asarray([2.0])
  for mode, weights in (("mask", [2.0, 1.0, 0.0]), ("clamp", [2.0, 1.0, 5.0])):
    config = DecoupledConfig(is_cap_mode=mode)
    grad = jax.grad(
      lambda lp, c=config: decoupled_loss(lp, proximal, behaviour, adv, mask, LossConfig(), c)[0]
    )(logp)
    want = -2.0 * np.asarray(weights) * np.asarray([1.1, 0.9, 1.0]) / 3
    np.testing.assert_allclose(grad, [want], rtol=1e-5)
    # no gradient reaches the proximal or the behaviour log-probs
    for argnum in (1, 2):
      g = jax.grad(
        lambda *a, c=config: decoupled_loss(*a, adv, mask, LossConfig(), c)[0], argnums=argnum
      )(logp, proximal, behaviour)
      np.testing.assert_array_equal(g, np.zeros((1, 3)))


@pytest.mark.parametrize("jit", [False, True])
def test_equals_grpo_loss_bit_for_bit_when_behaviour_is_proximal(jit):
  """Staleness 0 in spirit: pi_behav = pi_prox (w = 1) gives grpo_loss's loss, stats and
  gradient exactly, whatever grpo's rollout correction and the cap mode."""
  cases = [  # every value of each knob, in a few combinations (each jit compiles twice)
    ("token", 0.0, "tis", "mask"),
    ("sequence", 0.1, "tis", "clamp"),
    ("token", 0.1, "mask", "clamp"),
    ("sequence", 0.0, "mask", "mask"),
    ("sequence", 0.1, "none", "mask"),
    ("token", 0.0, "none", "clamp"),
  ]
  if jit:  # the first three already hold each aggregation, KL on and off, each cap mode
    cases = cases[:3]
  for seed, (aggregation, kl_coef, correction, mode) in enumerate(cases):
    logp, proximal, _, ref, advantages, mask = _inputs(seed=100 + seed)
    lc = LossConfig(aggregation=aggregation, kl_coef=kl_coef, rollout_correction=correction)
    dc = DecoupledConfig(is_cap_mode=mode, is_cap=1.5)
    ref_arg = jnp.asarray(ref) if kl_coef else None
    fixed = (jnp.asarray(proximal), jnp.asarray(advantages), jnp.asarray(mask))

    def ours(lp, prox, adv, m, ref=ref_arg, lc=lc, dc=dc):
      return decoupled_loss(lp, prox, prox, adv, m, lc, dc, ref)

    def theirs(lp, prox, adv, m, ref=ref_arg, lc=lc):
      return grpo_loss(lp, prox, prox, adv, m, lc, ref)

    if jit:
      ours, theirs = jax.jit(ours), jax.jit(theirs)
    (loss_a, stats_a), grad_a = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(logp), *fixed)
    (loss_b, stats_b), grad_b = jax.value_and_grad(theirs, has_aux=True)(jnp.asarray(logp), *fixed)
    np.testing.assert_array_equal(loss_a, loss_b)
    np.testing.assert_array_equal(grad_a, grad_b)
    for name in ("pg_clipfrac", "pg_loss", "kl_ref"):
      np.testing.assert_array_equal(stats_a[name], stats_b[name], err_msg=name)
    assert float(stats_a["decoupled/is_weight_mean"]) == 1.0
    assert float(stats_a["decoupled/masked_frac"]) == 0.0


def test_padding_log_probs_do_not_leak():
  """Behaviour log-probs of -inf / NaN off the response mask leave the loss finite."""
  logp, proximal, behaviour, _, advantages, mask = _inputs(seed=7)
  behaviour = np.where(mask, behaviour, -np.inf).astype(np.float32)
  behaviour[~mask & (np.arange(mask.shape[1]) % 2 == 0)] = np.nan
  weights, w, _ = behaviour_weights(
    jnp.asarray(proximal), jnp.asarray(behaviour), jnp.asarray(mask), DecoupledConfig()
  )
  assert np.all(np.isfinite(weights)) and np.all(np.asarray(w)[~mask] == 1.0)
  loss, stats = decoupled_loss(
    *(jnp.asarray(x) for x in (logp, proximal, behaviour, advantages, mask)),
    LossConfig(),
    DecoupledConfig(),
  )
  assert np.isfinite(float(loss)) and np.isfinite(float(stats["decoupled/is_weight_mean"]))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "5", True])
def test_bad_is_cap(bad):
  with pytest.raises(ValueError, match=r"DecoupledConfig\.is_cap=.* must be a finite number > 0"):
    DecoupledConfig(is_cap=bad)


def test_bad_is_cap_mode():
  with pytest.raises(ValueError, match=r"is_cap_mode='drop' is not allowed.*'mask', 'clamp'"):
    DecoupledConfig(is_cap_mode="drop")
