"""The MoE router in the activations' dtype (`CallOptions.router_dtype="compute"`, an
engine difference a study can turn on) against the same top-k computed here in NumPy, and
the router's own choice under routing replay (`ModelOutput.router_choice`)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax.guidance import Guidance


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
  """Top-k expert ids per row, descending, ties to the lower id (as lax.top_k)."""
  return np.argsort(-logits, axis=-1, kind="stable")[:, :k]


@pytest.mark.parametrize("router_dtype", ["float32", "compute"])
def test_routing_follows_the_logits_of_the_chosen_dtype(router_dtype):
  seed = np.random.randint(1000)
  cfg = M.get_preset("tiny", num_layers=1, dense_layers=())
  model = M.Transformer(cfg, rngs=nnx.Rngs(seed))
  tokens = jax.random.randint(jax.random.key(seed), (2, 9), 0, cfg.vocab_size)
  options = M.CallOptions(compute_dtype="bfloat16", router_dtype=router_dtype)
  out, x = _moe_input(model, tokens, options)
  router = np.asarray(model.blocks[0].moe.router.get_value(), np.float32)
  if router_dtype == "compute":  # bf16 operands, float32 sums, logits rounded to bf16
    bf16 = ml_dtypes.bfloat16
    xb, rb = x.astype(bf16).astype(np.float32), router.astype(bf16).astype(np.float32)
    logits = (xb.astype(np.float64) @ rb.astype(np.float64)).astype(bf16).astype(np.float64)
  else:
    logits = x.astype(np.float64) @ router.astype(np.float64)
  k = cfg.num_experts_per_tok
  got = np.asarray(out.routing[0]).reshape(-1, k)
  want = _top_k(logits, k)
  # rows whose k-th and (k+1)-th logits are apart by more than rounding decide the same
  ordered = np.sort(logits, axis=-1)[:, ::-1]
  gap = ordered[:, k - 1] - ordered[:, k]
  clear = gap > 1e-2 * np.abs(ordered[:, k - 1]) + 1e-6
  assert clear.sum() >= 4
  np.testing.assert_array_equal(np.sort(got[clear], -1), np.sort(want[clear], -1))


def test_under_replay_the_router_still_reports_its_own_choice():
  """Replayed experts are used (`routing`); `router_choice` is each MoE layer's own top-k
  of its float32 logits, computed here from the layer's input; without replay both agree."""
  seed = np.random.randint(1000)
  cfg = M.get_preset("tiny", num_layers=2, dense_layers=(), scan_layers=False)  # (spied)
  model = M.Transformer(cfg, rngs=nnx.Rngs(seed))
  b, t, k = 2, 9, cfg.num_experts_per_tok
  tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, cfg.vocab_size)
  options = M.CallOptions(compute_dtype="float32")
  plain, _ = _moe_input(model, tokens, options)
  np.testing.assert_array_equal(plain.router_choice, plain.routing)
  rng = np.random.default_rng(seed)
  replay = np.stack(
    [rng.permutation(cfg.num_experts)[:k] for _ in range(cfg.num_moe_layers * b * t)]
  ).reshape(cfg.num_moe_layers, b, t, k)
  guidance = Guidance(sites={}, routing=jnp.asarray(replay, jnp.int32), mode="none", layers=())
  out, inputs = _moe_input(model, tokens, options, guidance=guidance, every_layer=True)
  np.testing.assert_array_equal(out.routing, replay)
  for moe_layer, x in enumerate(inputs):
    router = np.asarray(model.blocks[moe_layer].moe.router.get_value(), np.float64)
    logits = x.astype(np.float64) @ router
    want = _top_k(logits, k)
    ordered = np.sort(logits, axis=-1)[:, ::-1]
    clear = ordered[:, k - 1] - ordered[:, k] > 1e-6 * np.abs(ordered[:, k - 1]) + 1e-9
    got = np.asarray(out.router_choice[moe_layer]).reshape(-1, k)
    assert clear.sum() >= b * t - 2
    np.testing.assert_array_equal(got[clear], want[clear])
  # replayed experts differ from the router's own choice at some tokens, so the flips it
  # reports are the router's, not the replay's
  assert np.any(np.sort(np.asarray(out.router_choice), -1) != np.sort(replay, -1))


def _moe_input(model, tokens, options, guidance=None, every_layer=False):
  """The model's output and its first layer's MoE input (normed, compute dtype), float32;
  with `every_layer`, the list of every MoE layer's input, in order."""
  seen = []
  moe = model.blocks[0].moe
  original = type(moe).__call__

  def spy(self, x, **kwargs):
    seen.append(np.asarray(x.astype(jnp.float32)).reshape(-1, x.shape[-1]))
    return original(self, x, **kwargs)

  type(moe).__call__ = spy
  try:
    out = model(tokens, guidance=guidance, options=options)
  finally:
    type(moe).__call__ = original
  return out, (seen if every_layer else seen[0])


def test_an_unknown_router_dtype_is_refused():
  with pytest.raises(ValueError, match="router_dtype='bf16' is not allowed"):
    M.CallOptions(router_dtype="bf16")
  from trace_jax.rollout.config import RolloutConfig

  with pytest.raises(ValueError, match="router_dtype"):
    RolloutConfig(router_dtype="half")
