"""Sparse guidance (fp4/sparse.py) against an independent NumPy + ml_dtypes derivation.

The reference finds each rollout value's two E2M1 grid neighbours on the ml_dtypes grid,
flags it when |(|v| - midpoint)| / spacing <= delta, and expects the training path to land
on the rollout's code wherever it flagged (values nudged across the midpoint included), and
on nearest rounding of its own value (`reference.nvfp4`) everywhere else.
(One test is slow: `pytest -m slow tests/fp4/test_sparse.py`.)
"""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.fp4 import reference
from tests.fp4.test_ties import _bf16_ties
from trace_jax import fp4
from trace_jax.fp4 import numerics, sparse

F32 = np.float32
BF16 = ml_dtypes.bfloat16
GRID = np.unique(np.arange(8, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64))


def _reference_flags(x, delta):
  """Element flags of rows x [..., n] (float32) from the spec and the ml_dtypes grid."""
  codes, scale_bits, gs = reference.nvfp4(x, tuple(range(x.ndim - 1)))
  step = scale_bits.view(ml_dtypes.float8_e4m3fn).astype(F32) / gs
  blocks = x.reshape(*x.shape[:-1], -1, 16)
  v = np.abs(np.where(step[..., None] > 0, blocks / step[..., None], 0).astype(F32)).astype(
    np.float64
  )
  v = np.minimum(v, 6.0)
  hi = GRID[np.minimum(np.searchsorted(GRID, v, side="left"), len(GRID) - 1)]
  lo = GRID[np.maximum(np.searchsorted(GRID, v, side="right") - 1, 0)]
  spacing = np.where(hi > lo, hi - lo, 1.0)
  distance = np.where(hi > lo, np.abs(v - (lo + hi) / 2) / spacing, 0.5)
  flags = (hi > lo) & (distance <= delta)
  return flags.reshape(x.shape), distance.reshape(x.shape), codes


def _rows(rng, shape, scale=3.0):
  return (rng.standard_normal(shape) * scale).astype(BF16).astype(F32)


def _nudge(x, rng, frac=0.5):
  """Move a share of the elements (never the row max) by one bf16 ulp up or down: the
  bf16-level difference between the two execution paths."""
  bits = x.astype(BF16).view(np.uint16).astype(np.int32)
  step = rng.choice([-1, 1], x.shape) * (rng.random(x.shape) < frac)
  amax = np.abs(x) == np.abs(x).max(axis=-1, keepdims=True)
  nudged = (bits + np.where(amax | (x == 0), 0, step)).astype(np.uint16).view(BF16).astype(F32)
  return nudged


@pytest.mark.parametrize("delta", [0.0, 0.1])
def test_flags_and_bits_match_the_reference(delta):
  rng = np.random.default_rng(int(delta * 1000))
  x = _rows(rng, (6, 5, 64))
  flags, distance, codes = _reference_flags(x, delta)
  q = fp4.quantize(jnp.asarray(x), global_group="row")
  g = fp4.sparse_guidance(jnp.asarray(x), q, fp4.SparseSpec(delta=delta, capacity_frac=1.0))
  dense_flags, dense_bits, _, _ = sparse.expand(g, x.shape)
  clear = np.abs(distance - delta) > 1e-6  # leave the threshold's float rounding out
  np.testing.assert_array_equal(np.asarray(dense_flags)[clear], flags[clear])
  np.testing.assert_array_equal(np.asarray(g.count)[..., 0], np.asarray(dense_flags).sum(-1))
  np.testing.assert_array_equal(np.asarray(dense_bits)[flags], (codes & 1)[flags])
  if delta > 0:
    assert flags.sum() > 20


def test_bf16_exact_ties_are_flagged_and_followed():
  """bf16 values exactly at E2M1 midpoints (non-power-of-two steps): flagged at delta 0;
  a training value one ulp across the midpoint takes the rollout's neighbour."""
  rng = np.random.default_rng(7)
  x = _bf16_ties(rng, 32, 4)  # [32, 64]: every non-max element a tie
  q = fp4.quantize(jnp.asarray(x), global_group="row")
  g = fp4.sparse_guidance(jnp.asarray(x), q, fp4.SparseSpec(delta=0.0, capacity_frac=1.0))
  flags, distance, codes = _reference_flags(x, 0.0)
  assert (distance == 0).sum() > 1500 and flags.sum() == (distance == 0).sum()
  np.testing.assert_array_equal(np.asarray(sparse.expand(g, x.shape)[0]), flags)
  x_train = _nudge(x, rng, frac=1.0)
  nearest = reference.nvfp4(x_train, (0,))[0]
  assert ((nearest != codes) & flags).sum() > 500  # nearest would leave the rollout's code
  guided = fp4.quantize(jnp.asarray(x_train), global_group="row", rounding="guided", guidance=g)
  np.testing.assert_array_equal(np.asarray(fp4.codes(guided))[flags], codes[flags])


