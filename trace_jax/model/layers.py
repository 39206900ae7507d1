"""Building blocks: RMSNorm, rotary embeddings, SwiGLU, matmuls, and what every block reads
of a forward's token layout (`LayerInputs`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec as P

from trace_jax.model.parameters import MESH_AXES, param


@struct.dataclass
class LayerInputs:
  """What every block of one forward reads besides the residual stream (the same for all
  layers: made once by `Transformer.__call__`)."""

  cos: jax.Array  # [B, T, rotary_dim] RoPE tables at the tokens' positions
  sin: jax.Array  # [B, T, rotary_dim]
  attn_mask: jax.Array  # bool [B, T, S]: keys each query attends to (S = T, or cache slots)
  valid: jax.Array  # bool [B, T]: real tokens (False: padding)
  start: jax.Array  # int32 []: the first cache slot this forward writes (0 without a cache)


class RMSNorm(nnx.Module):
  """x * rsqrt(mean(x^2) + eps) * scale, normalised in float32 (as Hugging Face does).

  `zero_centered` (Qwen3.5): the scale is (1 + w) with w initialised at 0 and the product
  taken in float32 before the cast, as Hugging Face's Qwen3_5MoeRMSNorm does; otherwise
  scale * normed in the input dtype (Llama / Qwen3 order).
  """

  def __init__(self, dim: int, eps: float, zero_centered: bool = False):
    self.scale = param(
      jnp.full((dim,), 0.0 if zero_centered else 1.0, jnp.float32), sharding=(None,)
    )
    self.eps = eps
    self.zero_centered = zero_centered

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.zero_centered:
      return (normed * (1.0 + self.scale.get_value().astype(jnp.float32))).astype(x.dtype)
    return self.scale.get_value().astype(x.dtype) * normed.astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, T, head_dim] for integer positions [B, T] (Hugging Face "default" RoPE).

  For partial rotary embeddings pass the rotary dim as `head_dim`: the frequencies are
  those of a head of that width (Hugging Face: dim = int(head_dim * partial_rotary_factor))."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, head_dim / 2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, H, Dh] rotated by the half-split ("rotate_half") convention; with tables
  narrower than Dh (partial RoPE) only the first cos.shape[-1] dims rotate."""
  rotary = cos.shape[-1]
  if rotary < x.shape[-1]:
    return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)
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
  y = jnp.einsum(
    "...i,io->...o", x, w, precision=_precision(x.dtype), preferred_element_type=jnp.float32
  )
  return y.astype(x.dtype)


def ragged_matmul(
  lhs: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile: int | None = None
) -> jax.Array:
  """Rows of lhs [R, in] sorted by group @ w [groups, in, out]: `jax.lax.ragged_dot`'s
  function (rows past sum(group_sizes) give zeros), float32 accumulation, returned in lhs's
  dtype. Batched: lhs [blocks, R, in] with group_sizes [blocks, groups], each block its own
  rows against the same weights.

  XLA lowers ragged_dot densely on CPU and GPU: every row against every group's weights,
  one dot with G times the work (8x on `small`, 128x on Qwen3-30B-A3B), and its gradients
  likewise. Here each group's rows are laid into whole tiles of `tile_rows(R, G)` rows (its
  last tile zero-filled) and one batched matmul multiplies every tile by its group's
  weights: about R + G * tile rows of work, its gradients the same. The products are the
  same and each output sums over `in` only, so the result matches ragged_dot's up to the
  order of the float32 sum (tests/model/test_layers.py compares them).

  The tiles' weights are gathered, [tiles, in, out]: `tile` (default `tile_rows(R, groups)`,
  about 9 tiles per group) trades that gather against the padded rows.
  """
  if lhs.ndim == 3:
    axis = block_axis(lhs.shape[0])
    tiled = functools.partial(
      _tiled_matmul, tile=tile or tile_rows(lhs.shape[1], w.shape[0]), pinned=axis is not None
    )
    return jax.vmap(tiled, in_axes=(0, None, 0), spmd_axis_name=axis)(lhs, w, group_sizes)
  return _tiled_matmul(lhs, w, group_sizes, tile=tile or tile_rows(lhs.shape[0], w.shape[0]))


