"""Expert-major tiles of routed rows, without a sort or a serial search.

A MoE layer's routed rows are the (token, slot) pairs r = token * k + slot, each bound for
expert e(r). The grouped FP4 GEMM runs one program per (tile, column block), a tile being
up to `block_m` rows of one expert, so every expert's weight tile is read once per column
block however many of its rows there are. The tiles are built with counts and prefix sums
only (XLA scans and scatters; no sort, no searchsorted loop, no host sync):

  1. rank[r]  = how many earlier rows chose e(r)        (prefix sum of a one-hot [R, E])
  2. count[e] = rows of expert e;  tiles[e] = cdiv(count[e], block_m)
  3. first[e] = exclusive prefix sum of tiles[e]        (the expert's first tile)
  4. row r goes to tile first[e(r)] + rank[r] // block_m, place rank[r] % block_m

The number of tiles is bounded statically (`max_tiles`: each expert with rows rounds up
once); unused tiles hold expert -1 and the kernel skips them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["tile_expert", "tile_rows", "row_position"],
  meta_fields=["num_rows", "top_k"],
)
@dataclasses.dataclass(frozen=True)
class RoutingTiles:
  """Expert-major tiles of routed rows.

  Attributes:
    tile_expert: int32 [T]: each tile's expert, -1 for an unused tile.
    tile_rows: int32 [T, block_m]: the rows (token * top_k + slot) of each tile, in
      increasing order, -1 for an empty place.
    row_position: int32 [R]: where row r sits in tile order (tile * block_m + place).
    num_rows: R, the routed rows (tokens * top_k).
    top_k: experts per token (a row's token is row // top_k).
  """

  tile_expert: jax.Array
  tile_rows: jax.Array
  row_position: jax.Array
  num_rows: int
  top_k: int

  @property
  def block_m(self) -> int:
    return self.tile_rows.shape[1]

  @property
  def num_tiles(self) -> int:
    return self.tile_rows.shape[0]

  def to_rows(self, tiled: jax.Array) -> jax.Array:
    """[T, block_m, ...] in tile order -> [R, ...] in row order (a gather)."""
    flat = tiled.reshape(self.num_tiles * self.block_m, *tiled.shape[2:])
    return flat[self.row_position]

  def first_slots(self, tiled: jax.Array) -> jax.Array:
    """[T, block_m, ...] of per-row values that only depend on a row's token -> [tokens,
    ...], read at each token's slot-0 row."""
    flat = tiled.reshape(self.num_tiles * self.block_m, *tiled.shape[2:])
    return flat[self.row_position[:: self.top_k]]


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
  """The static bound on the tiles `route_tiles` needs: at most min(R, E) experts have rows,
  and sum_e cdiv(count_e, block_m) <= (R + (block_m - 1) * active experts) / block_m."""
  return (num_rows + (block_m - 1) * min(num_rows, num_experts)) // block_m


def route_tiles(experts: jax.Array, num_experts: int, block_m: int) -> RoutingTiles:
  """Tiles of the rows of `experts` int [tokens, top_k] (see the module docstring)."""
  if experts.ndim != 2:
    raise ValueError(f"route_tiles: experts must be [tokens, top_k]; got {experts.shape}")
  if block_m < 1 or block_m & (block_m - 1):
    raise ValueError(f"route_tiles: block_m={block_m} must be a power of two")
  tokens, top_k = experts.shape
  num_rows = tokens * top_k
  flat = experts.reshape(-1).astype(jnp.int32)  # [R]
  one_hot = (flat[:, None] == jnp.arange(num_experts, dtype=jnp.int32)).astype(jnp.int32)
  earlier = jnp.cumsum(one_hot, axis=0) - one_hot  # [R, E]: rows before r, per expert
  rank = jnp.sum(earlier * one_hot, axis=1)  # [R]
  count = jnp.sum(one_hot, axis=0)  # [E]
  tiles = (count + block_m - 1) // block_m
  first = jnp.cumsum(tiles) - tiles  # [E]
  tile = jnp.sum(one_hot * first, axis=1) + rank // block_m  # [R]
  place = rank % block_m
  num_tiles = max_tiles(num_rows, num_experts, block_m)
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  tile_rows = jnp.full((num_tiles, block_m), -1, jnp.int32).at[tile, place].set(rows)
  # Every row of a tile names the same expert, so the duplicates agree.
  tile_expert = jnp.full((num_tiles,), -1, jnp.int32).at[tile].set(flat)
  return RoutingTiles(
    tile_expert=tile_expert,
    tile_rows=tile_rows,
    row_position=tile * block_m + place,
    num_rows=num_rows,
    top_k=top_k,
  )