@pytest.mark.slow  # ~15 s of compiles; the tie test covers following in the default suite
def test_training_path_follows_flags_and_rounds_nearest_elsewhere():
  rng = np.random.default_rng(3)
  x = _rows(rng, (4, 8, 128))
  x_train = _nudge(x, rng)
  delta = 0.05
  flags, _, codes = _reference_flags(x, delta)
  q = fp4.quantize(jnp.asarray(x), global_group="row")
  g = fp4.sparse_guidance(
    jnp.asarray(x), q, fp4.SparseSpec(delta=delta, capacity_frac=1.0, scale_delta=0.0)
  )
  got = np.asarray(
    fp4.codes(fp4.quantize(jnp.asarray(x_train), global_group="row", rounding="guided", guidance=g))
  )
  own_codes, own_scales, _ = reference.nvfp4(x_train, (0, 1))
  flagged = np.asarray(sparse.expand(g, x.shape)[0])
  same_scale = np.repeat(own_scales == np.asarray(q.scales), 16, axis=-1)
  np.testing.assert_array_equal(got[~flagged], own_codes[~flagged])  # nearest, own scales
  follow = flagged & same_scale
  np.testing.assert_array_equal(got[follow], codes[follow])
  assert (own_codes[follow] != codes[follow]).sum() > 10  # guidance changed something
  # Far from every boundary nothing is recorded and the guided path is nearest rounding.
  on_grid = np.asarray(reference.nvfp4(x, (0, 1))[0])
  x_grid = (
    reference.e2m1_values(on_grid)
    * np.repeat(
      (own_scales.view(ml_dtypes.float8_e4m3fn).astype(F32) / reference.nvfp4(x, (0, 1))[2]), 16, -1
    )
  ).astype(F32)
  q_grid = fp4.quantize(jnp.asarray(x_grid), global_group="row")
  g_grid = fp4.sparse_guidance(jnp.asarray(x_grid), q_grid, fp4.SparseSpec(delta=0.2))
  assert int(np.asarray(g_grid.count).sum()) == 0


def test_far_values_need_no_record():
  """Values at least 0.3 grid units from every midpoint: no element is flagged at
  delta 0.2, and guided rounding equals nearest rounding."""
  rng = np.random.default_rng(11)
  grid = np.asarray([0, 0.5, 1, 1.5, 2, 3, 4], F32)
  spacing = np.asarray([0.5, 0.5, 0.5, 0.5, 1, 1, 2], F32)
  pick = rng.integers(0, len(grid), (8, 64))
  x = grid[pick] + rng.uniform(0, 0.2, (8, 64)).astype(F32) * spacing[pick]  # spacing above
  x = (np.abs(x) * rng.choice([-1, 1], x.shape)).astype(BF16).astype(F32)
  x[:, ::16] = 6.0  # every block's amax 6: gs = 448, s_b = 448, step 1, v = x
  _, distance, _ = _reference_flags(x, 0.2)
  assert (distance >= 0.29).all()
  q = fp4.quantize(jnp.asarray(x), global_group="row")
  g = fp4.sparse_guidance(jnp.asarray(x), q, fp4.SparseSpec(delta=0.2, scale_delta=0.0))
  assert int(np.asarray(g.count).sum()) == 0
  bits = sparse.site_bits(g)
  assert bits["flagged"] == 0 and bits["bits"] == 0
  chex.assert_trees_all_equal(
    fp4.fake_quant(jnp.asarray(x), global_group="row", rounding="guided", guidance=g),
    fp4.fake_quant(jnp.asarray(x), global_group="row"),
  )


def test_overflow_is_counted_and_overflowed_flags_round_nearest():
  x = np.full((2, 64), 2.5, F32)  # every element an exact tie (step 1: amax 6)
  x[1] = 1.25
  x[:, ::16] = 6.0
  q = fp4.quantize(jnp.asarray(x), global_group="row")
  spec = fp4.SparseSpec(delta=0.0, capacity_frac=0.125)  # 8 per row of 64
  g = fp4.sparse_guidance(jnp.asarray(x), q, spec)
  assert g.capacity == 8
  np.testing.assert_array_equal(np.asarray(g.count)[:, 0], [60, 60])
  np.testing.assert_array_equal(np.asarray(g.overflow)[:, 0], [52, 52])
  assert sparse.site_bits(jax.tree.map(lambda a: a[None], g))["overflow"] == 104
  flags = np.asarray(sparse.expand(g, x.shape)[0])
  np.testing.assert_array_equal(flags.sum(-1), [8, 8])
  np.testing.assert_array_equal(np.nonzero(flags[0])[0], np.arange(1, 9))  # the first eight


