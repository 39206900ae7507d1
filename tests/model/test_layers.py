"""`layers.ragged_matmul` (tiled grouped matmul) against `jax.lax.ragged_dot`, its definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.model.layers import ragged_matmul, tile_rows


def _reference(lhs, w, sizes):
  return jax.lax.ragged_dot(
    lhs.astype(jnp.float32),
    w.astype(jnp.float32),
    sizes,
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )


def _case(rng, rows, width, out, groups, dtype, fill=1.0):
  """Random rows and weights; random group sizes (one group empty) covering `fill` of the
  rows (the rest past every group)."""
  lhs = jnp.asarray(rng.standard_normal((rows, width)), dtype)
  w = jnp.asarray(rng.standard_normal((groups, width, out)), dtype)
  share = rng.dirichlet(np.ones(groups))
  share[rng.integers(groups)] = 0
  sizes = np.floor(share / share.sum() * rows * fill).astype(np.int32)
  sizes[np.argmax(sizes)] += int(rows * fill) - sizes.sum()
  return lhs, w, jnp.asarray(sizes)


@pytest.mark.parametrize(
  "rows, width, out, groups, fill",
  [(300, 64, 48, 5, 1.0), (1000, 32, 16, 8, 0.9), (40, 16, 24, 8, 1.0), (3000, 16, 8, 4, 1.0)],
)
def test_ragged_matmul_matches_ragged_dot_float32(rows, width, out, groups, fill):
  """Every row against its group's weights, rows past the groups zero, like ragged_dot; and
  the gradients of a random projection of the output likewise."""
  rng = np.random.default_rng(rows + groups)
  lhs, w, sizes = _case(rng, rows, width, out, groups, jnp.float32, fill)
  got = jax.jit(ragged_matmul)(lhs, w, sizes)
  want = _reference(lhs, w, sizes)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[int(sizes.sum()) :] == 0)
  probe = jnp.asarray(rng.standard_normal((rows, out)), jnp.float32)
  loss = lambda f: lambda a, b: jnp.sum(f(a, b, sizes) * probe)  # noqa: E731
  got_grads = jax.jit(jax.grad(loss(ragged_matmul), argnums=(0, 1)))(lhs, w)
  want_grads = jax.grad(loss(_reference), argnums=(0, 1))(lhs, w)
  for g, r in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_ragged_matmul_bf16_rounds_the_float32_sum():
  """bf16 rows and weights: float32 accumulation, one rounding to bf16 at the end (within one
  bf16 step of the exact float32 result)."""
  rng = np.random.default_rng(7)
  lhs, w, sizes = _case(rng, 2048, 128, 64, 8, jnp.bfloat16)
  got = jax.jit(ragged_matmul)(lhs, w, sizes)
  assert got.dtype == jnp.bfloat16
  want = np.asarray(_reference(lhs, w, sizes))
  step = np.abs(want) * 2.0**-8 + 1e-30  # one bf16 ulp is at most 2^-7 relative
  assert np.all(np.abs(np.asarray(got, np.float32) - want) <= step + 1e-4)


def test_ragged_matmul_blocks_each_multiply_their_own_rows():
  """lhs [blocks, R, in] with group sizes [blocks, G]: each block is ragged_dot of its own
  rows against the shared weights, at the default tile and at one tile per group (the
  weights gathered about twice); its gradients likewise."""
  rng = np.random.default_rng()
  rows, width, out, groups = 200, 32, 24, 6
  cases = [_case(rng, rows, width, out, groups, jnp.float32, fill) for fill in (1.0, 0.7, 0.9)]
  lhs = jnp.stack([c[0] for c in cases])
  w = cases[0][1]
  sizes = jnp.stack([c[2] for c in cases])
  want = jnp.stack([_reference(a, w, n) for a, n in zip(lhs, sizes)])
  for tile in (None, tile_rows(rows, groups, tiles_per_group=1)):
    fn = lambda a, b, n, tile=tile: ragged_matmul(a, b, n, tile=tile)  # noqa: E731
    got = jax.jit(fn)(lhs, w, sizes)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(tile))
    for block, n in enumerate(np.asarray(sizes)):
      assert np.all(np.asarray(got[block])[int(n.sum()) :] == 0)
  probe = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
  tile = tile_rows(rows, groups, tiles_per_group=1)
  got_grads = jax.jit(
    jax.grad(lambda a, b: jnp.sum(ragged_matmul(a, b, sizes, tile=tile) * probe), (0, 1))
  )(lhs, w)
  reference = lambda a, b: jnp.stack([_reference(x, b, n) for x, n in zip(a, sizes)])  # noqa: E731
  want_grads = jax.grad(lambda a, b: jnp.sum(reference(a, b) * probe), (0, 1))(lhs, w)
  for g, r in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_tile_rows_per_group():
  """`tiles_per_group`: the tile is the power of two from 8 (up to `largest`) at or just
  above rows / (tiles_per_group x groups), so the tiles number at most (tiles_per_group +
  1) x groups unless `largest` stops it; unbounded at one per group, under 4 x rows of
  work."""
  rng = np.random.default_rng()
  for _ in range(100):
    rows, groups = int(rng.integers(1, 500_000)), int(rng.integers(1, 200))
    per, largest = int(rng.integers(1, 9)), [256, 1024, None][int(rng.integers(3))]
    tile = tile_rows(rows, groups, tiles_per_group=per, largest=largest)
    case = (rows, groups, per, largest, tile)
    assert tile >= 8 and tile & (tile - 1) == 0 and (largest is None or tile <= largest), case
    assert tile == 8 or (tile // 2) * per * groups < rows, case
    if tile != largest:
      assert -(-rows // tile) + groups <= (per + 1) * groups, case
    if per == 1 and largest is None:
      assert (-(-rows // tile) + groups) * tile < 4 * rows + 8 * (groups + 1), case


def test_tile_rows_keeps_padding_small():
  """Tiles are powers of two from 8 to 256, at most one tile of padding per group, which is
  at most ~1/8 of the rows once there are enough rows to tile."""
  for rows, groups in [(256, 8), (12288, 8), (100_000, 128), (5, 4)]:
    tile = tile_rows(rows, groups)
    assert tile in (8, 16, 32, 64, 128, 256)
    if tile < 256 and tile > 8:
      assert tile * groups <= rows / 4
