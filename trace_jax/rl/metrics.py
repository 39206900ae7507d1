"""Training-inference mismatch metrics (DESIGN.md section 4; names follow verl / tunix).

All are computed over response tokens: the tokens the rollout sampled, whose log-probability
under the rollout (pi_rollout) and under the training path (pi_train, = pi_old at the start
of a step) RL compares. With r = pi_train / pi_rollout:

  mismatch/kl              mean(log pi_rollout - log pi_train)   (k1 estimate of KL(rollout||train))
  mismatch/k3_kl           mean(r - 1 - log r)                   (k3 estimate, >= 0, low variance)
  mismatch/logp_abs_diff   mean |log pi_rollout - log pi_train|
  mismatch/prob_diff_mean  mean |pi_rollout - pi_train|
  mismatch/prob_diff_max   max  |pi_rollout - pi_train|
  is_ratio/{mean,max,min}  of r
  tis/clip_frac            share of tokens with r above the truncation threshold
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4


def mismatch_metrics(rollout_logp: jax.Array, train_logp: jax.Array, response_mask: jax.Array,
                     *, tis_threshold: float = 2.0) -> dict[str, float]:
  """The mismatch metrics above, as Python floats. Arrays are [B, S]."""
  w = response_mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(w), 1.0)
  mean = lambda x: jnp.sum(x * w) / n
  diff = rollout_logp - train_logp
  log_ratio = -diff
  ratio = jnp.exp(log_ratio)
  prob_diff = jnp.abs(jnp.exp(rollout_logp) - jnp.exp(train_logp))
  masked = response_mask.astype(bool)
  values = {
      "mismatch/kl": mean(diff),
      "mismatch/k3_kl": mean(ratio - 1.0 - log_ratio),
      "mismatch/logp_abs_diff": mean(jnp.abs(diff)),
      "mismatch/prob_diff_mean": mean(prob_diff),
      "mismatch/prob_diff_max": jnp.max(jnp.where(masked, prob_diff, 0.0)),
      "is_ratio/mean": mean(ratio),
      "is_ratio/max": jnp.max(jnp.where(masked, ratio, -jnp.inf)),
      "is_ratio/min": jnp.min(jnp.where(masked, ratio, jnp.inf)),
      "tis/clip_frac": mean((ratio > tis_threshold).astype(jnp.float32)),
  }
  return {k: float(v) for k, v in jax.device_get(values).items()}


def _element_weights(mask: np.ndarray, shape) -> np.ndarray:
  """Broadcast a [B, S] token mask over a site's trailing element axes."""
  return np.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - 2)), shape)


def code_disagreement(rollout_sites: Mapping, train_sites: Mapping, mask) -> dict:
  """Fraction of activation elements whose FP4 code differs between the two paths.

  Args:
    rollout_sites, train_sites: {(layer, site): fp4.QArray} of the same [B, S, ...]
      activations (e.g. a full-guidance capture and `record=True` of the training forward).
    mask: bool [B, S], the token slots to count (real tokens).

  Returns:
    {"code_disagree_frac": overall, "per_layer": {layer: frac}, "per_site": {site: frac}}
    over the keys both hold.
  """
  mask = np.asarray(mask)
  differ_by_key, count_by_key = {}, {}
  for key in sorted(set(rollout_sites) & set(train_sites)):
    a = np.asarray(fp4.codes(rollout_sites[key]))
    b = np.asarray(fp4.codes(train_sites[key]))
    weights = _element_weights(mask, a.shape)
    differ_by_key[key] = int(np.sum((a != b) & weights))
    count_by_key[key] = int(np.sum(weights))

  def frac(keys):
    total = sum(count_by_key[k] for k in keys)
    return sum(differ_by_key[k] for k in keys) / total if total else float("nan")

  keys = list(differ_by_key)
  return {
      "code_disagree_frac": frac(keys),
      "per_layer": {layer: frac([k for k in keys if k[0] == layer])
                    for layer in sorted({k[0] for k in keys})},
      "per_site": {site: frac([k for k in keys if k[1] == site])
                   for site in sorted({k[1] for k in keys})},
  }


def guidance_agreement(fallbacks: Mapping, mask) -> dict:
  """`guidance/agree_frac` (share of guided elements that followed the rollout's recorded
  decision) and `guidance/fallbacks` (how many did not: full guidance whose recorded code
  was not a neighbour of the training value; compact guidance on a single forced
  neighbour). Empty when nothing was guided."""
  mask = np.asarray(mask)
  fell, total = 0, 0
  for value in fallbacks.values():
    value = np.asarray(value)
    weights = _element_weights(mask, value.shape)
    fell += int(np.sum(value & weights))
    total += int(np.sum(weights))
  if not total:
    return {}
  return {"guidance/agree_frac": 1.0 - fell / total, "guidance/fallbacks": fell}
