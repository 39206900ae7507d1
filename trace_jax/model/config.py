"""Model configuration and presets.

Presets: `tiny` (tests), `small` (CPU experiments), `qwen3_5_tiny` (the hybrid Qwen3.5-MoE
architecture at test size), and the published geometries of Qwen3-30B-A3B, Qwen3.5-35B-A3B,
Mixtral-8x7B and OLMoE-1B-7B (for byte accounting through `jax.eval_shape` and for real
checkpoints on real accelerators).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax.numpy as jnp

ARCHS = ("qwen3_moe", "mixtral", "olmoe", "qwen3_5_moe")
LAYER_TYPES = ("full_attention", "linear_attention")
QK_NORMS = ("none", "head", "full")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}  # compute dtypes; parameters: float32
COMPUTE_DTYPES = tuple(DTYPES)
DISPATCHES = ("grouped", "dense")


def _require(ok: bool, field: str, value, allowed: str) -> None:
  if not ok:
    raise ValueError(f"ModelConfig.{field}={value!r} is not allowed; {allowed}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """A decoder-only MoE transformer (Qwen3-MoE / Mixtral / OLMoE family)."""

  name: str = "custom"  # preset name, for logs
  arch: str = "qwen3_moe"  # the Hugging Face family whose layout and routing this follows
  vocab_size: int
  d_model: int  # hidden size
  num_layers: int
  num_heads: int  # query heads
  num_kv_heads: int  # key/value heads (grouped-query attention)
  head_dim: int
  num_experts: int  # routed experts per MoE layer
  num_experts_per_tok: int  # top-k
  moe_ffn_dim: int  # each routed expert's SwiGLU width
  ffn_dim: int = 0  # dense SwiGLU width, for the layers in `dense_layers`
  dense_layers: tuple[int, ...] = ()  # layers with a dense feed-forward instead of MoE
  shared_expert_dim: int = 0  # width of an always-on shared expert; 0 = none
  shared_expert_gate: bool = False  # sigmoid gate on the shared expert (Qwen2-MoE)
  norm_topk_prob: bool = True  # renormalise the top-k router probabilities (Qwen3, Mixtral)
  qk_norm: str = "none"  # "head": RMSNorm per head (Qwen3); "full": over all heads (OLMoE)
  clip_qkv: float | None = None  # clamp q, k, v to +-clip_qkv (OLMoE option)
  rope_theta: float = 10000.0
  rms_eps: float = 1e-6
  tie_embeddings: bool = False  # LM head = embedding transposed
  sliding_window: int | None = None  # attend to at most this many previous slots
  max_seq_len: int = 2048  # default KV-cache length
  router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in training
  dtype: str = "float32"  # compute dtype, "float32" or "bfloat16"; parameters stay float32
  dispatch: str = "grouped"  # "grouped" (sorted tokens, ragged_matmul) or "dense" (reference)
  init_std: float = 0.02  # normal init of weight matrices
  # Hybrid layers (Qwen3.5-MoE). Empty `layer_types`: every layer is full attention.
  layer_types: tuple[str, ...] = ()  # per layer "full_attention" or "linear_attention"
  attn_output_gate: bool = False  # q_proj also emits a per-head sigmoid gate on the output
  partial_rotary_factor: float = 1.0  # RoPE rotates the first factor * head_dim dims only
  zero_centered_norm: bool = False  # RMSNorms scale by (1 + w), w initialised at 0
  linear_num_key_heads: int = 0  # Gated DeltaNet query/key heads
  linear_num_value_heads: int = 0  # Gated DeltaNet value heads (a multiple of key heads)
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel: int = 4  # causal depthwise conv1d width over q, k, v
  delta_chunk_size: int = 64  # chunk length of the chunked gated delta rule (prefill/train)
  remat: bool = False  # training: recompute each block's activations in the backward pass
  #   (jax.checkpoint per layer) instead of keeping them; see experiments/plan.py
  scan_layers: bool = True  # calls without a cache run each run of alike layers (a
  #   repeating pattern of them) under one jax.lax.scan: compiled once, not once per layer;
  #   layers that start no repeat (dense-first layers) stay unrolled

  def __post_init__(self):
    _require(self.arch in ARCHS, "arch", self.arch, f"use one of {ARCHS}")
    for field in (
      "vocab_size",
      "d_model",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "num_experts",
      "num_experts_per_tok",
      "moe_ffn_dim",
      "max_seq_len",
    ):
      value = getattr(self, field)
      _require(isinstance(value, int) and value > 0, field, value, "must be a positive int")
    _require(
      self.num_heads % self.num_kv_heads == 0,
      "num_kv_heads",
      self.num_kv_heads,
      f"must divide num_heads={self.num_heads}",
    )
    _require(self.head_dim % 2 == 0, "head_dim", self.head_dim, "must be even (RoPE)")
    _require(
      self.num_experts_per_tok <= self.num_experts,
      "num_experts_per_tok",
      self.num_experts_per_tok,
      f"must be <= num_experts={self.num_experts}",
    )
    _require(
      all(0 <= i < self.num_layers for i in self.dense_layers),
      "dense_layers",
      self.dense_layers,
      f"layer ids must lie in [0, {self.num_layers})",
    )
    _require(
      not self.dense_layers or self.ffn_dim > 0,
      "ffn_dim",
      self.ffn_dim,
      "must be > 0 when dense_layers is set",
    )
    _require(
      self.shared_expert_dim >= 0, "shared_expert_dim", self.shared_expert_dim, "must be >= 0"
    )
    _require(self.qk_norm in QK_NORMS, "qk_norm", self.qk_norm, f"use one of {QK_NORMS}")
    _require(self.dtype in DTYPES, "dtype", self.dtype, f"use one of {sorted(DTYPES)}")
    _require(self.dispatch in DISPATCHES, "dispatch", self.dispatch, f"use one of {DISPATCHES}")
    _require(
      self.sliding_window is None or self.sliding_window > 0,
      "sliding_window",
      self.sliding_window,
      "must be None or > 0",
    )
    _require(
      self.rope_theta > 0 and self.rms_eps > 0,
      "rope_theta/rms_eps",
      (self.rope_theta, self.rms_eps),
      "must be > 0",
    )
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    _require(
      not self.layer_types or len(self.layer_types) == self.num_layers,
      "layer_types",
      self.layer_types,
      f"must be empty or name all num_layers={self.num_layers} layers",
    )
    _require(
      all(t in LAYER_TYPES for t in self.layer_types),
      "layer_types",
      self.layer_types,
      f"entries must be one of {LAYER_TYPES}",
    )
    _require(
      0 < self.partial_rotary_factor <= 1 and self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
      "partial_rotary_factor",
      self.partial_rotary_factor,
      f"must lie in (0, 1] and give an even rotary dim of head_dim={self.head_dim}",
    )
    if self.linear_layers:
      for field in (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel",
        "delta_chunk_size",
      ):
        value = getattr(self, field)
        _require(
          isinstance(value, int) and value > 0,
          field,
          value,
          "must be a positive int when layer_types has linear_attention layers",
        )
      _require(
        self.linear_num_value_heads % self.linear_num_key_heads == 0,
        "linear_num_value_heads",
        self.linear_num_value_heads,
        f"must be a multiple of linear_num_key_heads={self.linear_num_key_heads}",
      )

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

  @property
  def num_moe_layers(self) -> int:
    return len(self.moe_layers)

  @property
  def linear_layers(self) -> tuple[int, ...]:
    """Layers with Gated DeltaNet linear attention (a recurrent state, no KV cache)."""
    return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

  @property
  def attention_layers(self) -> tuple[int, ...]:
    """Layers with full (softmax) attention over a KV cache."""
    return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

  @property
  def rotary_dim(self) -> int:
    """Dims of each head RoPE rotates (Hugging Face: int(head_dim * partial_rotary_factor))."""
    return int(self.head_dim * self.partial_rotary_factor)

  def quantized_widths(self, sites: str = "all") -> dict[str, int]:
    """The widths FP4 blocks run along under FP4 scope `sites` ("all" or "experts+kv"), by
    the config field that sets each: every one must be a multiple of the format's block
    (16 for NVFP4, 32 for MXFP4). Inputs of the routed experts and the KV heads always;
    under "all" also the shared expert's, a dense MLP's and linear attention's output."""
    widths = {"d_model": self.d_model, "moe_ffn_dim": self.moe_ffn_dim}
    if self.attention_layers:
      widths["head_dim"] = self.head_dim
    if sites == "all":
      if self.shared_expert_dim:
        widths["shared_expert_dim"] = self.shared_expert_dim
      if self.dense_layers:
        widths["ffn_dim"] = self.ffn_dim
      if self.linear_layers:
        widths["linear_value_head_dim"] = self.linear_value_head_dim * self.linear_num_value_heads
    return widths

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


