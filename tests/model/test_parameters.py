"""Parameters carry their facts (sharding, FP4 group, shared-scale siblings, input site) as
flax metadata: declared where made, coherent with the sites, and kept by everything that
moves a parameter (state, split/merge, replace, the optimizer's moments, jit)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import errors as flax_errors
from flax import nnx

from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.model import parameters
from trace_jax.model.sites import site_spec


@pytest.fixture(scope="module")
def hybrid():
  """A dense layer 0 and an MoE layer 1 with a gated shared expert: every weight group."""
  cfg = M.tiny(
    shared_expert_dim=32, shared_expert_gate=True, dense_layers=(0,), ffn_dim=64, num_layers=2
  )
  return M.Transformer(cfg, rngs=nnx.Rngs(3))


def _dotted(path):
  return ".".join(str(p) for p in path)


def test_param_refuses_inconsistent_metadata():
  x = jnp.zeros((4, 8))
  with pytest.raises(ValueError, match="for each of the 2 dimensions"):
    parameters.param(x, sharding=("data",))
  with pytest.raises(ValueError, match="'batch'"):
    parameters.param(x, sharding=("batch", None))
  with pytest.raises(ValueError, match="heads=2 needs a dimension split over 'model'"):
    parameters.param(x, sharding=("data", None), heads=2)
  with pytest.raises(ValueError, match="quant_group='router'"):
    parameters.param(x, sharding=(None, None), quant_group="router", input_site="attn_in")
  with pytest.raises(ValueError, match="must name its input_site"):
    parameters.param(x, sharding=(None, None), quant_group="mlp")
  with pytest.raises(ValueError, match="give quant_group"):
    parameters.param(x, sharding=(None, None), scale_group=("qkv", 0))


def test_scale_groups_are_the_fused_siblings_in_order(hybrid):
  """q|k|v of each attention layer and gate|up of each MLP, shared expert and routed-expert
  stack share a global scale, in the fused matrix's order; the other linears stand alone."""
  groups = [
    tuple(_dotted(p) for p in g) for g in M.scale_groups(nnx.to_flat_state(nnx.state(hybrid)))
  ]
  expected = set()
  for layer in range(2):
    expected.add(tuple(f"blocks.{layer}.attn.{n}_proj" for n in "qkv"))
    expected.add((f"blocks.{layer}.attn.o_proj",))
  for module in ("blocks.0.mlp", "blocks.1.moe.shared", "blocks.1.moe"):
    expected.add((f"{module}.w_gate", f"{module}.w_up"))
    expected.add((f"{module}.w_down",))
  assert len(groups) == len(expected) and set(groups) == expected
  # Under the method's scope only the routed experts pack; packed weights are not regrouped.
  experts_kv = M.QuantConfig(sites="experts+kv")
  flat = list(nnx.to_flat_state(nnx.state(hybrid)))
  assert {g for g in M.scale_groups(flat, experts_kv)} == {
    (("blocks", 1, "moe", "w_gate"), ("blocks", 1, "moe", "w_up")),
    (("blocks", 1, "moe", "w_down"),),
  }
  packed = list(nnx.to_flat_state(R.quantize_params(nnx.state(hybrid), experts_kv)))
  assert M.scale_groups(packed, experts_kv) == []


def test_input_sites_are_declared_sites_present_at_the_weights_layer():
  """Each quantized linear names a site its layer has, and that site runs in FP4 under every
  scope that quantizes the weight (so an export's input scales exist for it)."""
  for preset in ("tiny", "qwen3_5_tiny"):
    cfg = M.get_preset(preset)
    abstract = nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0)))
    seen = 0
    for path, var in nnx.to_flat_state(nnx.state(abstract)):
      group = M.weight_group(var)
      if group is None:
        assert parameters.input_site(var) is None, path
        continue
      site = site_spec(parameters.input_site(var))
      layer = int(path[1])
      assert site.present(cfg, layer), (path, site.name)
      for scope in ("all", "experts+kv"):
        quant = M.QuantConfig(sites=scope)
        if quant.quantizes_weights(group):
          assert quant.quantizes(site.name), (path, scope)
      seen += 1
    assert seen > 0


def test_metadata_survives_state_split_replace_optimizer_and_jit(hybrid):
  state = nnx.state(hybrid)
  q_proj = state["blocks"][1]["attn"]["q_proj"]
  want = {
    "out_sharding": ("data", "model"),
    "heads": hybrid.cfg.num_heads,
    "quant_group": "attention",
    "input_site": "attn_in",
    "scale_group": ("qkv", 0),
  }
  assert {k: q_proj.get_metadata(k) for k in want} == want
  graphdef, state = nnx.split(hybrid)
  merged = nnx.merge(graphdef, state)
  assert M.weight_group(merged.blocks[1].moe.w_down) == "experts"
  assert parameters.scale_group(q_proj.replace(jnp.zeros(3))) == ("qkv", 0)
  opt = nnx.Optimizer(hybrid, optax.adam(1e-3), wrt=nnx.Param)
  mu = nnx.state(opt)["opt_state"][0]["mu"]["blocks"][1]["moe"]["w_gate"]
  assert parameters.sharding_of(mu) == ("expert", "data", "model")
  # The metadata rides in the pytree's static part: the arrays (hence checkpoints, which
  # store `nnx.to_pure_dict`) are the same leaves under the same paths, and a jitted
  # function over the state traces once for new values.
  leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
  assert [tuple(k.key for k in p) for p, _ in leaves] == [
    tuple(p) for p, _ in nnx.to_flat_state(state)
  ]
  traces = []

  @jax.jit
  def total(s):
    traces.append(1)
    return sum(jnp.sum(x) for x in jax.tree.leaves(s))

  a = total(state)
  b = total(jax.tree.map(lambda x: x * 2, state))
  np.testing.assert_allclose(b, 2 * a, rtol=1e-5)
  assert len(traces) == 1


def test_param_key_draws_what_the_flax_stream_draws():
  """`param_key` against flax's own `RngStream.__call__`: the same keys in turn, the same
  count after, eagerly and traced (a jitted draw, as a jitted or abstract init runs)."""
  seed = int(np.random.default_rng().integers(2**31))
  ours, theirs = nnx.Rngs(seed), nnx.Rngs(seed)
  for _ in range(3):
    np.testing.assert_array_equal(
      jax.random.key_data(parameters.param_key(ours)), jax.random.key_data(theirs.params())
    )
  assert int(ours.params.count[...]) == int(theirs.params.count[...]) == 3

  @nnx.jit(static_argnums=1)
  def draws(rngs, use_ours):
    draw = (lambda: parameters.param_key(rngs)) if use_ours else rngs.params
    return jnp.stack([jax.random.key_data(draw()) for _ in range(4)])

  np.testing.assert_array_equal(draws(ours, True), draws(theirs, False))
  assert int(ours.params.count[...]) == int(theirs.params.count[...]) == 7


def test_param_key_refuses_a_stream_of_another_trace_level():
  rngs = nnx.Rngs(0)
  with pytest.raises(flax_errors.TraceContextError):
    jax.jit(lambda: parameters.param_key(rngs))()
