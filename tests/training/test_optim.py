"""Optimizer updates over layer stacks (training.optim, scan.StackLayout) against optax's
leaf-by-leaf update of the same parameters and gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax.model import sharding
from trace_jax.model.config import hybrid_layer_types
from trace_jax.model.quant import CallOptions, QuantConfig, Recording
from trace_jax.model.scan import (
  STACKED,
  UNSTACKED,
  StackLayout,
  flat_paths,
  layer_views,
  stack_layers,
)
from trace_jax.model.sites import ByLayer
from trace_jax.training.optim import (
  LayerStacked,
  apply_stacked_update,
  apply_update,
  by_layer_stacks,
  value_and_grad_by_layer,
)

# Plain MoE layers; dense-first then MoE layers; a hybrid of linear and full attention.
CONFIGS = {
  "moe": lambda: M.tiny(num_layers=3),
  "dense_first": lambda: M.tiny(num_layers=4, dense_layers=(0,), ffn_dim=64),
  "hybrid": lambda: M.get_preset("qwen3_5_tiny", num_layers=4, layer_types=hybrid_layer_types(4)),
}


def _random_like(tree, rng):
  return jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), tree)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stack_layout_round_trips_and_groups_alike_layers(name):
  model = M.Transformer(CONFIGS[name](), rngs=nnx.Rngs(0))
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  params = _random_like(params, np.random.default_rng())
  layout = StackLayout.of(params)
  stacked = layout.stack(params)
  chex.assert_trees_all_equal(layout.unstack(stacked, params), params)
  flat = flat_paths(params)
  for key, paths in layout.stacks.items():
    # each stack: one parameter of two or more layers, alike, in layer order
    assert len(paths) >= 2 and len({flat[p].shape for p in paths}) == 1
    layers = [p[1] for p in paths]
    assert layers == sorted(layers) and all(p[0] == "blocks" for p in paths)
    whole = flat_paths(stacked)[(STACKED,) + key]
    for i, p in enumerate(paths):
      np.testing.assert_array_equal(whole[i], flat[p])
  # every leaf of no layer is left where it was
  rest = {p for p in flat if p[0] != "blocks"}
  assert rest <= set(layout.rest)
  assert {p[1:] for p in flat_paths(stacked) if p[0] == UNSTACKED} == set(layout.rest)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stacked_adam_is_leaf_by_leaf_adam_bit_for_bit(name):
  """Unclipped, the stacked update is optax's per-leaf update, element for element."""
  rng = np.random.default_rng()
  tx = optax.chain(optax.clip_by_global_norm(1e9), optax.adam(1e-2))
  models = [M.Transformer(CONFIGS[name](), rngs=nnx.Rngs(1)) for _ in range(2)]
  stacked = nnx.Optimizer(models[0], by_layer_stacks(tx), wrt=nnx.Param)
  plain = nnx.Optimizer(models[1], tx, wrt=nnx.Param)
  step = nnx.jit(apply_update)
  for _ in range(3):
    grads = _random_like(nnx.state(models[0], nnx.Param), rng)
    norm = step(stacked, models[0], grads)
    nnx.jit(lambda o, m, g: o.update(m, g))(plain, models[1], grads)
    np.testing.assert_allclose(norm, optax.global_norm(grads), rtol=1e-6)
  chex.assert_trees_all_equal(
    nnx.to_pure_dict(nnx.state(models[0], nnx.Param)),
    nnx.to_pure_dict(nnx.state(models[1], nnx.Param)),
  )
  assert int(stacked.step[...]) == 3
  # the moments of layer parameters are held stacked: a leading axis of layers
  mu = nnx.as_pure(stacked.opt_state)[1][0].mu
  layout = StackLayout.of(nnx.state(models[0], nnx.Param))
  for key, paths in layout.stacks.items():
    assert flat_paths(mu[STACKED])[key].shape[0] == len(paths)


def test_views_of_a_stack_stack_back_as_its_slices():
  rng = np.random.default_rng()
  params = {
    "blocks": {i: {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)} for i in range(6)}
  }
  layout = StackLayout.of(params)
  stacked = layout.stack(params)
  whole = stacked[STACKED]["blocks"]["w"]
  with layer_views():
    views = layout.views(stacked, params)
    leaf = lambda i: views["blocks"][i]["w"]
    assert stack_layers([leaf(i) for i in range(6)]) is whole
    np.testing.assert_array_equal(stack_layers([leaf(i) for i in (1, 3, 5)]), whole[1::2])
    np.testing.assert_array_equal(stack_layers([leaf(i) for i in (2, 3)]), whole[2:4])
    # not evenly spaced, or not views: stacked as they are
    np.testing.assert_array_equal(
      stack_layers([leaf(i) for i in (0, 1, 3)]), whole[np.array([0, 1, 3])]
    )
    fresh = [jnp.asarray(np.asarray(leaf(i))) for i in range(6)]
    assert stack_layers(fresh) is not whole
    np.testing.assert_array_equal(stack_layers(fresh), whole)
  views = layout.views(stacked, params)  # no context: nothing registered
  assert stack_layers([views["blocks"][i]["w"] for i in range(6)]) is not whole