def tiny(**overrides) -> ModelConfig:
  """Tests: a jitted train step well under a second on 2 CPU cores."""
  cfg = dict(
    name="tiny",
    vocab_size=128,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_ffn_dim=64,
    qk_norm="head",
    max_seq_len=256,
  )
  return ModelConfig(**{**cfg, **overrides})


def small(**overrides) -> ModelConfig:
  """CPU experiments: trains meaningfully in minutes on 2 cores."""
  cfg = dict(
    name="small",
    vocab_size=128,
    d_model=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_ffn_dim=128,
    qk_norm="head",
    max_seq_len=512,
  )
  return ModelConfig(**{**cfg, **overrides})


def qwen3_30b_a3b(**overrides) -> ModelConfig:
  """Qwen/Qwen3-30B-A3B: 48 layers, 128 experts (top 8), GQA 32/4, QK-norm per head."""
  cfg = dict(
    name="qwen3_30b_a3b",
    arch="qwen3_moe",
    vocab_size=151936,
    d_model=2048,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_ffn_dim=768,
    ffn_dim=6144,
    norm_topk_prob=True,
    qk_norm="head",
    rope_theta=1e6,
    rms_eps=1e-6,
    max_seq_len=40960,
    dtype="bfloat16",
  )
  return ModelConfig(**{**cfg, **overrides})


