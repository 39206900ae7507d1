"""The MoE policy model (Flax NNX) with FP4 quantization sites, KV cache, HF import, sharding."""

from trace_jax.model.cache import KVCache, LayerEntries, init_cache
from trace_jax.model.config import (
  PRESETS,
  ModelConfig,
  get_preset,
  mixtral_8x7b,
  olmoe_1b_7b,
  qwen3_30b_a3b,
  qwen3_5_35b_a3b,
  qwen3_5_tiny,
  small,
  tiny,
)
from trace_jax.model.hf import from_hf
from trace_jax.model.quant import (
  SITE_SCOPES,
  WEIGHT_GROUPS,
  CallOptions,
  QuantConfig,
  Recording,
  layer_sites,
  is_quantized_weight,
  resolve_layers,
  scale_groups,
  weight_group,
)
from trace_jax.model.quantizer import (
  SiteQuantizer,
  quantize_weight,
  quantize_weight_group,
  weight_layout,
)
from trace_jax.model.sites import ACTIVATION_SITES, SITES, Site
from trace_jax.model.transformer import ModelOutput, Transformer
