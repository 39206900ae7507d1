"""ModelConfig.scan_layers: layers under one scan compute what the unrolled stack computes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import guidance as G
from trace_jax import model as M
from trace_jax.model.quant import CallOptions, QuantConfig, Recording
from trace_jax.model.config import hybrid_layer_types
from trace_jax.model.scan import LayerGroup, in_key_order, layer_groups
from trace_jax.model.sites import ByLayer


def test_layer_groups_cut_repeats_and_leave_singles():
  assert layer_groups("aaaa") == [LayerGroup(0, 1, 4)]
  assert layer_groups("dabababa") == [LayerGroup(0, 1, 1), LayerGroup(1, 2, 3), LayerGroup(7, 1, 1)]
  assert layer_groups("lllflllf") == [LayerGroup(0, 4, 2)]  # a hybrid 3 + 1 pattern
  assert layer_groups("aabb") == [LayerGroup(0, 1, 2), LayerGroup(2, 1, 2)]
  groups = layer_groups(list(np.random.default_rng(0).integers(0, 3, 40)))
  covered = [i for g in groups for j in range(g.period) for i in g.layers(j)]
  assert sorted(covered) == list(range(40))


def _records(scan, tokens, num_layers=4):
  model = M.Transformer(M.tiny(scan_layers=scan, num_layers=num_layers), rngs=nnx.Rngs(0))
  options = CallOptions(recording=Recording(form="full"))
  return nnx.jit(lambda m, t: m(t, quant=QuantConfig(), options=options))(model, tokens)


def test_parts_join_in_key_order_as_stacked_one_by_one():
  rng = np.random.default_rng()
  layers = list(rng.permutation(12))
  cuts = sorted(rng.choice(np.arange(1, 12), 3, replace=False))
  runs = [tuple(int(x) for x in run) for run in np.split(np.array(layers), cuts)]
  value = {i: rng.normal(size=(2, 3)).astype(np.float32) for i in range(12)}
  parts = [(run, jnp.stack([value[i] for i in run])) for run in runs]
  keys, whole = in_key_order(parts)
  assert keys == tuple(range(12))
  np.testing.assert_array_equal(whole, np.stack([value[i] for i in range(12)]))
  # records of two sites, one with two shapes: the same stacks as ByLayer.of's, one by one
  records = {(i, "a"): {"x": jnp.asarray(value[i])} for i in range(12)}
  records |= {(i, "b"): {"x": jnp.asarray(value[i][:, : 1 + i % 2])} for i in range(12)}
  parts = [
    (tuple((i, site) for i in run), {"x": jnp.stack([records[(i, site)]["x"] for i in run])})
    for site in ("b", "a")
    for run in runs
    for run in [r for r in (run[::2], run[1::2]) if r]
    if len({records[(i, site)]["x"].shape for i in run}) == 1
  ]
  parts += [
    ((k,), jax.tree.map(lambda a: a[None], records[k]))
    for k in records
    if not any(k in keys for keys, _ in parts)
  ]
  joined, one_by_one = ByLayer.from_parts(parts), ByLayer.of(records)
  # one stack per site and shape, layers in order, stacks by their first key
  assert joined.keys_by_stack == (
    tuple((i, "a") for i in range(12)),
    tuple((i, "b") for i in range(0, 12, 2)),
    tuple((i, "b") for i in range(1, 12, 2)),
  )
  assert joined.keys_by_stack == one_by_one.keys_by_stack
  for keys, stack in zip(joined.keys_by_stack, joined.stacks):
    np.testing.assert_array_equal(stack["x"], np.stack([records[k]["x"] for k in keys]))
  chex.assert_trees_all_equal(joined, one_by_one)
  chex.assert_trees_all_equal(dict(joined), records)
  assert ByLayer.of(joined) is joined


def test_scanned_forward_and_guided_gradient_match_unrolled():
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 13)), jnp.int32)
  plain, scanned = _records(False, tokens), _records(True, tokens)
  assert len(plain.sites) > 8
  for name in ("logits", "routing", "router_load"):
    chex.assert_trees_all_equal(getattr(scanned, name), getattr(plain, name))
  # the scanned run's records stay stacked by layer: one stack per site, read like the dict
  assert isinstance(scanned.sites, ByLayer) and isinstance(plain.sites, dict)
  assert all(len(keys) == 4 for keys in scanned.sites.keys_by_stack)
  chex.assert_trees_all_equal(dict(scanned.sites), plain.sites)
  chex.assert_trees_all_equal(scanned.sites, ByLayer.of(plain.sites))
  layers = tuple(range(4))
  guidance = G.Guidance(
    sites=G.from_records(plain.sites, "compact", layers),
    routing=plain.routing,
    mode="compact",
    layers=layers,
  )
  quant = QuantConfig(rounding="guided", guided_layers="last_half")

  def loss(m, t, g):
    out = m(t, quant=quant, guidance=g, options=CallOptions(recording=Recording(form="compact")))
    return jnp.sum(out.logits**2) * 1e-3 + out.lb_loss, out

  results = []
  for scan in (False, True):
    model = M.Transformer(M.tiny(scan_layers=scan, num_layers=4), rngs=nnx.Rngs(0))
    (value, out), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model, tokens, guidance)
    results.append((value, out, nnx.to_pure_dict(grads)))
  (value, out, grads), (s_value, s_out, s_grads) = results
  chex.assert_trees_all_equal(s_value, value)
  chex.assert_trees_all_equal(dict(s_out.sites), out.sites)
  chex.assert_trees_all_equal(dict(s_out.fallbacks), out.fallbacks)
  # the backward through the scan is fused otherwise: float32 gradients agree to 1e-5 (L2)
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]).astype(np.float64)
  diff = np.linalg.norm(flat(s_grads) - flat(grads)) / np.linalg.norm(flat(grads))
  assert diff < 1e-5, diff


def _groups(model, quant=None):
  from trace_jax.model.quantizer import SiteQuantizer  # noqa: PLC0415

  sq = SiteQuantizer(quant, model.cfg.num_layers, jnp.float32, options=CallOptions())
  return model._layer_groups(sq)


def test_what_runs_under_a_scan():
  hybrid = M.Transformer(
    M.qwen3_5_tiny(num_layers=8, layer_types=hybrid_layer_types(8)), rngs=nnx.Rngs(0)
  )
  assert _groups(hybrid) == [LayerGroup(0, 4, 2)]  # the 3 + 1 pattern, twice
  dense_first = M.Transformer(M.tiny(num_layers=5, dense_layers=(0,), ffn_dim=64), rngs=nnx.Rngs(0))
  assert _groups(dense_first) == [LayerGroup(0, 1, 1), LayerGroup(1, 1, 4)]
  plain = M.Transformer(M.tiny(num_layers=6), rngs=nnx.Rngs(0))
  assert _groups(plain) == [LayerGroup(0, 1, 6)]
  # the deeper half guided: two runs, the unguided half and the guided one
  assert _groups(plain, QuantConfig(rounding="guided", guided_layers="last_half")) == [
    LayerGroup(0, 1, 3),
    LayerGroup(3, 1, 3),
  ]
  assert _groups(M.Transformer(M.tiny(num_layers=6, scan_layers=False), rngs=nnx.Rngs(0))) == [
    LayerGroup(i, 1, 1) for i in range(6)
  ]


@pytest.mark.parametrize(
  "preset, overrides",
  [
    ("small", {}),
    ("tiny", {"num_layers": 5, "dense_layers": (0,), "ffn_dim": 64, "remat": True}),
    pytest.param(
      "qwen3_5_tiny",
      {"num_layers": 8, "layer_types": hybrid_layer_types(8)},
      marks=pytest.mark.slow,  # two 8-layer hybrid compiles, about a minute
    ),
  ],
)
def test_scanned_float32_logits_are_the_unrolled_stacks_bit_for_bit(preset, overrides):
  rng = np.random.default_rng()
  np.testing.assert_array_equal(
    *_logits_both_ways(preset, overrides, "float32", QuantConfig(), rng)
  )


def _logits_both_ways(preset, overrides, dtype, quant, rng):
  """Logits [2, 19, V] of one set of fresh random weights, unrolled and scanned."""
  tokens = jnp.asarray(rng.integers(0, 128, (2, 19)), jnp.int32)
  mask = jnp.asarray(rng.random((2, 19)) < 0.9)
  options = CallOptions(compute_dtype=dtype)
  seed, logits = int(rng.integers(1 << 30)), []
  for scan in (False, True):
    model = M.Transformer(M.get_preset(preset, scan_layers=scan, **overrides), rngs=nnx.Rngs(seed))
    fn = nnx.jit(lambda m, t, k: m(t, mask=k, quant=quant, options=options).logits)
    logits.append(np.asarray(fn(model, tokens, mask), np.float32))
  assert np.isfinite(logits[0]).all()
  return logits


_BF16_CHILD = """
import numpy as np
from tests.model.test_scan_layers import _logits_both_ways
from trace_jax.model.quant import QuantConfig
rng = np.random.default_rng()
for quant in (None, QuantConfig()):
  plain, scanned = _logits_both_ways("small", {}, "bfloat16", quant, rng)
  np.testing.assert_array_equal(scanned, plain)
