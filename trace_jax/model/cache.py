"""KV cache: bf16 (or the compute dtype) or FP4 (packed codes, E4M3 scales, per-token scales).

Slots are written in order: a forward over T tokens writes slots [index, index + T) for
every sequence of the batch, and `valid` marks which of them hold real tokens (padding
and finished sequences write invalid slots, which attention never reads). RoPE positions
are separate from slots, so left-padded prompts keep positions that start at 0.

Hybrid models (Qwen3.5) keep, at each Gated DeltaNet layer, a fixed-size state instead of K
and V: the conv state (the last K-1 valid conv inputs) and the recurrent delta-rule state
(float32). Their K/V entries are None, and full-attention layers' states are None.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from trace_jax import fp4
from trace_jax.model.config import ModelConfig
from trace_jax.model.quant import QuantConfig


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["k", "v", "valid", "index", "conv", "recurrent"],
  meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Per-layer K and V, [B, L, Hkv, Dh] arrays or `fp4.QArray`s of that shape.

  Attributes:
    k: tuple over layers (None at linear-attention layers).
    v: tuple over layers (None at linear-attention layers).
    valid: bool [B, L]: the slot holds a real token.
    index: int32 scalar: the next slot to write.
    conv: tuple over layers: conv state [B, K-1, conv_dim] at linear-attention layers, else
      None; () for a model without them.
    recurrent: tuple over layers: float32 [B, Hv, Dk, Dv] delta-rule state at
      linear-attention layers, else None; ().
  """

  k: tuple
  v: tuple
  valid: jax.Array
  index: jax.Array
  conv: tuple = ()
  recurrent: tuple = ()

  @property
  def max_len(self) -> int:
    return self.valid.shape[1]

  @property
  def quantized(self) -> bool:
    return any(isinstance(k, fp4.QArray) for k in self.k if k is not None)

  def bytes_per_token(self) -> float:
    """Bytes of K and V stored per token (all layers), including scales."""
    leaves = jax.tree_util.tree_leaves((self.k, self.v))
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    return total / (self.valid.shape[0] * self.valid.shape[1])

  def state_bytes_per_sequence(self) -> float:
    """Bytes of the linear-attention states (conv and recurrent) per sequence: fixed,
    whatever the length."""
    leaves = jax.tree_util.tree_leaves((self.conv, self.recurrent))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves) / self.valid.shape[0]


def init_cache(
  cfg: ModelConfig,
  batch: int,
  max_len: int | None = None,
  quant: QuantConfig | None = None,
  dtype=None,
) -> KVCache:
  """An empty cache; FP4 when `quant` quantizes the k and v sites, else `dtype` (default
  the compute dtype)."""
  max_len = max_len or cfg.max_seq_len
  dtype = cfg.compute_dtype if dtype is None else dtype
  if batch <= 0 or max_len <= 0:
    raise ValueError(f"init_cache needs batch > 0 and max_len > 0; got {batch}, {max_len}")
  shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)

  def entry(site):
    if quant is not None and quant.quantizes(site):
      block = fp4.get_format(quant.fmt).block_size
      if cfg.head_dim % block:
        raise ValueError(
          f"an {quant.fmt} KV cache needs head_dim divisible by {block}; head_dim={cfg.head_dim}"
        )
      return fp4.QArray(
        packed=jnp.zeros((*shape[:-1], cfg.head_dim // 2), jnp.uint8),
        scales=jnp.zeros((*shape[:-1], cfg.head_dim // block), jnp.uint8),
        global_scale=jnp.ones((*shape[:-1], 1), jnp.float32),
        fmt=quant.fmt,
        axis=-1,
      )
    return jnp.zeros(shape, dtype)

  linear = cfg.linear_layers
  conv = recurrent = ()
  if linear:
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
      cfg.linear_num_value_heads * cfg.linear_value_head_dim
    )
    conv = tuple(
      jnp.zeros((batch, cfg.linear_conv_kernel - 1, conv_dim), dtype) if i in linear else None
      for i in range(cfg.num_layers)
    )
    recurrent = tuple(
      jnp.zeros(
        (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
        jnp.float32,
      )
      if i in linear
      else None
      for i in range(cfg.num_layers)
    )
  return KVCache(
    k=tuple(None if i in linear else entry("k") for i in range(cfg.num_layers)),
    v=tuple(None if i in linear else entry("v") for i in range(cfg.num_layers)),
    valid=jnp.zeros((batch, max_len), bool),
    index=jnp.zeros((), jnp.int32),
    conv=conv,
    recurrent=recurrent,
  )


def blank_like(entry):
  """What an unwritten slot of a cache entry holds (`init_cache`): zeros, global scales 1."""
  if isinstance(entry, fp4.QArray):
    return dataclasses.replace(
      jax.tree.map(jnp.zeros_like, entry), global_scale=jnp.ones_like(entry.global_scale)
    )
  return jnp.zeros_like(entry)


def write_slots(entry, new, index: jax.Array, keep: jax.Array | None = None):
  """Write `new` ([B, T, ...] array or QArray) into slots [index, index + T) of `entry`.

  `keep` (bool scalar): False writes blank slots (`blank_like`) instead: a chunk with no
  valid token (a decode step after every sequence stopped, `rollout`'s stop-check interval)
  then leaves the cache as an unwritten slot would be.
  """
  if keep is not None:
    new = jax.tree.map(lambda n, z: jnp.where(keep, n, z), new, blank_like(new))
  return jax.tree.map(
    lambda old, n: jax.lax.dynamic_update_slice_in_dim(old, n.astype(old.dtype), index, axis=1),
    entry,
    new,
  )


def read(entry, dtype) -> jax.Array:
  """The cached K or V [B, L, Hkv, Dh] in `dtype` (dequantized if FP4)."""
  if isinstance(entry, fp4.QArray):
    return fp4.dequantize(entry, dtype)
  return entry.astype(dtype)
