"""Building blocks: RMSNorm, rotary embeddings, SwiGLU, parameter init, matmuls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def normal_param(rngs: nnx.Rngs, shape, std: float) -> nnx.Param:
  return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


class RMSNorm(nnx.Module):
  """x * rsqrt(mean(x^2) + eps) * scale, normalised in float32 (as Hugging Face does)."""

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale.get_value().astype(x.dtype) * normed.astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, T, head_dim] for integer positions [B, T] (Hugging Face "default" RoPE)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, head_dim / 2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, H, Dh] rotated by the half-split ("rotate_half") convention."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  cos = cos[:, :, None, :].astype(x.dtype)
  sin = sin[:, :, None, :].astype(x.dtype)
  return x * cos + rotated * sin


def _precision(dtype):
  """Full float32 products for float32 compute (exactness tests); the default otherwise."""
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., in] @ w [in, out] with float32 accumulation, returned in x's dtype."""
  y = jnp.einsum("...i,io->...o", x, w, precision=_precision(x.dtype),
                 preferred_element_type=jnp.float32)
  return y.astype(x.dtype)


def ragged_matmul(lhs: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """Rows of lhs [R, in] sorted by group @ w [groups, in, out] (`jax.lax.ragged_dot`),
  float32 accumulation, returned in lhs's dtype."""
  return jax.lax.ragged_dot(lhs, w, group_sizes, precision=_precision(lhs.dtype),
                            preferred_element_type=jnp.float32).astype(lhs.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up
