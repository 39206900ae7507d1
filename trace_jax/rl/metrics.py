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

and the tails that precede collapse in the published reports, which a mean hides:

  mismatch/k3_p99               99th percentile of the tokens' k3 (r - 1 - log r)
  is_ratio/p99                  99th percentile of r
  mismatch/extreme_frac         share of tokens with r > 2 or r < 1/2
  mismatch/seq_logratio_mean    mean over responses of |sum of log r over the response|
  mismatch/seq_logratio_p90     its 90th percentile (a sequence-level importance weight's
                                log; it grows with length, where token means do not)

and, for a model with MoE layers, how often the training path's router chooses other experts
than the rollout did (`router_flip_rate`; under routing replay, the experts it would have
chosen):

  mismatch/router_flip_rate      share of (real token, MoE layer) expert sets that differ
  mismatch/router_flip_rate_max  the same in the MoE layer where it is largest

and, where both paths quantize, how their FP4 outcomes differ (`fp4_disagreement`).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4


# Metrics that time the run rather than describe it: they differ between identical runs.
TIMING_METRICS = ("rollout_seconds", "train_seconds", "rollout/tokens_per_second")


def mismatch_metrics(
  rollout_logp: jax.Array,
  train_logp: jax.Array,
  response_mask: jax.Array,
  *,
  tis_threshold: float = 2.0,
) -> dict[str, float]:
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
  out = {k: float(v) for k, v in jax.device_get(values).items()}
  out.update(tail_metrics(log_ratio, masked))
  return out


def tail_metrics(log_ratio: jax.Array, mask: jax.Array) -> dict[str, float]:
  """The tail metrics above from log r [B, S] at the response tokens `mask` [B, S] (NaN
  where there are no tokens, so an empty batch does not read as a perfect one). In jnp, so
  a batch spread over processes is read as a whole."""
  ratio = jnp.exp(log_ratio)
  tokens = lambda x: jnp.where(mask, x, jnp.nan)  # noqa: E731
  has_tokens = jnp.any(mask, axis=1)
  sequence = jnp.abs(jnp.sum(jnp.where(mask, log_ratio, 0.0), axis=1))
  sequence = jnp.where(has_tokens, sequence, jnp.nan)
  extreme = ((ratio > 2.0) | (ratio < 0.5)) & mask
  values = {
    "mismatch/k3_p99": jnp.nanpercentile(tokens(ratio - 1.0 - log_ratio), 99),
    "is_ratio/p99": jnp.nanpercentile(tokens(ratio), 99),
    "mismatch/extreme_frac": jnp.sum(extreme) / jnp.sum(mask),  # NaN: no tokens
    "mismatch/seq_logratio_mean": jnp.nanmean(sequence),
    "mismatch/seq_logratio_p90": jnp.nanpercentile(sequence, 90),
  }
  return {k: float(v) for k, v in jax.device_get(values).items()}


def router_flip_rate(rollout_routing, train_choice, mask) -> jax.Array:
  """Per MoE layer, float32 [L]: the share of real tokens (`mask` [B, S]) whose set of k
  experts on the training path (`train_choice`, the router's own top-k) differs from the
  rollout's. Routing arrays: int [L, B, S, k] (the training path's may hold more slots; they
  are cut to the rollout's). NaN where `mask` holds no token. In jnp, so a batch spread over
  processes is read as a whole."""
  rollout = jnp.sort(jnp.asarray(rollout_routing).astype(jnp.int32), axis=-1)
  train = jnp.asarray(train_choice).astype(jnp.int32)[:, :, : rollout.shape[2]]
  differ = jnp.any(rollout != jnp.sort(train, axis=-1), axis=-1)  # [L, B, S]
  mask = jnp.asarray(mask).astype(bool)
  return jnp.sum(differ & mask, axis=(1, 2)) / jnp.sum(mask)