def block_axis(blocks: int) -> str | None:
  """The mesh axis a batched `ragged_matmul`'s `blocks` lie along: "data" when the ambient
  mesh (`jax.set_mesh`) splits it into that many shards (`CallOptions.moe_blocks` =
  `sharding.data_shards`), else None (no mesh: the call traces as without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  axis = MESH_AXES[0]
  if mesh.empty or axis not in mesh.axis_names or mesh.shape[axis] == 1:
    return None
  return axis if mesh.shape[axis] == blocks else None


def _on_own_shard(x: jax.Array) -> jax.Array:
  """x held on its own block's shard (under `vmap(spmd_axis_name=...)` the mapped axis takes
  the mesh axis), its other dimensions left to the partitioner."""
  return jax.lax.with_sharding_constraint(x, P(*(P.UNCONSTRAINED,) * x.ndim))


def _tiled_matmul(
  lhs: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile: int, pinned: bool = False
):
  """One block's `ragged_matmul`. `pinned` (a batched call's blocks on the "data" shards,
  `block_axis`): its tiles, their gathered weights and their products stay on the block's
  own shard, so each device gathers whole weights (FSDP's all-gather) and multiplies its
  own rows. Unpinned on such a mesh, GSPMD kept the weights split over d_model and
  gathered every block's tiles to every data shard, each device summing a d_model slice of
  every block's products in float32 (the update of Qwen3.5-35B-A3B on 8 x 8 x 1: [8, 512,
  256, 512] per matrix and layer on each device, twice the collective bytes)."""
  keep = _on_own_shard if pinned else (lambda x: x)
  rows, width = lhs.shape
  groups, _, out = w.shape
  tiles = tile_count(rows, groups, tile)
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  group_tiles = -(-sizes // tile)
  tile_ends = jnp.cumsum(group_tiles)
  row = jnp.arange(rows, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), groups - 1)
  # each row's slot in the tiled layout; rows past the groups go out of range (dropped)
  slot = (tile_ends[group] - group_tiles[group]) * tile + row - starts[group]
  slot = jnp.where(row < ends[-1], slot, tiles * tile)
  # each slot's row (`rows`, out of range, for the padding): the tiles are gathered from lhs,
  # so the backward keeps only these indices (a scatter into zeros would keep the zeros)
  source = jnp.full((tiles * tile,), rows, jnp.int32)
  source = source.at[slot].set(row, mode="drop", unique_indices=True)
  tiled = keep(lhs.at[source].get(mode="fill", fill_value=0, unique_indices=True))
  tile_group = jnp.searchsorted(tile_ends, jnp.arange(tiles, dtype=jnp.int32), side="right")
  y = jnp.einsum(
    "nti,nio->nto",
    tiled.reshape(tiles, tile, width),
    keep(w[jnp.minimum(tile_group, groups - 1)]),  # tiles past the last group: zeros, any weights
    precision=_precision(lhs.dtype),
    preferred_element_type=jnp.float32,
  )
  y = (
    keep(y).reshape(tiles * tile, out).at[slot].get(mode="fill", fill_value=0, unique_indices=True)
  )
  return keep(y.astype(lhs.dtype))


def tile_rows(rows: int, groups: int, tiles_per_group: int = 8, largest: int | None = 256) -> int:
  """`ragged_matmul`'s tile height: a power of two from 8 to `largest` (None: no bound),
  about rows / (`tiles_per_group` x groups). At 8 the padding (up to a tile per group) stays
  near 1/8 of the rows and the tiles large; the weights gathered per tile are then about 9
  copies of every group's. At 1, unbounded, they are about 2 copies, for up to twice the
  rows of work."""
  tile = 8
  while (largest is None or tile < largest) and tile * tiles_per_group * groups < rows:
    tile *= 2
  return tile


def block_tile_rows(rows: int, groups: int) -> int:
  """The tile height of one block of a blocked dispatch (`CallOptions.moe_blocks` > 1): one
  tile per group, unbounded. A block's gathered tile weights, not its products, bound its
  memory; they stay within twice the groups' weights, for under four times the rows of
  work (the tiles past the last group included)."""
  return tile_rows(rows, groups, tiles_per_group=1, largest=None)


def tile_count(rows: int, groups: int, tile: int) -> int:
  """`ragged_matmul`'s static number of tiles: the sum over groups of ceil(size / tile) is
  at most this."""
  return -(-rows // tile) + groups


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up
