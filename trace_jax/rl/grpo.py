"""GRPO-family policy loss (DESIGN.md section 4).

1. Group-normalised advantages: A_i = (r_i - mean(r_group)) / (std(r_group) + eps), or
   without the std division (Dr. GRPO), one per sequence, shared by its tokens.
2. PPO-style clipped ratio rho = pi / pi_old with separate low / high clip (DAPO
   clip-higher): token loss max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)).
3. Rollout correction on w = pi_old / pi_rollout (the training-inference mismatch TRACE
   removes): token-level truncated importance sampling, min(w, C), multiplying the token
   loss; or masking tokens with w outside [1/C, C]; or masking whole responses whose
   geometric-mean ratio exp(mean over the response of log w) leaves [1/C_g, C_g] (verl's
   and DeepSeek's sequence mask: a length-normalised sequence ratio, so long responses are
   not dropped for their length alone); or none.
4. Optional KL to a reference policy (k3 estimator), weighted by kl_coef.
5. Aggregation: "token" (mean over all response tokens of the batch) or "sequence" (mean
   over sequences of each sequence's token mean).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from trace_jax.utils.flags import knob

AGGREGATIONS = ("token", "sequence")
CORRECTIONS = ("tis", "mask", "geo_mask", "none")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
  """Knobs of the GRPO loss."""

  clip_low: float = knob(0.2, "Ratio clip below: 1 - clip_low.")
  clip_high: float = knob(0.28, "Ratio clip above: 1 + clip_high (DAPO clip-higher).")
  aggregation: str = knob("token", "Loss aggregation: token or sequence.", choices=AGGREGATIONS)
  std_norm: bool = knob(
    False, "Divide advantages by the group std (GRPO; off: Dr. GRPO, the main job's best)."
  )
  kl_coef: float = knob(0.0, "KL-to-reference weight; 0 = no reference policy.")
  rollout_correction: str = knob(
    "tis", "tis, mask, geo_mask or none, on pi_old / pi_rollout.", flag=False
  )  # (an RL run sets it through RLConfig.correction)
  tis_threshold: float = knob(2.0, "TIS truncation / masking threshold C.")
  geo_threshold: float = knob(
    1.05, "geo_mask: a response is dropped when its geometric-mean ratio leaves [1/C, C]."
  )

  def __post_init__(self):
    for name in ("clip_low", "clip_high", "kl_coef", "tis_threshold", "geo_threshold"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"LossConfig.{name}={value!r} must be a finite number >= 0")
    if self.clip_low >= 1:  # the ratio floor 1 - clip_low must stay positive
      raise ValueError(
        f"LossConfig.clip_low={self.clip_low} must lie in [0, 1): the ratio floor is 1 - clip_low"
      )
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(
        f"LossConfig.aggregation={self.aggregation!r} is not allowed; use one of {AGGREGATIONS}"
      )
    if self.rollout_correction not in CORRECTIONS:
      raise ValueError(
        f"LossConfig.rollout_correction={self.rollout_correction!r} is not allowed; "
        f"use one of {CORRECTIONS}"
      )
    for name in ("tis_threshold", "geo_threshold"):
      if getattr(self, name) <= 1:
        raise ValueError(f"LossConfig.{name}={getattr(self, name)} must be > 1")


def group_advantages(
  rewards: jax.Array, group_size: int, *, std_norm: bool = True, eps: float = 1e-6
) -> jax.Array:
  """Per-sequence advantages; rewards [N] come in groups of `group_size` consecutive entries."""
  if rewards.shape[0] % group_size:
    raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
  groups = rewards.reshape(-1, group_size).astype(jnp.float32)
  centred = groups - groups.mean(axis=1, keepdims=True)
  if std_norm:
    centred = centred / (groups.std(axis=1, keepdims=True) + eps)
  return centred.reshape(-1)


def correction_weights(old_logp, rollout_logp, mode: str, threshold: float, mask=None):
  """Weights [B, S] from w = pi_old / pi_rollout (no gradient), and the bool mask of tokens
  where the correction bit (w > C for TIS; w outside [1/C, C] for masking; for the
  geometric-mean mask, every token of a response whose exp(mean log w) over its `mask`
  tokens leaves [1/C, C])."""
  log_w = jax.lax.stop_gradient(old_logp - rollout_logp)
  w = jnp.exp(log_w)
  if mode == "tis":
    return jnp.minimum(w, threshold), w > threshold
  if mode == "mask":
    keep = (w <= threshold) & (w >= 1.0 / threshold)
    return keep.astype(jnp.float32), ~keep
  if mode == "geo_mask":
    if mask is None:
      raise ValueError("correction_weights: geo_mask needs the response mask")
    m = mask.astype(jnp.float32)
    mean_log_w = jnp.sum(log_w * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)  # [B]
    keep = jnp.abs(mean_log_w) <= jnp.log(threshold)
    keep = jnp.broadcast_to(keep[:, None], w.shape)
    return keep.astype(jnp.float32), ~keep
  return jnp.ones_like(w), jnp.zeros(w.shape, bool)


def aggregate(token_values, mask, how: str):
  """Mean of [B, S] token values over the mask, by token or by sequence."""
  w = mask.astype(jnp.float32)
  if how == "token":
    return jnp.sum(token_values * w) / jnp.maximum(jnp.sum(w), 1.0)
  per_sequence = jnp.sum(token_values * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)
  has_tokens = (jnp.sum(w, axis=1) > 0).astype(jnp.float32)
  return jnp.sum(per_sequence * has_tokens) / jnp.maximum(jnp.sum(has_tokens), 1.0)


def weighted_ppo(logp, anchor_logp, advantages, weights, mask, config: LossConfig, ref_logp):
  """PPO's clipped objective on the ratio logp / anchor (pi_old, or the decoupled loss's
  proximal policy), each token's term times `weights` (a rollout correction or capped
  importance weight), plus the k3 KL to the reference: (loss, {"pg_clipfrac", "pg_loss",
  "kl_ref"}). `grpo_loss` and `rl.decoupled.decoupled_loss` share it."""
  ratio = jnp.exp(logp - jax.lax.stop_gradient(anchor_logp))
  adv = advantages[:, None]
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
  pg = jnp.maximum(unclipped, clipped)
  token_loss = weights * pg
  kl = jnp.zeros_like(logp)
  if config.kl_coef > 0:
    if ref_logp is None:
      raise ValueError("LossConfig.kl_coef > 0 needs ref_logp (a reference policy)")
    delta = jax.lax.stop_gradient(ref_logp) - logp
    kl = jnp.exp(delta) - delta - 1.0  # k3, >= 0
    token_loss = token_loss + config.kl_coef * kl
  loss = aggregate(token_loss, mask, config.aggregation)
  stats = {
    "pg_clipfrac": aggregate((clipped > unclipped).astype(jnp.float32), mask, "token"),
    "pg_loss": aggregate(weights * pg, mask, config.aggregation),
    "kl_ref": aggregate(kl, mask, "token"),
  }
  return loss, stats


def grpo_loss(
  logp, old_logp, rollout_logp, advantages, response_mask, config: LossConfig, ref_logp=None
):
  """The policy loss and its statistics.

  Args:
    logp: [B, S] log-probs under the current policy (differentiated).
    old_logp: [B, S] under the policy at the start of the step (pi_old).
    rollout_logp: [B, S] what the rollout reported (pi_rollout).
    advantages: [B], one per sequence.
    response_mask: bool [B, S], the tokens the loss covers.
    ref_logp: [B, S] under the reference policy, needed when kl_coef > 0.

  Returns:
    (loss, {"pg_clipfrac", "pg_loss", "kl_ref", "rollout_correction_frac"}).
  """
  mask = response_mask.astype(bool)
  threshold = (
    config.geo_threshold if config.rollout_correction == "geo_mask" else config.tis_threshold
  )
  weights, corrected = correction_weights(
    old_logp, rollout_logp, config.rollout_correction, threshold, mask
  )
  loss, stats = weighted_ppo(logp, old_logp, advantages, weights, mask, config, ref_logp)
  stats["rollout_correction_frac"] = aggregate(corrected.astype(jnp.float32), mask, "token")
  return loss, stats
