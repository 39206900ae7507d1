"""A controlled difference between two engines: each layer's output scaled by 1 + amount * u.

A rollout engine whose kernels accumulate in another order than the trainer's computes a
slightly different residual stream: bf16-level relative differences that FP4 rounding then
amplifies (codes flip near their boundaries, routing changes). `Skew` emulates that on one
path. After every layer the residual stream x [B, T, d] becomes x * (1 + amount * u), where
u in [-1, 1) is a counter-based hash of (policy version, sequence, position, layer, element):

  u = skew_uniform(version, sequence, position, layer, element)

The hash is MurmurHash3 (x86, 32 bit, seed 0) of the five counters as little-endian uint32
words, its top 24 bits mapped to the odd multiples of 2^-24 in (-1, 1); every step is
integer arithmetic on device, no PRNG state. Positions are the RoPE positions (each
sequence's own token count), so a position gives the same u whether it is prefilled with the
whole sequence or decoded one token at a time.

What it is not: real kernel error is structured (correlated across elements, positions and
steps, and larger where values cancel); this is i.i.d.-like multiplicative noise on the
residual stream only. Attention scores, expert outputs and logits change only through it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

_C1, _C2 = 0xCC9E2D51, 0x1B873593
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35
WORDS = 5  # version, sequence, position, layer, element


def check_amount(value, field: str) -> None:
  """A ValueError naming `field` unless `value` is a finite number >= 0."""
  ok = (
    isinstance(value, (int, float))
    and not isinstance(value, bool)
    and math.isfinite(value)
    and value >= 0
  )
  if not ok:
    raise ValueError(
      f"{field}={value!r} is not allowed; it must be a finite number >= 0 (the relative "
      "size of the rollout's per-layer perturbation; 0: none)"
    )


def _u32(x) -> jax.Array:
  return jnp.asarray(x).astype(jnp.uint32)


def _rotl(x: jax.Array, r: int) -> jax.Array:
  return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def murmur3_words(*words) -> jax.Array:
  """MurmurHash3_x86_32 (seed 0) of the little-endian uint32 words, broadcast together:
  uint32 of the broadcast shape."""
  h = jnp.zeros((), jnp.uint32)
  for word in words:
    k = _u32(word) * jnp.uint32(_C1)
    k = _rotl(k, 15) * jnp.uint32(_C2)
    h = _rotl(h ^ k, 13) * jnp.uint32(5) + jnp.uint32(0xE6546B64)
  h = h ^ jnp.uint32(4 * len(words))
  h = (h ^ (h >> jnp.uint32(16))) * jnp.uint32(_M1)
  h = (h ^ (h >> jnp.uint32(13))) * jnp.uint32(_M2)
  return h ^ (h >> jnp.uint32(16))


def skew_uniform(version, sequence, position, layer, element) -> jax.Array:
  """float32 u in (-1, 1), one per broadcast element of the five counters: the top 24 bits
  of their hash, (2k + 1) * 2^-24 - 1 for k in [0, 2^24) (exact in float32, symmetric)."""
  k = murmur3_words(version, sequence, position, layer, element) >> jnp.uint32(8)
  return (k.astype(jnp.float32) * 2.0**-23 - 1.0) + 2.0**-24


@struct.dataclass
class Skew:
  """One call's skew: `amount` (static: 0 leaves the multiply out of the program), the
  policy version that computes, and each row's sequence id (the counters of the hash)."""

  amount: float = struct.field(pytree_node=False)
  version: jax.Array  # uint32 []
  sequence: jax.Array  # uint32 [B]

  @classmethod
  def of(cls, amount: float, version, sequence) -> "Skew | None":
    """The skew of `amount` at `version` for rows `sequence` [B]; None when amount is 0."""
    check_amount(amount, "Skew.amount")
    if not amount:
      return None
    return cls(amount=float(amount), version=_u32(version), sequence=_u32(sequence))

  def apply(self, x: jax.Array, positions: jax.Array, layer: int) -> jax.Array:
    """x [B, T, d] (the residual stream after `layer`) times 1 + amount * u, in float32,
    returned in x's dtype; `positions` int [B, T], the RoPE positions."""
    b, t, d = x.shape
    u = skew_uniform(
      self.version,
      jnp.broadcast_to(self.sequence, (b,))[:, None, None],
      positions[:, :, None],
      layer,
      jnp.arange(d, dtype=jnp.uint32)[None, None, :],
    )
    return (x.astype(jnp.float32) * (1.0 + self.amount * u)).astype(x.dtype)