def test_block_scales_near_an_e4m3_midpoint_are_flagged_and_used():
  """A block whose ideal scale is an exact E4M3 midpoint is flagged at scale_delta 0; the
  training path uses the recorded bits there even if its own ideal falls on the other side."""
  mids = np.asarray([2.125, 2.375, 3.875, 5.25, 6.75], F32)  # E4M3 midpoints in [2, 8)
  x = np.zeros((len(mids), 32), F32)
  x[:, 0] = 448 * 6 / 256  # row amax 10.5: gs = 256
  x[:, 16] = mids * 6 / 256  # block 1 ideal scale = the midpoint exactly (bf16-exact)
  x[:, 17:20] = x[:, 16:17] / 2
  assert np.array_equal(x.astype(BF16).astype(F32), x)
  q = fp4.quantize(jnp.asarray(x), global_group="row")
  g = fp4.sparse_guidance(jnp.asarray(x), q, fp4.SparseSpec(delta=0.0, scale_delta=0.0))
  np.testing.assert_array_equal(np.asarray(g.block_count)[:, 0], 1)
  np.testing.assert_array_equal(np.asarray(g.block_index)[:, 0], 1)
  x_train = x.copy()
  x_train[:, 16] = np.nextafter(x[:, 16], np.float32(np.inf))
  own = reference.nvfp4(x_train, (0,))[1]
  assert (own[:, 1] != np.asarray(q.scales)[:, 1]).any()  # its own scale would flip
  guided = fp4.quantize(jnp.asarray(x_train), global_group="row", rounding="guided", guidance=g)
  np.testing.assert_array_equal(guided.scales, q.scales)


def test_e4m3_grid_units_put_every_e4m3_value_on_the_grid_and_midpoints_at_half():
  values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)
  values = np.unique(values[np.isfinite(values) & (values >= 0)])
  _, units = numerics.e4m3_grid_units(jnp.asarray(values))
  np.testing.assert_array_equal(np.asarray(units) % 1, 0)
  mids = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(F32)
  _, units = numerics.e4m3_grid_units(jnp.asarray(mids))
  np.testing.assert_array_equal(np.asarray(units) % 1, 0.5)
  np.testing.assert_array_equal(np.asarray(sparse.e4m3_boundary_distance(jnp.asarray(mids))), 0)


def test_encoded_sizes_by_hand():
  """One token, one row of 16 with flags at 0 and 5."""
  index = np.asarray([0, 5, 0, 0, 0, 0, 0, 0], np.uint8).reshape(1, 1, 8)
  count = np.asarray([2]).reshape(1, 1, 1)
  sizes = sparse.encoded_bits(index, count, 16)
  # bitmap 16; run lengths 3 runs of ceil(log2 17) = 5 bits; index deltas: gaps 0 and 4,
  # Golomb-Rice r=0: (1 + 0) * 2 + 4 = 6 (r=1: 4 + 2 = 6), + 4-bit header + gamma(3) = 3.
  assert sizes == {"bitmap": 16, "runlength": 15, "index_deltas": 13}


def test_jit_scan_and_grad():
  rng = np.random.default_rng(5)
  x = jnp.asarray(_rows(rng, (3, 4, 32)))
  q = fp4.quantize(x, global_group="row")
  g = jax.jit(fp4.sparse_guidance, static_argnums=2)(x, q, fp4.SparseSpec(delta=0.1))
  chex.assert_trees_all_equal(g, fp4.sparse_guidance(x, q, fp4.SparseSpec(delta=0.1)))
  f = lambda x, g: fp4.fake_quant(x, global_group="row", rounding="guided", guidance=g)  # noqa: E731
  eager = f(x, g)
  chex.assert_trees_all_equal(jax.jit(f)(x, g), eager)
  _, scanned = jax.lax.scan(lambda c, xg: (c, f(*xg)), None, (x, g))
  chex.assert_trees_all_equal(scanned, eager)
  grad = jax.grad(lambda x: jnp.sum(f(x, g) * jnp.arange(32.0)))(x)
  chex.assert_trees_all_close(grad, jnp.broadcast_to(jnp.arange(32.0), x.shape))


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match="delta"):
    fp4.SparseSpec(delta=0.7)
  with pytest.raises(ValueError, match="capacity_frac"):
    fp4.SparseSpec(capacity_frac=0)
  x = jnp.ones((2, 32))
  with pytest.raises(ValueError, match="nvfp4"):
    fp4.sparse_guidance(jnp.ones((2, 64)), fp4.quantize(jnp.ones((2, 64)), "mxfp4"))
  g = fp4.sparse_guidance(x, fp4.quantize(x, global_group="row"))
  with pytest.raises(ValueError, match="sparse guidance was recorded"):
    fp4.quantize(jnp.ones((2, 48)), global_group="row", rounding="guided", guidance=g)


def test_per_site_margins():
  spec = fp4.SparseSpec(delta=0.07, site_deltas=(("k", 0.01), ("v", 0.0)))
  assert (spec.for_site("k").delta, spec.for_site("v").delta, spec.for_site("attn_out").delta) == (
    0.01,
    0.0,
    0.07,
  )
  assert spec.for_site("k").site_deltas == ()
  with pytest.raises(ValueError, match=r"site_deltas\['k'\]"):
    fp4.SparseSpec(site_deltas=(("k", 0.6),))
