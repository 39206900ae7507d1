"""ModelConfig.scan_layers: layers under one scan compute what the unrolled stack computes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import guidance as G
from trace_jax import model as M
from trace_jax.model.quant import CallOptions, QuantConfig, Recording
from trace_jax.model.scan import LayerGroup, layer_groups


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


def test_scanned_forward_and_guided_gradient_match_unrolled():
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 13)), jnp.int32)
  plain, scanned = _records(False, tokens), _records(True, tokens)
  assert len(plain.sites) > 8
  for name in ("logits", "routing", "sites", "router_load"):
    chex.assert_trees_all_equal(getattr(scanned, name), getattr(plain, name))
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
  chex.assert_trees_all_equal(s_out.sites, out.sites)
  chex.assert_trees_all_equal(s_out.fallbacks, out.fallbacks)
  # the backward through the scan is fused otherwise: float32 gradients agree to 1e-5 (L2)
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]).astype(np.float64)
  diff = np.linalg.norm(flat(s_grads) - flat(grads)) / np.linalg.norm(flat(grads))
  assert diff < 1e-5, diff
