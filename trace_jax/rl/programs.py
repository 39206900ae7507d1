"""The learner's compiled programs on the training path: log pi_old's forward
(`old_logprobs`), one GRPO update (`train_step`) and the divergence guard's parameter check
(`param_health`), over `TrainExample`, the update's unit. `rl.step` composes them into a step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from trace_jax.model.quant import Recording
from trace_jax.model.sharding import constrain_guidance_sites
from trace_jax.model.sites import ByLayer
from trace_jax.rl.decoupled import DecoupledConfig, decoupled_loss
from trace_jax.rl.grpo import grpo_loss
from trace_jax.training.forward import token_entropy, training_forward
from trace_jax.training.optim import (
  LayerStacked,
  apply_stacked_update,
  apply_update,
  value_and_grad_by_layer,
)

# The static arguments every program takes from a run's `StepSpec.static`.
STATIC = ("quant", "options", "replay", "temperature")


@struct.dataclass
class TrainExample:
  """One step's trajectories, the update's unit (minibatch rows taken by `jax.tree.map`).
  `old_logp` and `advantages` are filled in by scoring."""

  tokens: jax.Array  # int32 [B, S]
  positions: jax.Array  # int32 [B, S]
  mask: jax.Array  # bool [B, S], every real token
  response_mask: jax.Array  # bool [B, S], the tokens the loss trains
  rollout_logp: jax.Array  # float32 [B, S], log pi_rollout
  old_logp: jax.Array | None = None  # float32 [B, S], log pi_old (training path, step start)
  advantages: jax.Array | None = None  # float32 [B]


def loss_static(spec) -> dict:
  """The update's loss choice as static arguments: none for the synchronous loop, so its
  compiled update is the one it always was."""
  return {} if spec.decoupled is None else {"decoupled": spec.decoupled}


def _forward(policy, example: TrainExample, guidance, quant, options, replay, temperature, record):
  """The training path's forward of `example` (log-probs, `ModelOutput`), recording every
  site's full QArrays when `record`."""
  if record:
    options = options.replace(recording=Recording(form="full"))
  return training_forward(
    policy,
    example.tokens,
    example.positions,
    example.mask,
    quant=quant,
    guidance=guidance,
    routing_replay=replay,
    temperature=temperature,
    options=options,
  )


@functools.partial(nnx.jit, static_argnames=STATIC + ("record",))
def old_logprobs(
  policy, example: TrainExample, guidance, *, quant, options, replay, temperature, record: bool
):
  """(log pi_old, entropy, guidance fallbacks, training-path site records, the routers' own
  choices [num_moe_layers, B, S, k]): the records (full QArrays, for the per-layer
  disagreement) only when `record`."""
  logp, out = _forward(policy, example, guidance, quant, options, replay, temperature, record)
  return (
    logp,
    token_entropy(out.logits, temperature),
    ByLayer.of(out.fallbacks),
    ByLayer.of(out.sites),
    out.router_choice,
  )


# The policy's and the optimizer's state are donated: the update writes them in place, so a
# step holds one copy of parameters and Adam moments, not two.
@functools.partial(
  nnx.jit,
  static_argnames=STATIC + ("loss_config", "fused", "record", "decoupled", "mesh"),
  donate_argnums=(0, 1),
)
def train_step(
  policy,
  opt,
  example: TrainExample,
  guidance,
  ref_logp,
  *,
  quant,
  options,
  replay,
  temperature,
  loss_config,
  fused: bool = False,
  record: bool = False,
  decoupled: DecoupledConfig | None = None,
  mesh=None,
):
  """One GRPO update on `example` (a minibatch): (loss, stats, gradient norm).

  decoupled: asynchronous RL's loss (`rl.decoupled`), pi_old the proximal policy and the
  rollout's log-probs the behaviour policy; None: `grpo_loss` with the rollout correction.

  fused: the step's only update (one minibatch, one epoch). pi_old is then the policy this
  update starts from, so its log-probs are this forward's own, held without gradient
  (`example.old_logp` is not read and `old_logprobs` need not run), and the update also
  returns what `old_logprobs` would have: log pi_old, token entropy, guidance fallbacks,
  (with `record`) the training path's site records, and the routers' own choices.

  mesh: the run's mesh; the returned site records and fallbacks are then laid out by
  `guidance_site_specs` (batch over "data", each site's declared dimension over "model"),
  not left to XLA, which may keep them whole on every device."""
  # grpo_loss, or the decoupled loss with its config before the reference's log-probs
  loss_of, extra = (grpo_loss, ()) if decoupled is None else (decoupled_loss, (decoupled,))

  def loss_fn(policy):
    logp, out = _forward(policy, example, guidance, quant, options, replay, temperature, record)
    old_logp = jax.lax.stop_gradient(logp) if fused else example.old_logp
    loss, stats = loss_of(
      logp,
      old_logp,
      example.rollout_logp,
      example.advantages,
      example.response_mask,
      loss_config,
      *extra,
      ref_logp,
    )
    scored = ()
    if fused:
      scored = (
        old_logp,
        token_entropy(jax.lax.stop_gradient(out.logits), temperature),
        out.fallbacks,
        out.sites,
        out.router_choice,
      )
    return loss + policy.cfg.router_aux_loss_coef * out.lb_loss, (stats, scored)

  if isinstance(opt.tx, LayerStacked):  # the gradient made in the parameters' layer stacks
    (loss, (stats, scored)), stacked = value_and_grad_by_layer(loss_fn, policy, opt.wrt)
    grad_norm = apply_stacked_update(opt, policy, *stacked)
  else:
    (loss, (stats, scored)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(policy)
    grad_norm = apply_update(opt, policy, grads)
  if fused:
    old_logp, entropy, fallbacks, sites, router_choice = scored
    scored = (
      old_logp,
      entropy,
      constrain_guidance_sites(ByLayer.of(fallbacks), mesh),
      constrain_guidance_sites(ByLayer.of(sites), mesh),
      router_choice,
    )
  return (loss, stats, grad_norm) + tuple(scored)


@nnx.jit
def param_health(policy) -> tuple[jax.Array, jax.Array]:
  """(every parameter finite, max |parameter|): the divergence guard's two numbers."""
  leaves = jax.tree.leaves(nnx.state(policy, nnx.Param))
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
  max_abs = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in leaves]))
  return finite, max_abs
