"""Bytes of weights and KV cache, from shapes alone (`jax.eval_shape`: nothing materialised)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.model.cache import init_cache
from trace_jax.model.config import ModelConfig
from trace_jax.model.quant import QuantConfig, is_quantized_weight
from trace_jax.model.quantizer import quantize_weight
from trace_jax.model.transformer import Transformer


def abstract_variables(cfg: ModelConfig) -> dict:
  """The model's parameters (nnx.Params of ShapeDtypeStructs, with their metadata), by NNX
  state path."""
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  return dict(nnx.to_flat_state(nnx.state(abstract)))


def abstract_params(cfg: ModelConfig):
  """The model's parameters as ShapeDtypeStructs, by NNX state path."""
  return {path: var.get_value() for path, var in abstract_variables(cfg).items()}


def param_count(cfg: ModelConfig) -> int:
  return sum(int(v.size) for v in abstract_params(cfg).values())


def weight_bytes(cfg: ModelConfig, fmt: str | None = None, *, sites: str = "all") -> int:
  """Bytes of all weights in bf16, or with the linear weights of the FP4 scope `sites`
  ("all" or "experts+kv") packed in `fmt` (NVFP4 / MXFP4: codes, block scales, global
  scales) and the rest in bf16."""
  quant = None if fmt is None else QuantConfig(fmt=fmt, sites=sites)
  total = 0
  for variable in abstract_variables(cfg).values():
    value = variable.get_value()
    if quant is not None and is_quantized_weight(variable, quant):
      packed = jax.eval_shape(lambda w: quantize_weight(w, fmt), value)
      total += sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(packed))
    else:
      total += value.size * 2
  return int(total)


def kv_bytes_per_token(cfg: ModelConfig, quant: QuantConfig | None = None) -> float:
  """KV-cache bytes per token over all layers: bf16, or FP4 if `quant` quantizes k and v."""
  cache = jax.eval_shape(lambda: init_cache(cfg.replace(dtype="bfloat16"), 1, 16, quant))
  leaves = jax.tree.leaves((cache.k, cache.v))
  return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in leaves) / 16


def state_bytes_per_sequence(cfg: ModelConfig) -> float:
  """Bytes of the Gated DeltaNet layers' fixed-size decode state (conv state in bf16,
  recurrent state in float32) per sequence, whatever its length; 0 without such layers."""
  cache = jax.eval_shape(lambda: init_cache(cfg.replace(dtype="bfloat16"), 1, 16))
  leaves = jax.tree.leaves((cache.conv, cache.recurrent))
  return float(sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in leaves))