def mixtral_8x7b(**overrides) -> ModelConfig:
  """mistralai/Mixtral-8x7B-v0.1: 32 layers, 8 experts (top 2), GQA 32/8."""
  cfg = dict(
    name="mixtral_8x7b",
    arch="mixtral",
    vocab_size=32000,
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    num_experts=8,
    num_experts_per_tok=2,
    moe_ffn_dim=14336,
    norm_topk_prob=True,
    qk_norm="none",
    rope_theta=1e6,
    rms_eps=1e-5,
    max_seq_len=32768,
    router_aux_loss_coef=0.02,
    dtype="bfloat16",
  )
  return ModelConfig(**{**cfg, **overrides})


def olmoe_1b_7b(**overrides) -> ModelConfig:
  """allenai/OLMoE-1B-7B-0924: 16 layers, 64 experts (top 8, no renormalisation), QK-norm."""
  cfg = dict(
    name="olmoe_1b_7b",
    arch="olmoe",
    vocab_size=50304,
    d_model=2048,
    num_layers=16,
    num_heads=16,
    num_kv_heads=16,
    head_dim=128,
    num_experts=64,
    num_experts_per_tok=8,
    moe_ffn_dim=1024,
    norm_topk_prob=False,
    qk_norm="full",
    rope_theta=10000.0,
    rms_eps=1e-5,
    max_seq_len=4096,
    router_aux_loss_coef=0.01,
    dtype="bfloat16",
  )
  return ModelConfig(**{**cfg, **overrides})


def decoder_fields_from_hf(hf: dict, default_name: str) -> dict:
  """The ModelConfig fields every Hugging Face decoder config names alike (Qwen3-MoE,
  Mixtral, OLMoE, Qwen3.5-MoE's text config): name, sizes, heads and head width."""
  d, heads = hf["hidden_size"], hf["num_attention_heads"]
  return dict(
    name=os.path.basename(str(hf.get("_name_or_path", default_name))) or default_name,
    vocab_size=hf["vocab_size"],
    d_model=d,
    num_layers=hf["num_hidden_layers"],
    num_heads=heads,
    num_kv_heads=hf.get("num_key_value_heads") or heads,
    head_dim=hf.get("head_dim") or d // heads,
  )


def hybrid_layer_types(num_layers: int, full_attention_interval: int = 4) -> tuple[str, ...]:
  """Qwen3.5's default pattern: every `full_attention_interval`-th layer full attention,
  the others Gated DeltaNet."""
  return tuple(
    "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
    for i in range(num_layers)
  )


def qwen3_5_tiny(**overrides) -> ModelConfig:
  """Tests and CPU runs of the Qwen3.5-MoE architecture: 4 hybrid layers (3 Gated DeltaNet,
  1 gated full attention), shared expert, partial RoPE."""
  cfg = dict(
    name="qwen3_5_tiny",
    arch="qwen3_5_moe",
    vocab_size=128,
    d_model=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_ffn_dim=32,
    shared_expert_dim=32,
    shared_expert_gate=True,
    norm_topk_prob=True,
    qk_norm="head",
    layer_types=hybrid_layer_types(4),
    attn_output_gate=True,
    partial_rotary_factor=0.25,
    zero_centered_norm=True,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel=4,
    delta_chunk_size=16,
    max_seq_len=256,
  )
  return ModelConfig(**{**cfg, **overrides})


def qwen3_5_35b_a3b(**overrides) -> ModelConfig:
  """Qwen/Qwen3.5-35B-A3B (text model): 40 layers, 3 of 4 Gated DeltaNet (16 QK / 32 V heads
  of 128), every 4th gated full attention (GQA 16/2, head 256, RoPE on a quarter of it),
  256 experts (top 8) of width 512 plus a gated shared expert of 512."""
  cfg = dict(
    name="qwen3_5_35b_a3b",
    arch="qwen3_5_moe",
    vocab_size=248320,
    d_model=2048,
    num_layers=40,
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    num_experts=256,
    num_experts_per_tok=8,
    moe_ffn_dim=512,
    shared_expert_dim=512,
    shared_expert_gate=True,
    norm_topk_prob=True,
    qk_norm="head",
    layer_types=hybrid_layer_types(40),
    attn_output_gate=True,
    partial_rotary_factor=0.25,
    zero_centered_norm=True,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel=4,
    rope_theta=1e7,
    rms_eps=1e-6,
    max_seq_len=262144,
    dtype="bfloat16",
  )
  return ModelConfig(**{**cfg, **overrides})


PRESETS: dict[str, Callable[..., ModelConfig]] = {
  "tiny": tiny,
  "small": small,
  "qwen3_5_tiny": qwen3_5_tiny,
  "qwen3_30b_a3b": qwen3_30b_a3b,
  "qwen3_5_35b_a3b": qwen3_5_35b_a3b,
  "mixtral_8x7b": mixtral_8x7b,
  "olmoe_1b_7b": olmoe_1b_7b,
}


def get_preset(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"preset={name!r} is not known; allowed: {sorted(PRESETS)}")
  return PRESETS[name](**overrides)