print("equal")
"""


@pytest.mark.slow
def test_scanned_bf16_logits_differ_only_by_excess_precision():
  """In bf16 the scan's carry rounds the residual stream to bf16 at every layer boundary, where
  the unrolled program may keep it in float32 across fusions (XLA's default
  --xla_allow_excess_precision); with that off, the two programs agree bit for bit."""
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, XLA_FLAGS="--xla_allow_excess_precision=false", PYTHONPATH=root)
  done = subprocess.run(
    [sys.executable, "-c", _BF16_CHILD],
    capture_output=True,
    text=True,
    env=env,
    cwd=root,
    timeout=600,
  )
  assert done.returncode == 0 and "equal" in done.stdout, done.stderr[-3000:]


def _cached_calls(preset, overrides, scan, seed, tokens, mask, recorded):
  """A prompt of 6 slots, then two decode steps, over an FP4 KV cache (float32 compute,
  compact records of the `recorded` layers): per call (logits, each layer's cache fields,
  {(layer, site): record leaves})."""
  cfg = M.get_preset(preset, scan_layers=scan, **overrides)
  graphdef, state = nnx.split(M.Transformer(cfg, rngs=nnx.Rngs(seed)))
  quant = QuantConfig()
  recording = Recording(form="compact", layers=recorded)
  options = CallOptions(compute_dtype="float32", recording=recording)

  @jax.jit
  def call(state, tokens, mask, cache):
    return nnx.merge(graphdef, state)(tokens, mask=mask, cache=cache, quant=quant, options=options)

  cache, results = M.init_cache(cfg, 2, 16, quant, dtype=jnp.float32), []
  for chunk in (slice(0, 6), slice(6, 7), slice(7, 8)):
    out = call(state, tokens[:, chunk], mask[:, chunk], cache)
    cache = out.cache
    fields = [cache.k, cache.v] + ([cache.conv, cache.recurrent] if cfg.linear_layers else [])
    entries = [jax.tree.leaves(field[i]) for field in fields for i in range(cfg.num_layers)]
    sites = {key: jax.tree.leaves(record) for key, record in out.sites.items()}
    results.append(jax.tree.map(np.asarray, (out.logits, entries, sites)))
  return results


@pytest.mark.parametrize(
  "preset, overrides, recorded",
  [
    pytest.param(
      "tiny",
      {"num_layers": 5, "dense_layers": (0,), "ffn_dim": 64},
      (2, 3, 4),
      marks=pytest.mark.slow,  # the float32 bit test above covers the scan by default
    ),
    pytest.param(
      "qwen3_5_tiny",
      {"num_layers": 8, "layer_types": hybrid_layer_types(8)},
      (4, 5, 6, 7),
      marks=pytest.mark.slow,  # four 8-layer hybrid compiles, about half a minute
    ),
  ],
)
def test_scanned_cache_calls_are_the_unrolled_ones_bit_for_bit(preset, overrides, recorded):
  """Prefill and decode over the cache with the layers under a scan (the cache's layer
  stacks carried through it, each layer writing its slots in place) give the unrolled
  stack's logits, cache entries and records, bit for bit (float32): the dense-first layer
  and the unrecorded layer unrolled beside a recorded run, or the hybrid's Gated DeltaNet
  states and FP4 attention cache under one scan of its 3 + 1 group."""
  rng = np.random.default_rng()
  tokens = jnp.asarray(rng.integers(0, 128, (2, 8)), jnp.int32)
  mask = jnp.asarray(rng.random((2, 8)) < 0.9).at[:, 6:].set(True)
  seed = int(rng.integers(1 << 30))
  unrolled, scanned = (
    _cached_calls(preset, overrides, scan, seed, tokens, mask, recorded) for scan in (False, True)
  )
  assert np.isfinite(unrolled[-1][0]).all() and unrolled[-1][2]
  chex.assert_trees_all_equal(scanned, unrolled)


def test_cached_calls_hold_one_copy_of_a_scanned_layer():
  """The decode step's program: one layer's matmuls however deep the stack under a scan,
  one copy per layer unrolled."""
  quant = QuantConfig()

  def matmuls(num_layers, scan):
    cfg = M.tiny(num_layers=num_layers, scan_layers=scan)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0))))
    cache = jax.eval_shape(lambda: M.init_cache(cfg, 2, 16, quant))
    token = jax.ShapeDtypeStruct((2, 1), jnp.int32)
    step = lambda s, t, c: nnx.merge(graphdef, s)(t, cache=c, quant=quant).logits  # noqa: E731
    return str(jax.make_jaxpr(step)(state, token, cache)).count("dot_general")

  assert matmuls(2, True) == matmuls(6, True)
  assert matmuls(6, False) - matmuls(2, False) == 2 * (matmuls(4, False) - matmuls(2, False)) > 0
