"""The Guidance pytree: bytes accounting, host/device moves, disk spill, fit checks."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax import guidance as G

B, S = 3, 10
# tiny: d_model 64, 4 heads x 16, 2 KV heads x 16, top-2 of 4 experts with width 64.
SITE_SHAPES = {
  "attn_in": (64,),
  "attn_out": (64,),
  "k": (2, 16),
  "v": (2, 16),
  "moe_in": (64,),
  "moe_mid": (2, 64),
}


def _records(seed=0, layers=(0, 1)):
  key = jax.random.key(seed)
  records = {}
  for layer in layers:
    for site, shape in SITE_SHAPES.items():
      key, sub = jax.random.split(key)
      x = jax.random.normal(sub, (B, S, *shape))
      records[(layer, site)] = fp4.quantize(x, global_group="row")
  return records


def _guidance(mode, layers=(1,)):
  routing = jax.random.randint(jax.random.key(9), (2, B, S, 2), 0, 4).astype(jnp.int8)
  return G.Guidance(
    sites=G.from_records(_records(), mode, layers), routing=routing, mode=mode, layers=tuple(layers)
  )


def test_bytes_per_token_by_hand():
  # Per row of n elements: compact n/8 (bits) + n/16 (E4M3 scales) + 4 (f32 global scale),
  # full n/2 (codes) + n/16 + 4. Rows per token: 1 for attn_in/attn_out/moe_in (n = 64),
  # 2 KV heads (n = 16) for k and v, top-2 experts (n = 64) for moe_mid.
  compact_row = {64: 8 + 4 + 4, 16: 2 + 1 + 4}
  full_row = {64: 32 + 4 + 4, 16: 8 + 1 + 4}
  rows = {
    "attn_in": (1, 64),
    "attn_out": (1, 64),
    "k": (2, 16),
    "v": (2, 16),
    "moe_in": (1, 64),
    "moe_mid": (2, 64),
  }
  routing = 2 * 2 * 1  # 2 MoE layers x top-2 x int8
  compact = sum(r * compact_row[n] for r, n in rows.values()) + routing
  full = sum(r * full_row[n] for r, n in rows.values()) + routing
  assert _guidance("compact").bytes_per_token() == compact == 112
  assert _guidance("full").bytes_per_token() == full == 256
  both_layers = _guidance("compact", layers=(0, 1))
  assert both_layers.bytes_per_token() == 2 * (compact - routing) + routing
  parts = _guidance("full").nbytes()
  assert parts["total"] == parts["scales"] + parts["bits"] + parts["routing"]


def test_compact_is_the_mantissa_bits_of_full():
  compact, full = _guidance("compact"), _guidance("full")
  for key in compact.sites:
    np.testing.assert_array_equal(
      compact.sites[key].mantissa_bits, fp4.mantissa_bits(full.sites[key])
    )


def test_host_device_round_trip_and_disk_spill(tmp_path):
  g = _guidance("compact")
  host = g.to_host()
  assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(host))
  back = host.to_device()
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(back))
  jax.tree.map(np.testing.assert_array_equal, back, g)
  for mode in ("compact", "full"):
    g = _guidance(mode)
    path = tmp_path / f"{mode}.npz"
    g.save(str(path))
    loaded = G.Guidance.load(str(path))
    assert loaded.mode == mode and loaded.layers == g.layers
    assert jax.tree.structure(loaded) == jax.tree.structure(g)
    jax.tree.map(np.testing.assert_array_equal, loaded, g)
  assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_select_layers_and_without_routing():
  g = _guidance("compact", layers=(0, 1))
  one = g.select_layers([1])
  assert one.layers == (1,) and {k[0] for k in one.sites} == {1}
  with pytest.raises(ValueError, match="not guided"):
    _guidance("compact", layers=(1,)).select_layers([0])
  assert g.without_routing().routing is None


def test_check_fits_says_what_differs():
  g = _guidance("compact")
  required = {(1, site) for site in SITE_SHAPES}
  G.check_fits(g, tokens_shape=(B, S), required=required, num_moe_layers=2, mode="compact")
  with pytest.raises(ValueError, match="3 sequences x 10 slots; the batch is 3 x 12"):
    G.check_fits(g, tokens_shape=(B, 12), required=required)
  with pytest.raises(ValueError, match="missing \\[0\\]"):
    G.check_fits(g, tokens_shape=(B, S), required=required | {(0, "k")})
  with pytest.raises(ValueError, match="mode is 'compact'; the training config expects 'full'"):
    G.check_fits(g, tokens_shape=(B, S), required=required, mode="full")
  with pytest.raises(ValueError, match="lacks sites"):
    G.check_fits(g, tokens_shape=(B, S), required=required | {(1, "shared_mid")})
  with pytest.raises(ValueError, match="routing"):
    G.check_fits(g.without_routing(), tokens_shape=(B, S), required=required, num_moe_layers=2)
  with pytest.raises(ValueError, match="covers 2 MoE layers; the model has 3"):
    G.check_fits(g, tokens_shape=(B, S), required=required, num_moe_layers=3)
  with pytest.raises(ValueError, match="Guidance.mode='partial'"):
    G.Guidance(sites={}, routing=None, mode="partial", layers=())


def _sparse(delta=0.05, seed=0, layers=(0, 1)):
  """Sparse guidance of fresh bf16-valued site inputs, with the full records they came from."""
  key = jax.random.key(100 + seed)
  inputs, records = {}, {}
  for layer in layers:
    for site, shape in SITE_SHAPES.items():
      key, sub = jax.random.split(key)
      x = (3 * jax.random.normal(sub, (B, S, *shape))).astype(jnp.bfloat16).astype(jnp.float32)
      inputs[(layer, site)] = x
      records[(layer, site)] = fp4.quantize(x, global_group="row")
  full = G.Guidance(sites=records, routing=None, mode="full", layers=tuple(layers))
  return full.to_sparse(inputs, fp4.SparseSpec(delta=delta)), full, inputs


def test_sparse_bytes_are_measured_on_real_tokens_and_smaller_than_compact():
  sparse, full, _ = _sparse()
  mask = np.zeros((B, S), bool)
  mask[:, :6] = True
  stats = sparse.sparse_stats(mask)
  # Uniform fractional parts: about 2 * delta of the elements sit within delta of a midpoint.
  assert 0.05 < stats["guidance/sparse_density"] < 0.15
  parts = sparse.nbytes(mask)
  assert parts["total"] == parts["scales"] + parts["bits"] + parts["positions"]
  assert parts["bits"] * 8 == sum(s["bits"] for s in stats["per_site"].values())
  per_token = sparse.bytes_per_token(mask)
  assert 0 < per_token < full.to_compact().bytes_per_token(mask) < full.bytes_per_token(mask)
  # Only the masked tokens count: flags in the other slots change nothing.
  assert sparse.take(np.arange(B)).bytes_per_token(mask) == per_token


def test_sparse_guidance_saves_and_loads(tmp_path):
  sparse, _, _ = _sparse(layers=(1,))
  path = os.path.join(tmp_path, "g.npz")
  sparse.save(path)
  loaded = G.Guidance.load(path)
  assert loaded.mode == "sparse" and set(loaded.sites) == set(sparse.sites)
  for key, g in sparse.sites.items():
    assert loaded.sites[key].n == g.n
    jax.tree.map(np.testing.assert_array_equal, loaded.sites[key], jax.device_get(g))


def test_sparse_needs_inputs_and_full_guidance():
  _, full, inputs = _sparse(layers=(0,))
  with pytest.raises(ValueError, match="site inputs lack"):
    full.to_sparse({}, fp4.SparseSpec())
  with pytest.raises(ValueError, match="made from full guidance"):
    full.to_compact().to_sparse(inputs)
  with pytest.raises(ValueError, match="site inputs too"):
    G.from_records({}, "sparse", (0,))
