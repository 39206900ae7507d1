"""Decoupled PPO objective for bounded-staleness RL (AReaL; DESIGN.md section 4).

With rollouts from weights up to k versions old, three policies meet in one token:
- behaviour: the rollout's recorded log-probs (the FP4 engine at weights v - gap);
- proximal: the training path's forward at the start of the update, with guidance (v);
- current: theta, differentiated.

The objective separates what the two ratios are for:
1. PPO's trust region acts on rho = pi_theta / pi_prox, clipped to [1 - clip_low,
   1 + clip_high] exactly as `grpo.grpo_loss` clips pi / pi_old: the update cannot move far
   from the weights it starts at, however old the data.
2. The off-policy correction w = pi_prox / pi_behav (no gradient) reweights each token's
   clipped term. w mixes the precision gap (FP4 rollout vs training path) and the version
   gap (staleness). It is capped at `is_cap`:
   - "mask" (AReaL's behav_imp_weight_cap): tokens with w > is_cap are dropped (weight 0);
     the rest keep their uncapped w;
   - "clamp": w = min(w, is_cap) (truncated importance sampling).
   Dropped tokens keep their place in the denominators (AReaL: loss_mask_count), so
   masking lowers the loss's scale instead of re-weighting the surviving tokens.
3. Optional k3 KL to a reference policy and the aggregation ("token" / "sequence"), both
   as in `grpo.grpo_loss`.

w here plays the part of grpo's rollout correction (at staleness 0, pi_prox = pi_old and
pi_behav = pi_rollout, so w is that same ratio), so `LossConfig.rollout_correction` and
`tis_threshold` are not read: the cap replaces them. Where behaviour = proximal (w = 1) the
loss, its statistics and its gradient are `grpo_loss`'s bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from trace_jax.rl.grpo import LossConfig, aggregate, weighted_ppo
from trace_jax.utils.flags import knob

IS_CAP_MODES = ("mask", "clamp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoupledConfig:
  """The behaviour -> proximal importance weight's cap."""

  is_cap: float = knob(5.0, "Asynchronous RL: cap on w = pi_prox / pi_behav (AReaL's default 5).")
  is_cap_mode: str = knob(
    "mask",
    "Asynchronous RL: mask drops tokens with w > is_cap; clamp uses min(w, is_cap).",
    choices=IS_CAP_MODES,
  )

  def __post_init__(self):
    value = self.is_cap
    if isinstance(value, bool) or not (
      isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    ):
      raise ValueError(f"DecoupledConfig.is_cap={value!r} must be a finite number > 0")
    if self.is_cap_mode not in IS_CAP_MODES:
      raise ValueError(
        f"DecoupledConfig.is_cap_mode={self.is_cap_mode!r} is not allowed; "
        f"use one of {IS_CAP_MODES}"
      )


def behaviour_weights(proximal_logp, behaviour_logp, response_mask, config: DecoupledConfig):
  """(weights, raw w, capped): [B, S] each, without gradient.

  weights multiply the token loss; raw w = exp(proximal - behaviour) is 1 off the mask (so
  padding's arbitrary log-probs cannot turn into inf * 0 = NaN); capped marks w > is_cap.
  """
  log_w = jax.lax.stop_gradient(proximal_logp - behaviour_logp)
  w = jnp.exp(jnp.where(response_mask, log_w, 0.0))
  capped = w > config.is_cap
  if config.is_cap_mode == "mask":
    return jnp.where(capped, 0.0, w), w, capped
  return jnp.minimum(w, config.is_cap), w, capped


def decoupled_loss(
  logp,
  proximal_logp,
  behaviour_logp,
  advantages,
  response_mask,
  loss_config: LossConfig,
  config: DecoupledConfig,
  ref_logp=None,
):
  """The decoupled policy loss and its statistics.

  Args:
    logp: [B, S] log-probs under the current policy theta (differentiated).
    proximal_logp: [B, S] the training path's at the start of the update (no gradient).
    behaviour_logp: [B, S] what the rollout recorded (no gradient).
    advantages: [B], one per sequence.
    response_mask: bool [B, S], the tokens the loss covers.
    loss_config: clip_low, clip_high, aggregation and kl_coef as in `grpo_loss` (its
      rollout_correction and tis_threshold are not read: the cap replaces them).
    config: the cap on w = pi_prox / pi_behav.
    ref_logp: [B, S] under the reference policy, needed when kl_coef > 0.

  Returns:
    (loss, stats): stats hold grpo_loss's "pg_clipfrac", "pg_loss", "kl_ref", and over the
    response tokens "decoupled/is_weight_mean" and "decoupled/is_weight_max" (w before the
    cap), "decoupled/capped_frac" (share with w > is_cap) and "decoupled/masked_frac"
    (share dropped from the loss: the capped share in "mask" mode, 0 in "clamp" mode).
  """
  mask = response_mask.astype(bool)
  weights, w, capped = behaviour_weights(proximal_logp, behaviour_logp, mask, config)
  loss, stats = weighted_ppo(logp, proximal_logp, advantages, weights, mask, loss_config, ref_logp)
  capped_frac = aggregate(capped.astype(jnp.float32), mask, "token")
  stats = {
    **stats,
    "decoupled/is_weight_mean": aggregate(w, mask, "token"),
    "decoupled/is_weight_max": jnp.max(jnp.where(mask, w, 0.0)),
    "decoupled/capped_frac": capped_frac,
    "decoupled/masked_frac": capped_frac if config.is_cap_mode == "mask" else 0.0 * capped_frac,
  }
  return loss, stats
