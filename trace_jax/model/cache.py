"""KV cache: bf16 (or the compute dtype) or FP4 (packed codes, E4M3 scales, per-token scales).

Slots are written in order: a forward over T tokens writes slots [index, index + T) for
every sequence of the batch, and `valid` marks which of them hold real tokens (padding
and finished sequences write invalid slots, which attention never reads). RoPE positions
are separate from slots, so left-padded prompts keep positions that start at 0.

Hybrid models (Qwen3.5) keep, at each Gated DeltaNet layer, a fixed-size state instead of K
and V: the conv state (the last K-1 valid conv inputs) and the recurrent delta-rule state
(float32). Their K/V entries are None, and full-attention layers' states are None.

Each field is held as one stack over the layers that have it (`LayerEntries`): a forward
whose layers run under a scan carries the stack and writes a step's new slots into it in
place, and an unrolled forward writes the same slots at a fixed position; neither copies a
layer's entries to give them back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from trace_jax import fp4
from trace_jax.model.config import ModelConfig
from trace_jax.model.quant import QuantConfig


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=["stack"], meta_fields=["layers", "num_layers"]
)
@dataclasses.dataclass(frozen=True)
class LayerEntries(Sequence):
  """One cache field of every layer that has it, as one stack: `stack` (an array or an
  `fp4.QArray`) holds layer `layers[i]`'s entry at [i]. Reads like the tuple over all
  `num_layers` layers it stands for: item i is layer i's entry (a slice of the stack), None
  at a layer without this field."""

  stack: Any
  layers: tuple[int, ...]
  num_layers: int

  def position(self, layer: int) -> int:
    """Where layer `layer`'s entry sits in the stack."""
    return self.layers.index(layer)

  def __getitem__(self, layer):
    if isinstance(layer, slice):
      return tuple(self[i] for i in range(self.num_layers)[layer])
    if not -self.num_layers <= layer < self.num_layers:
      raise IndexError(f"layer {layer} of a {self.num_layers}-layer cache")
    layer %= self.num_layers
    if layer not in self.layers:
      return None
    return entry_at(self.stack, self.position(layer))

  def __len__(self) -> int:
    return self.num_layers

  def with_stack(self, stack) -> "LayerEntries":
    return dataclasses.replace(self, stack=stack)


def entry_at(stack, position):
  """The entry at `position` (an int or a traced int32 scalar) of a stack (array or QArray)."""
  return jax.tree.map(
    lambda a: jax.lax.dynamic_index_in_dim(a, position, axis=0, keepdims=False), stack
  )


def put_entry(stack, entry, position):
  """`stack` with its entry at `position` replaced by `entry` (a whole layer's entry)."""
  return jax.tree.map(
    lambda s, e: jax.lax.dynamic_update_index_in_dim(s, e.astype(s.dtype), position, axis=0),
    stack,
    entry,
  )


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["k", "v", "valid", "index", "conv", "recurrent"],
  meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Per-layer K and V, [B, L, Hkv, Dh] arrays or `fp4.QArray`s of that shape, each field
  a `LayerEntries` (one stack over the layers that have it, read per layer like a tuple).

  Attributes:
    k: by layer (None at linear-attention layers): the stack [n_attention, B, L, Hkv, Dh].
    v: as k.
    valid: bool [B, L]: the slot holds a real token.
    index: int32 scalar: the next slot to write (or [B], one per row: the slot pool's).
    conv: by layer: conv state [B, K-1, conv_dim] at linear-attention layers, else None;
      () for a model without them.
    recurrent: by layer: float32 [B, Hv, Dk, Dv] delta-rule state at linear-attention
      layers, else None; ().
  """

  k: LayerEntries
  v: LayerEntries
  valid: jax.Array
  index: jax.Array
  conv: LayerEntries | tuple = ()
  recurrent: LayerEntries | tuple = ()

  @property
  def max_len(self) -> int:
    return self.valid.shape[1]

  @property
  def quantized(self) -> bool:
    return isinstance(self.k.stack, fp4.QArray)

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
  linear = cfg.linear_layers
  attention = tuple(i for i in range(cfg.num_layers) if i not in linear)
  shape = (len(attention), batch, max_len, cfg.num_kv_heads, cfg.head_dim)

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

  by_layer = lambda stack, layers: LayerEntries(stack, layers, cfg.num_layers)  # noqa: E731
  conv = recurrent = ()
  if linear:
    linear = tuple(sorted(linear))
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
      cfg.linear_num_value_heads * cfg.linear_value_head_dim
    )
    n = len(linear)
    conv = by_layer(jnp.zeros((n, batch, cfg.linear_conv_kernel - 1, conv_dim), dtype), linear)
    heads = cfg.linear_num_value_heads
    recurrent = by_layer(
      jnp.zeros((n, batch, heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), jnp.float32),
      linear,
    )
  return KVCache(
    k=by_layer(entry("k"), attention),
    v=by_layer(entry("v"), attention),
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


def write_slots(stack, new, index: jax.Array, position, keep: jax.Array | None = None):
  """Write `new` ([B, T, ...] array or QArray) into slots [index, index + T) of the entry
  at `position` of `stack` (a `LayerEntries.stack`), in place of those slots only; an
  `index` per row [B] writes each row at its own slots.

  `keep` (bool scalar): False writes blank slots (`blank_like`) instead: a chunk with no
  valid token (a decode step after every sequence stopped, `rollout`'s stop-check interval)
  then leaves the cache as an unwritten slot would be.
  """
  if keep is not None:
    new = jax.tree.map(lambda n, z: jnp.where(keep, n, z), new, blank_like(new))

  def write(old, n):
    if jnp.ndim(index):  # an index per row [B] (the rollout's slot pool)
      rows = jnp.arange(n.shape[0])[:, None]
      cols = index[:, None] + jnp.arange(n.shape[1])
      return old.at[position, rows, cols].set(n.astype(old.dtype))
    at = (position, jnp.zeros((), jnp.int32), index) + (jnp.zeros((), jnp.int32),) * (n.ndim - 2)
    return jax.lax.dynamic_update_slice(old, n.astype(old.dtype)[None], at)

  return jax.tree.map(write, stack, new)


def read(entry, dtype) -> jax.Array:
  """The cached K or V [B, L, Hkv, Dh] in `dtype` (dequantized if FP4)."""
  if isinstance(entry, fp4.QArray):
    return fp4.dequantize(entry, dtype)
  return entry.astype(dtype)