# the plain stack in the default run; unrolled-then-scanned and interleaved runs: -m slow
@pytest.mark.parametrize(
  "name",
  ["moe"] + [pytest.param(name, marks=pytest.mark.slow) for name in ("dense_first", "hybrid")],
)
def test_gradient_in_layer_stacks_is_the_per_layer_gradient(name):
  """A guided, recorded QAT loss (scanned runs, and unrolled layers where the pattern
  leaves them): the gradient made in the layer stacks is the per-layer gradient stacked,
  and its update is the per-layer update, bit for bit, compared in this process."""
  cfg = CONFIGS[name]()
  tokens = jnp.asarray(np.random.default_rng().integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
  quant = QuantConfig()
  options = CallOptions(recording=Recording(form="compact"))

  def loss(model):
    out = model(tokens, quant=quant, options=options)
    return jnp.mean(out.logits**2) + out.lb_loss, out.sites

  tx = optax.adam(1e-2)
  models = [M.Transformer(cfg, rngs=nnx.Rngs(2)) for _ in range(2)]
  opts = [nnx.Optimizer(m, by_layer_stacks(tx), wrt=nnx.Param) for m in models]

  @nnx.jit
  def per_layer(opt, model):
    (value, sites), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return value, sites, grads, apply_update(opt, model, grads)

  @nnx.jit
  def by_layer(opt, model):
    (value, sites), (layout, params, grads) = value_and_grad_by_layer(loss, model)
    return value, sites, grads, apply_stacked_update(opt, model, layout, params, grads)

  value, sites, grads, norm = per_layer(opts[0], models[0])
  s_value, s_sites, s_grads, s_norm = by_layer(opts[1], models[1])
  chex.assert_trees_all_equal(s_value, value)
  chex.assert_trees_all_equal(dict(s_sites), dict(sites))
  grads = nnx.as_pure(nnx.state(grads, nnx.Param))
  chex.assert_trees_all_equal(s_grads, StackLayout.of(grads).stack(grads))
  chex.assert_trees_all_equal(s_norm, norm)
  chex.assert_trees_all_equal(
    nnx.to_pure_dict(nnx.state(models[1], nnx.Param)),
    nnx.to_pure_dict(nnx.state(models[0], nnx.Param)),
  )
  assert int(opts[1].step[...]) == 1


def test_a_stacked_update_needs_an_optimizer_over_stacks():
  model = M.Transformer(M.tiny(num_layers=2), rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
  with pytest.raises(ValueError, match="by_layer_stacks"):
    apply_stacked_update(opt, model, None, None, None)


def test_stacked_clip_scales_like_optax_to_rounding():
  """Clipped, the norm sums the same squares grouped by stack: equal to rounding."""
  rng = np.random.default_rng()
  tx = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(1.0))
  params = _random_like(
    nnx.as_pure(nnx.state(M.Transformer(M.tiny(), rngs=nnx.Rngs(0)), nnx.Param)), rng
  )
  grads = _random_like(params, rng)
  stacked = by_layer_stacks(tx)
  updates, _ = jax.jit(stacked.update)(grads, stacked.init(params), params)
  expected, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  chex.assert_trees_all_close(updates, expected, rtol=1e-5, atol=1e-9)
  assert float(optax.global_norm(updates)) == pytest.approx(0.1, rel=1e-5)


def test_an_optimizer_without_stacks_updates_as_before():
  model = M.Transformer(M.tiny(num_layers=2), rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
  assert not isinstance(opt.tx, LayerStacked)
  before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  grads = _random_like(nnx.state(model, nnx.Param), np.random.default_rng())
  norm = apply_update(opt, model, grads)
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  chex.assert_trees_all_close(
    after, jax.tree.map(lambda p, g: p - 0.5 * g, before, nnx.to_pure_dict(grads)), rtol=1e-6
  )
  np.testing.assert_allclose(norm, optax.global_norm(grads), rtol=1e-6)


def test_stacked_moments_are_placed_like_their_parameters():
  """On a mesh a stack of moments takes its parameter's rule, the layer axis unsplit."""
  model = M.Transformer(M.tiny(num_layers=2), rngs=nnx.Rngs(0))
  opt = nnx.eval_shape(
    lambda: nnx.Optimizer(model, by_layer_stacks(optax.adam(1e-3)), wrt=nnx.Param)
  )
  mesh = sharding.make_mesh(1, 1, 1)
  shardings = flat_paths(sharding.optimizer_shardings(opt, model, mesh))
  params = sharding.param_shardings(model, mesh)
  param_specs = {p: s.spec for p, s in flat_paths(nnx.state(params, nnx.Param)).items()}
  layout = StackLayout.of(nnx.state(model, nnx.Param))
  checked = 0
  for path, s in shardings.items():
    if STACKED in path:
      key = path[path.index(STACKED) + 1 :]
      first = layout.stacks[key][0]
      assert tuple(s.spec) == (None,) + tuple(param_specs[first])
      checked += 1
  assert checked == 2 * len(layout.stacks)  # mu and nu


def test_by_layer_records_read_like_the_dict():
  rng = np.random.default_rng()
  records = {
    (layer, site): {
      "codes": jnp.asarray(rng.integers(0, 16, (2, 3, 8)), jnp.uint8),
      "scale": jnp.asarray(rng.random((2, 3, 1)), jnp.float32),
    }
    for layer in (3, 0, 1)
    for site in ("attn_in", "k")
  }
  records[(2, "k")] = {"codes": jnp.zeros((2, 3, 4), jnp.uint8), "scale": jnp.ones((2, 3, 1))}
  by_layer = jax.jit(ByLayer.of)(records)
  assert len(by_layer) == len(records) and list(by_layer) == sorted(records)
  assert len(by_layer.stacks) == 3  # attn_in; k of width 8; k of width 4
  chex.assert_trees_all_equal(by_layer.unstack(), records)
  on_host = jax.tree.map(np.asarray, by_layer)
  for key in records:
    chex.assert_trees_all_equal(on_host[key], jax.tree.map(np.asarray, records[key]))
  assert ByLayer.of(None) is None and not ByLayer.of({})
