"""Shape-only bytes of single buffers, and the least an RL step needs per device.

Each figure is a formula over the config's shapes (no tracing, milliseconds): the buffers
`plan` adds beside what it traces, and `batch_lower_bound_bytes`, the quick bound a run
checks before any work (`run.policy_source`).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from trace_jax.model.cache import init_cache
from trace_jax.model.config import ModelConfig
from trace_jax.model.quant import QuantConfig


def has_attention(cfg: ModelConfig) -> bool:
  """Whether any layer is softmax attention (not every one Gated DeltaNet)."""
  return cfg.num_layers > len(cfg.linear_layers)


def softmax_grad_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
  """What the backward of one attention layer holds beside the residuals, on one device:
  its softmax's gradients, of the probabilities and of the scores, float32 [batch, query
  heads, context, context] each (one layer at a time; none without attention layers)."""
  return 2 * batch * cfg.num_heads * context * context * 4 if has_attention(cfg) else 0


def lm_head_grad_bytes(cfg: ModelConfig, batch: int, context: int, model: int = 1) -> int:
  """What the backward of the LM head's log-softmax holds beside its residual logits, on
  one device: the logits less their maximum, their exponentials and the logits' gradient,
  float32 [batch, context, vocab / "model" shards] each. The update's compiled programs
  held all four live together, with the layers' backward (at Qwen3.5-35B-A3B's vocabulary of
  248,320 and 8,192 tokens, 7.6 GiB each)."""
  return 3 * batch * context * -(-cfg.vocab_size // model) * 4


def batch_lower_bound_bytes(
  cfg: ModelConfig,
  batch: int,
  context: int,
  *,
  data: int = 1,
  minibatch: int | None = None,
  chunk: int = 1,
  kv_quant: QuantConfig | None = None,
  fused: bool = True,
) -> dict[str, dict[str, float]]:
  """What an RL step's programs need per device at least, from shapes alone (milliseconds,
  unlike `plan`), program by program: a run needs the largest. All split over `data`.

    rollout  its KV cache for the whole `batch` of `context` slots (bf16, or FP4 where
             `kv_quant` quantizes K and V) and, beside it, a prefill chunk's float32
             attention scores over every slot, [batch, query heads, `chunk`, context]
             (once: the planner's "rollout working set" counts them twice);
    pi_old   unless `fused` (one update per step reads pi_old off its own forward): the
             float32 logits of the training path's forward over the whole batch;
    update   the float32 logits of one training minibatch of `minibatch` sequences and the
             three logits-sized buffers its LM head's backward holds (`lm_head_grad_bytes`).

  Each row is a buffer the compiled programs hold (`plan`'s rows, checked against XLA's);
  the activations, the weights and the rest only add to it. A run whose figure exceeds a
  device's memory cannot run."""
  cache = jax.eval_shape(lambda: init_cache(cfg, batch, context, kv_quant, dtype=jnp.bfloat16))
  cache_bytes = sum(
    math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(cache)
  )
  kv = "FP4" if kv_quant is not None and kv_quant.quantizes("k") else "bf16"
  scores = batch * cfg.num_heads * chunk * context * 4 if has_attention(cfg) else 0
  logits = (minibatch or batch) * context * cfg.vocab_size * 4
  phases = {
    "rollout": {
      f"KV cache ({kv})": cache_bytes / data,
      "prefill attention scores (f32)": scores / data,
    },
    "update": {
      "minibatch logits (f32)": logits / data,
      "LM head gradients (f32)": lm_head_grad_bytes(cfg, minibatch or batch, context) / data,
    },
  }
  if not fused:
    phases["pi_old"] = {"batch logits (f32)": batch * context * cfg.vocab_size * 4 / data}
  return phases


def device_memory_bytes() -> float | None:
  """Memory of one local device: its allocator's limit on a GPU or TPU, the machine's
  physical memory on CPU (None if unknown)."""
  device = jax.local_devices()[0]
  try:
    limit = (device.memory_stats() or {}).get("bytes_limit")
  except Exception:  # noqa: BLE001 - a backend without memory_stats
    limit = None
  if limit:
    return float(limit)
  try:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
  except (ValueError, OSError, AttributeError):
    return None
