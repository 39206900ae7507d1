"""OLMoE (`OlmoeForCausalLM`): tensor names and config.json, both ways.

QK-norm over all heads at once, optional q/k/v clipping, no top-k renormalisation by default.
"""

from __future__ import annotations

from trace_jax.model.archs.decoder import (
  DECODER,
  LAYER,
  moe_config_from_hf,
  moe_hf_config,
  routed_experts,
)
from trace_jax.model.archs.table import Arch, NameTable, linear
from trace_jax.model.config import ModelConfig

NAMES = NameTable(
  DECODER,
  linear("blocks.{layer}.moe.router", f"{LAYER}.mlp.gate.weight"),
  *routed_experts(f"{LAYER}.mlp.experts", f"{LAYER}.mlp.experts"),
)


def config_from_hf(hf: dict, dtype_name: str) -> ModelConfig:
  return moe_config_from_hf(
    hf, dtype_name, arch="olmoe", moe_ffn_key="intermediate_size", qk_norm="full"
  )


def hf_config(cfg: ModelConfig) -> dict:
  hf = moe_hf_config(
    cfg,
    hf_class=ARCH.hf_classes[0],
    num_experts_key="num_experts",
    moe_ffn_key="intermediate_size",
    extra=(("attention_bias", False),),
  )
  hf["clip_qkv"] = cfg.clip_qkv
  return hf


ARCH = Arch(
  name="olmoe",
  hf_classes=("OlmoeForCausalLM",),
  model_types=("olmoe",),
  names=NAMES,
  config_from_hf=config_from_hf,
  hf_config=hf_config,
)
