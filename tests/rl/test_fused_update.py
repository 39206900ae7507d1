"""One update per step: the fused update (`trainer._train_step(..., fused=True)`) against pi_old's own forward
followed by the plain update. Its own file so that pytest-xdist can place it beside the
trainer's longer end-to-end tests."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import model as M
from trace_jax.model.quant import QuantConfig, call_config
from trace_jax.run import trainer as trainer_lib
from trace_jax.rl.grpo import LossConfig


def test_fused_update_equals_the_separate_pi_old_forward_and_update():
  """One update per step (`_train_step(..., fused=True)`): the same parameters, Adam state, loss, pi_old
  log-probs, entropy and training-path site records as pi_old's own forward
  (`_old_logprobs`) followed by `_train_step`, on FP4 QAT with fresh random trajectories."""
  rng = np.random.default_rng(20)
  cfg = M.tiny(num_layers=1)  # one block: the compile is the test's cost
  batch, length = 4, 24
  tokens = jnp.asarray(rng.integers(5, cfg.vocab_size, (batch, length)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  mask = jnp.ones((batch, length), bool)
  response = jnp.asarray(np.arange(length)[None, :] >= rng.integers(4, 12, (batch, 1)))
  example = trainer_lib.TrainExample(
    tokens=tokens,
    positions=positions,
    mask=mask,
    response_mask=response,
    rollout_logp=jnp.asarray(rng.normal(-1.0, 0.3, (batch, length)), jnp.float32),
    advantages=jnp.asarray(rng.normal(size=batch), jnp.float32),
  )
  static = dict(
    quant=call_config(QuantConfig(), compute_dtype="bfloat16"), replay=False, temperature=0.7
  )
  loss_config = LossConfig(rollout_correction="tis")
  results = []
  for fused in (True, False):
    policy = M.Transformer(cfg, rngs=nnx.Rngs(7))
    opt = nnx.Optimizer(policy, trainer_lib._optimizer(1e-3), wrt=nnx.Param)
    if fused:
      loss, _, _, old, entropy, _, sites = trainer_lib._train_step(
        policy, opt, example, None, None, loss_config=loss_config, fused=True, record=True, **static
      )
    else:
      old, entropy, _, sites = trainer_lib._old_logprobs(
        policy, example, None, record=True, **static
      )
      loss = trainer_lib._train_step(
        policy, opt, example.replace(old_logp=old), None, None, loss_config=loss_config, **static
      )[0]
    results.append((loss, old, entropy, sites, nnx.state(policy, nnx.Param), nnx.state(opt)))
  for a, b in zip(*results):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(
        np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-5, atol=1e-6
      )
  assert jax.tree.leaves(results[0][3])  # the site records are there
