"""The training path: the policy on whole sequences, FP4 QAT, optionally guided by a rollout.

At every quantization site the training forward fake-quantizes with the same function as the
rollout path. With `QuantConfig(rounding="guided")`, the guided layers reuse the rollout's
recorded global and block scales and pick, between the two grid neighbours of each training
value, the one the rollout's mantissa bit (compact) or code (full) says (DESIGN.md section 3);
other layers round to nearest. `routing_replay` makes every MoE layer use the rollout's
experts. Gradients are straight-through either way.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trace_jax import guidance as guidance_lib
from trace_jax.model import sites as sites_lib
from trace_jax.model.quant import CallOptions, QuantConfig, layer_sites
from trace_jax.model.transformer import ModelOutput, Transformer, check_token_ids


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
  """log p(tokens[:, j]) under softmax(logits[:, j - 1] / temperature); 0 at slot 0.

  Args:
    logits: float32 [B, S, V]; tokens: int [B, S].
  Returns:
    float32 [B, S].
  """
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
  return jnp.concatenate([jnp.zeros_like(picked[:, :1]), picked], axis=1)


def token_entropy(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Entropy of the distribution that predicts slot j (from logits[:, j - 1]); 0 at slot 0."""
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return jnp.concatenate([jnp.zeros_like(entropy[:, :1]), entropy], axis=1)


def check_guidance(
  model: Transformer, quant: QuantConfig | None, guidance, tokens_shape, routing_replay: bool
) -> None:
  """Raise a ValueError saying what differs if `guidance` cannot drive this forward."""
  cfg = model.cfg
  guided = quant is not None and quant.enabled and quant.rounding == "guided"
  if (guided or routing_replay) and guidance is None:
    raise ValueError(
      "QuantConfig.rounding='guided' or routing_replay needs guidance= (Rollout.guidance)"
    )
  if guidance is None:
    return
  if not isinstance(guidance, guidance_lib.Guidance):
    raise ValueError(
      f"guidance must be a trace_jax.guidance.Guidance, got {type(guidance).__name__}"
    )
  required = set()
  if guided:
    sites = layer_sites(cfg, quant)
    required = {
      (layer, s) for layer in quant.guided_layer_ids(cfg.num_layers) for s in sites[layer]
    }
    # Sites whose rows are (token, chosen expert): their guidance only fits the rollout's experts.
    routed = sorted(key for key in required if sites_lib.site_spec(key[1]).routed)
    if routed and not routing_replay:
      raise ValueError(
        f"guided rounding at routed-expert sites {routed[:4]} needs routing_replay=True: the "
        "rollout recorded the mantissa bits / codes of each token's k chosen experts in "
        "slot order, so without the rollout's experts a slot whose expert changed would get "
        "another expert's bits. Replay routing, or guide layers without MoE sites"
      )
  guidance_lib.check_fits(
    guidance,
    tokens_shape=tokens_shape,
    required=required,
    num_moe_layers=cfg.num_moe_layers if routing_replay else None,
  )


def training_forward(
  model: Transformer,
  tokens,
  positions,
  mask,
  *,
  quant: QuantConfig | None,
  guidance: guidance_lib.Guidance | None = None,
  routing_replay: bool = False,
  temperature: float = 1.0,
  options: CallOptions | None = None,
) -> tuple[jax.Array, ModelOutput]:
  """Training-path log-probabilities of a batch of trajectories.

  Args:
    model: the policy (float32 master weights).
    tokens, positions, mask: [B, S] as in a `Rollout`.
    quant: FP4 QAT config (None / "bf16": no quantization).
    guidance: the rollout's `Guidance`, required for guided rounding or routing replay.
    routing_replay: use the rollout's experts at every MoE layer.
    temperature: the rollout's sampling temperature (log-probs of the tempered policy).
    options: how this call runs (`CallOptions`): its `compute_dtype` (default the model's)
      and `recording` (what the output's sites / fallbacks / site_inputs hold).

  Returns:
    (logprobs [B, S] as `token_logprobs`, the model's `ModelOutput`).
  """
  check_token_ids(tokens, model.cfg.vocab_size, "training_forward tokens")
  check_guidance(model, quant, guidance, tokens.shape, routing_replay)
  guided = quant is not None and quant.enabled and quant.rounding == "guided"
  if guidance is not None:  # what this forward follows of it: sites if guided, experts if replayed
    guidance = dataclasses.replace(
      guidance,
      sites=guidance.sites if guided else {},
      routing=guidance.routing if routing_replay else None,
    )
  out = model(
    tokens, positions=positions, mask=mask, quant=quant, guidance=guidance, options=options
  )
  return token_logprobs(out.logits, tokens, temperature), out