def router_flip_metrics(rollout_routing, train_choice, mask) -> dict[str, float]:
  """The two router flip metrics above (empty for a model without MoE layers)."""
  if rollout_routing is None or train_choice is None or rollout_routing.shape[0] == 0:
    return {}
  flips = router_flip_rate(rollout_routing, train_choice, mask)
  values = {
    "mismatch/router_flip_rate": jnp.mean(flips),
    "mismatch/router_flip_rate_max": jnp.max(flips),
  }
  return {k: float(v) for k, v in jax.device_get(values).items()}


def _element_weights(mask: np.ndarray, shape) -> np.ndarray:
  """Broadcast a [B, S] token mask over a site's trailing element axes."""
  return np.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - 2)), shape)


def code_disagreement(rollout_sites: Mapping, train_sites: Mapping, mask) -> dict:
  """Fraction of activation elements whose FP4 code differs between the two paths.

  Args:
    rollout_sites, train_sites: {(layer, site): fp4.QArray} of the same [B, S, ...]
      activations (e.g. a full-guidance capture and the training forward with `Recording(form="full")`).
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
    "per_layer": {
      layer: frac([k for k in keys if k[0] == layer]) for layer in sorted({k[0] for k in keys})
    },
    "per_site": {
      site: frac([k for k in keys if k[1] == site]) for site in sorted({k[1] for k in keys})
    },
  }


def guidance_agreement(fallbacks: Mapping, mask) -> dict:
  """`guidance/followed_frac`: the share of guided elements that could follow the rollout's
  recorded decision (1 - the fallback rate), and `guidance/fallbacks`: how many could not
  (full guidance whose recorded code was not a neighbour of the training value; compact
  guidance on a single forced neighbour). It is not code agreement: under compact guidance
  an element that followed its bit may still land on another code (other neighbours); see
  `fp4_disagreement` for what the two paths' outcomes really share. Empty when nothing was
  guided."""
  mask = np.asarray(mask)
  fell, total = 0, 0
  for value in fallbacks.values():
    value = np.asarray(value)
    weights = _element_weights(mask, value.shape)
    fell += int(np.sum(value & weights))
    total += int(np.sum(weights))
  if not total:
    return {}
  return {"guidance/followed_frac": 1.0 - fell / total, "guidance/fallbacks": fell}


def _signed_grid_index(codes: np.ndarray) -> np.ndarray:
  """E2M1 codes -> position on the signed grid (-7..7; both zeros are 0)."""
  magnitude = (codes & 7).astype(np.int32)
  return np.where((codes & 8) != 0, -magnitude, magnitude)


def fp4_disagreement(rollout_sites: Mapping, train_sites: Mapping, mask) -> dict:
  """How the two paths' FP4 outcomes differ, overall and per layer.

  Compact guidance records the mantissa bit of every element and every block scale, so
  those two disagreements are measurable for any FP4 arm that captures it; full codes only
  where the rollout recorded them (full guidance). `one_step_frac` is the share of
  disagreeing codes exactly one step apart on the signed E2M1 grid (the method reports
  > 99%: the reason one bit per element suffices).

  Args:
    rollout_sites: {(layer, site): fp4.QArray (full) or fp4.CompactGuidance}.
    train_sites: {(layer, site): fp4.QArray} of the training forward (`Recording(form="full")`).
    mask: bool [B, S], the token slots to count.

  Returns:
    {"mantissa_disagree_frac", "scale_disagree_frac", "code_disagree_frac" (None without
    codes), "one_step_frac" (None without codes or without disagreement),
    "per_layer": {layer: the same four}} over the keys both hold.
  """
  mask = np.asarray(mask)
  counts: dict = {}  # layer -> [bit diff, bits, scale diff, scales, code diff, codes, one step]
  for key in sorted(set(rollout_sites) & set(train_sites)):
    r, t = rollout_sites[key], train_sites[key]
    c = counts.setdefault(key[0], [0] * 7)
    t_codes = np.asarray(fp4.codes(t))
    weights = _element_weights(mask, t_codes.shape)
    r_bits = (
      np.asarray(fp4.codes(r)) & 1
      if isinstance(r, fp4.QArray)
      else np.asarray(fp4.numerics.unpack_bits(r.mantissa_bits, r.axis))
    )
    c[0] += int(np.sum((r_bits != (t_codes & 1)) & weights))
    c[1] += int(np.sum(weights))
    same_scale = (np.asarray(r.scales) == np.asarray(t.scales)) & (
      np.asarray(r.global_scale) == np.asarray(t.global_scale)
    )
    scale_weights = _element_weights(mask, same_scale.shape)
    c[2] += int(np.sum(~same_scale & scale_weights))
    c[3] += int(np.sum(scale_weights))
    if isinstance(r, fp4.QArray):
      r_codes = np.asarray(fp4.codes(r))
      differ = (r_codes != t_codes) & weights
      steps = np.abs(_signed_grid_index(r_codes) - _signed_grid_index(t_codes))
      c[4] += int(np.sum(differ))
      c[5] += int(np.sum(weights))
      c[6] += int(np.sum(differ & (steps == 1)))

  def summary(c):
    frac = lambda a, b: a / b if b else None  # noqa: E731
    return {
      "mantissa_disagree_frac": frac(c[0], c[1]),
      "scale_disagree_frac": frac(c[2], c[3]),
      "code_disagree_frac": frac(c[4], c[5]),
      "one_step_frac": frac(c[6], c[4]),
    }

  total = [sum(c[i] for c in counts.values()) for i in range(7)]
  return {**summary(total), "per_layer": {layer: summary(c) for layer, c in sorted(counts.items())}}


def disagreement_metrics(rollout_sites: Mapping, train_sites: Mapping, mask) -> dict[str, float]:
  """`fp4_disagreement` as flat RL metrics: mismatch/{mantissa,scale,code}_disagree_frac,
  mismatch/code_one_step_frac and per layer mismatch/<kind>_disagree/layer_<i>."""
  d = fp4_disagreement(rollout_sites, train_sites, mask)
  out = {}
  for kind in ("mantissa", "scale", "code"):
    if d[f"{kind}_disagree_frac"] is None:
      continue
    out[f"mismatch/{kind}_disagree_frac"] = d[f"{kind}_disagree_frac"]
    for layer, row in d["per_layer"].items():
      out[f"mismatch/{kind}_disagree/layer_{layer}"] = row[f"{kind}_disagree_frac"]
  if d["one_step_frac"] is not None:
    out["mismatch/code_one_step_frac"] = d["one_step_frac"]
  return out


def group_reward_metrics(rewards, group_size: int) -> dict[str, float]:
  """How much learning signal a step's GRPO groups carry.

  A group whose samples all earn the same reward has zero advantage everywhere, so it adds
  nothing to the policy gradient: `reward/mixed_group_frac` is the share of groups that do
  carry a signal. `reward/solved_group_frac` is the share where at least one sample
  succeeded (best-of-group), `reward/unsolved_group_frac` where none did.

  Args:
    rewards: [N] rewards, in groups of `group_size` consecutive entries.
    group_size: samples per problem.
  """
  rewards = np.asarray(rewards, np.float64)
  if rewards.ndim != 1 or rewards.size % group_size:
    raise ValueError(f"rewards of shape {rewards.shape} do not split into groups of {group_size}")
  groups = rewards.reshape(-1, group_size)
  spread = groups.max(axis=1) - groups.min(axis=1)
  return {
    "reward/mixed_group_frac": float(np.mean(spread > 0)),
    "reward/solved_group_frac": float(np.mean(groups.max(axis=1) > 0)),
    "reward/unsolved_group_frac": float(np.mean(groups.max(axis=1) <= 0)),
  }
