"""Mixtral (`MixtralForCausalLM`): tensor names and config.json, both ways.

transformers before v5 names the MoE block `block_sparse_moe` and an expert's projections
w1 (gate), w3 (up), w2 (down); v5 writes `mlp` and the fused expert layout. Both load; an
export writes the first.
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

_MOE = f"{LAYER}.block_sparse_moe"
NAMES = NameTable(
  DECODER,
  linear("blocks.{layer}.moe.router", f"{_MOE}.gate.weight", f"{LAYER}.mlp.gate.weight"),
  *routed_experts(f"{_MOE}.experts", f"{LAYER}.mlp.experts", ("w1", "w3", "w2")),
)


def config_from_hf(hf: dict, dtype_name: str) -> ModelConfig:
  return moe_config_from_hf(
    hf,
    dtype_name,
    arch="mixtral",
    moe_ffn_key="intermediate_size",
    norm_topk_prob=True,  # Mixtral always renormalises the top-k
    qk_norm="none",
    sliding_window=hf.get("sliding_window"),
  )


def hf_config(cfg: ModelConfig) -> dict:
  hf = moe_hf_config(
    cfg,
    hf_class=ARCH.hf_classes[0],
    num_experts_key="num_local_experts",
    moe_ffn_key="intermediate_size",
  )
  hf["sliding_window"] = cfg.sliding_window
  return hf


ARCH = Arch(
  name="mixtral",
  hf_classes=("MixtralForCausalLM",),
  model_types=("mixtral",),
  names=NAMES,
  config_from_hf=config_from_hf,
  hf_config=hf_config,
)
