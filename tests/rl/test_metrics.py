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
  y[1, 2] *= -1.0      # flips every nonzero sign of token (1, 2), which is masked out
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
  assert out == {"guidance/agree_frac": pytest.approx(1 - 3 / 24), "guidance/fallbacks": 3}
  assert metrics.guidance_agreement({}, mask) == {}
