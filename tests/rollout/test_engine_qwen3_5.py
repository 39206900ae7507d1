"""The rollout engine on the hybrid Qwen3.5-MoE model (Gated DeltaNet state in the cache):
rollout log-probs equal the training path's over the same buffers, multi-turn continuation
through the recurrent state equals one generation, and the FP4 scope picks the right sites."""

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.training.forward import training_forward

# Compiles whole RL / rollout programs: minutes on 2 cores; `pytest -m slow` runs it.
pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 3], [9, 2, 44, 7, 61, 8, 30], [100]]


@pytest.fixture(scope="module")
def preset():  # conftest.py builds `policy` and `f32_greedy` from it
  return "qwen3_5_tiny"


@pytest.fixture(scope="module")
def greedy_max_len():
  return 40


def test_rollout_logprobs_equal_the_training_forward_and_continuation_is_exact(policy, f32_greedy):
  """Prompts are left-padded (the DeltaNet state must skip the padding); a second turn is fed
  after a left-padded observation chunk (holes between the turns) and continues the cached
  conv and recurrent states: it equals one generation over the concatenated sequences."""
  first = f32_greedy.generate(PROMPTS, jax.random.key(1))
  assert first.cache.recurrent[0] is not None and first.cache.k[0] is None
  observations = [[7, 7, 7], [12], [50, 51]]
  second = f32_greedy.continue_(first, observations, jax.random.key(2))
  logp, _ = nnx.jit(lambda m, t, p, mask: training_forward(m, t, p, mask, quant=None))(
    policy, second.tokens, second.positions, second.mask
  )
  response = np.asarray(second.response_mask)
  np.testing.assert_allclose(
    np.asarray(logp)[response], np.asarray(second.logprobs)[response], atol=2e-4
  )
  concatenated = [p + r + o for p, r, o in zip(PROMPTS, first.responses(), observations)]
  once = f32_greedy.generate(concatenated, jax.random.key(3))
  assert once.responses() == [r[8:] for r in second.responses()]


@pytest.mark.parametrize("sites", ["all", "experts+kv"])
def test_fp4_scope_quantizes_exactly_its_sites(policy, sites):
  cfg = policy.cfg
  quant = M.QuantConfig(sites=sites)
  tokens = jax.random.randint(jax.random.key(4), (1, 5), 0, cfg.vocab_size)
  recording = M.CallOptions(recording=M.Recording(form="full"))
  aux = nnx.jit(lambda m, t: m(t, quant=quant, options=recording))(policy, tokens)
  recorded = set(aux.sites)
  mixer = ("attn_in", "attn_out") if sites == "all" else ()
  moe = ("moe_in", "moe_mid") + (("shared_mid",) if sites == "all" else ())
  expected = set()
  for layer in range(cfg.num_layers):
    kv = () if layer in cfg.linear_layers else ("k", "v")  # linear layers have no KV cache
    expected |= {(layer, s) for s in mixer + kv + moe}
  assert recorded == expected
  for key, q in aux.sites.items():  # laid out per token slot, as guidance buffers need
    assert q.global_scale.shape[:2] == (1, 5), (key, q.global_scale.shape)
  params = R.quantize_params(nnx.state(policy), quant)
  packed = {
    tuple(str(p) for p in path[-2:])
    for path, v in nnx.to_flat_state(params)
    if isinstance(v.get_value(), fp4.QArray)
  }
  linear_attn = {("attn", n) for n in ("in_proj_qkv", "in_proj_z", "out_proj")}
  if sites == "all":
    assert linear_attn <= packed and ("attn", "q_proj") in packed and ("shared", "w_up") in packed
  else:  # the method's scope: linear-attention layers, attention, shared expert stay bf16
    assert not packed & (linear_attn | {("attn", "q_proj"), ("shared", "w_up")})
  assert ("moe", "w_gate") in packed
  # Never FP4: the decay / beta projections, the conv, A_log, norms, router.
  assert not packed & {("attn", n) for n in ("in_proj_a", "in_proj_b", "conv_weight", "A_log")}
  assert ("moe", "router") not in packed


@pytest.mark.parametrize("sites, expected", [("experts+kv", 108), ("all", 192)])
def test_guidance_bytes_per_token_by_hand(sites, expected):
  """qwen3_5_tiny, compact guidance of the last half (layers 2: DeltaNet, 3: full attention).
  A compact row of n elements costs 4 (global scale) + n/16 (block scales) + n/8 (bits):
    experts+kv: moe_in (n=64) 16 + 2 x moe_mid (n=32) 2 x 10 = 36 per layer; layer 3 adds k
      and v, each 2 KV heads x (n=16) 7 = 14: 36 + 64 = 100;
    all: + attn_in 16 + attn_out 16 + shared_mid 10 per layer: 100 + 2 x 42 = 184;
  plus routing, int8 x k=2 x 4 MoE layers = 8."""
  from trace_jax.rollout.accounting import guidance_bytes_per_token

  cfg = M.get_preset("qwen3_5_tiny")
  config = R.RolloutConfig(guidance="compact", guided_layers="last_half")
  assert guidance_bytes_per_token(cfg, config, M.QuantConfig(sites=sites)) == expected
