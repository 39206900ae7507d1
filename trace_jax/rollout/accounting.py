"""Guidance bytes per token of a model and rollout config, from shapes alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import guidance as guidance_lib
from trace_jax.model.config import ModelConfig
from trace_jax.model.quant import CallOptions, QuantConfig, Recording, resolve_layers
from trace_jax.model.transformer import Transformer
from trace_jax.rollout.config import RolloutConfig


def guidance_bytes_per_token(
  cfg: ModelConfig, config: RolloutConfig, quant: QuantConfig | None = None
) -> float:
  """Every byte the guidance of one token carries (scales, bits or codes, routing), computed
  with `jax.eval_shape` of a one-token forward: works for the published geometries too.
  `quant` overrides the rollout's QuantConfig, e.g. QuantConfig(sites="experts+kv") for the
  method's FP4 scope (guidance covers exactly the FP4 sites of the guided layers)."""
  layers = resolve_layers(config.guided_layers, cfg.num_layers)
  quant = config.quant if quant is None else quant

  def capture():
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    out = model(
      jnp.zeros((1, 1), jnp.int32),
      quant=quant,
      options=CallOptions(recording=Recording(form=config.guidance, layers=layers)),
    )
    sites = out.sites  # the guided layers' records, in the guidance's form
    routing = out.routing.astype(guidance_lib.routing_dtype(cfg.num_experts))
    return guidance_lib.Guidance(
      sites=sites,
      routing=routing if config.record_routing else None,
      mode=config.guidance,
      layers=layers,
    )

  return jax.eval_shape(capture).bytes_per_token()
