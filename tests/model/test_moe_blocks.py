"""The routed experts dispatched per block of sequences (`CallOptions.moe_blocks`, a rollout
on a mesh: one block per "data" shard) against each block run as a batch of its own."""

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.model.moe import MoE
from trace_jax.model.quant import Recording


def _rollout_forward(model, params, tokens, mask, blocks, sorts=None):
  """One FP4 rollout prefill (packed weights, FP4 cache, compact records of every layer).
  `sorts`: a list to which the shapes of the program's sorts are appended."""
  graphdef = nnx.graphdef(model)
  quant = M.QuantConfig()
  options = M.CallOptions(recording=Recording(form="compact"), moe_blocks=blocks)
  cache = M.init_cache(model.cfg, tokens.shape[0], 2 * tokens.shape[1], quant, dtype=jnp.float32)
  forward = jax.jit(
    lambda p, c: nnx.merge(graphdef, p)(tokens, mask=mask, cache=c, quant=quant, options=options)
  )
  if sorts is not None:
    sorts.extend(_sort_shapes(jax.make_jaxpr(forward)(params, cache).jaxpr))
  return forward(params, cache)


def _sort_shapes(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "sort":
      yield tuple(eqn.invars[0].aval.shape)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax_core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax_core.Jaxpr):
          yield from _sort_shapes(sub)


def _case(blocks, num_layers=2):
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  model = M.Transformer(M.tiny(num_layers=num_layers), rngs=nnx.Rngs(seed))
  params = R.quantize_params(nnx.state(model), M.QuantConfig(), dtype=jnp.float32)
  rows, slots = 2 * blocks, 12
  tokens = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (rows, slots)), jnp.int32)
  mask = jnp.asarray(np.arange(slots)[None] >= rng.integers(0, 6, rows)[:, None])
  return seed, model, params, tokens, mask


@pytest.mark.parametrize("blocks", [2, 3])
def test_blocked_dispatch_is_one_sort_over_the_batch_bit_for_bit(blocks):
  """Sorting within blocks (other tiles, another tile height) changes no number: logits,
  cache, routing and every record equal the one-sort call's, since a row's product does
  not depend on which rows share its tile. Fresh weights and tokens, float32, one process."""
  seed, model, params, tokens, mask = _case(blocks)
  blocked, one = [], []
  got = _rollout_forward(model, params, tokens, mask, blocks, blocked)
  want = _rollout_forward(model, params, tokens, mask, 1, one)
  rows = tokens.size * model.cfg.num_experts_per_tok  # every (token, slot) of the batch
  assert one and set(one) == {(rows,)}, one
  assert len(blocked) == len(one) and set(blocked) == {(blocks, rows // blocks)}, blocked
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"seed {seed}")


@pytest.mark.parametrize("blocks", [2, 4])
def test_blocked_experts_equal_every_expert_on_every_token(blocks):
  """The MoE layer dispatched per block against its dense reference (every expert on every
  token, combined by the chosen experts' weights), unquantized float32: each block's rows
  meet their own experts' weights, none another block's. Fresh weights and inputs."""
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  cfg = M.tiny(num_experts=8, num_experts_per_tok=3)
  moe = MoE(cfg, rngs=nnx.Rngs(seed))
  x = jnp.asarray(rng.standard_normal((2 * blocks, 10, cfg.d_model)), jnp.float32)
  valid = jnp.ones(x.shape[:2], bool)

  @nnx.jit(static_argnums=(2, 3))
  def call(moe, x, dispatch, blocks):
    moe.dispatch = dispatch
    sq = M.SiteQuantizer(
      None, cfg.num_layers, jnp.float32, options=M.CallOptions(moe_blocks=blocks)
    )
    return moe(x, valid=valid, layer=0, sq=sq)

  got, stats = call(moe, x, "grouped", blocks)
  want, want_stats = call(moe, x, "dense", 1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
  np.testing.assert_array_equal(stats.experts, want_stats.experts, err_msg=f"seed {seed}")


def test_blocks_that_do_not_divide_the_batch_fall_back_to_one_sort():
  """moe_blocks=4 on 6 sequences sorts once over the batch: the moe_blocks=1 call exactly."""
  rng = np.random.default_rng()
  model = M.Transformer(M.tiny(num_layers=1), rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  params = R.quantize_params(nnx.state(model), M.QuantConfig(), dtype=jnp.float32)
  tokens = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (6, 8)), jnp.int32)
  mask = jnp.ones((6, 8), bool)
  a = _rollout_forward(model, params, tokens, mask, 4)
  b = _rollout_forward(model, params, tokens, mask, 1)
  np.testing.assert_array_equal(a.logits, b.logits)


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2"])
def test_moe_blocks_must_be_a_positive_int(value):
  with pytest.raises(ValueError, match="moe_blocks"):
    M.CallOptions(moe_blocks=value)
