"""One update per step: the fused update (`rl.step.update` of a fused `StepSpec`) against
pi_old's own forward (`rl.step.score`, unfused) followed by the plain update. Its own file so
that pytest-xdist can place it beside the trainer's longer end-to-end tests."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import model as M
from trace_jax.rl import step as step_lib
from trace_jax.rl.config import RLConfig
from trace_jax.rl.episodes import Episodes


def test_fused_update_equals_the_separate_pi_old_forward_and_update():
  """A fused step (one minibatch, one epoch): `update` gives the same parameters, Adam state,
  loss, pi_old log-probs, entropy, training-path site records and router choices as an unfused step, whose
  `score` runs pi_old's own forward before `update`, on FP4 QAT with fresh random
  trajectories and rewards."""
  rng = np.random.default_rng(20)
  cfg = M.tiny(num_layers=1)  # one block: the compile is the test's cost
  batch, length = 4, 24
  config = RLConfig.from_flat(
    arm="fp4-qat",
    preset="tiny",
    prompts_per_step=1,
    group_size=batch,
    temperature=0.7,
    learning_rate=1e-3,
    correction="tis",
  )
  tokens = jnp.asarray(rng.integers(5, cfg.vocab_size, (batch, length)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  example = step_lib.TrainExample(
    tokens=tokens,
    positions=positions,
    mask=jnp.ones((batch, length), bool),
    response_mask=jnp.asarray(np.arange(length)[None, :] >= rng.integers(4, 12, (batch, 1))),
    rollout_logp=jnp.asarray(rng.normal(-1.0, 0.3, (batch, length)), jnp.float32),
  )
  rewards = rng.permutation(batch).astype(np.float32) / batch  # distinct: nonzero advantages
  played = Episodes(rollout=None, rewards=rewards, actions=[], turns=np.ones(batch, np.int32))
  collected = step_lib.Collected(played=played, rollout=None, example=example, guidance=None)
  fused = step_lib.StepSpec.of(config, cfg.num_layers)
  assert fused.fused and fused.arm.measured  # one update; both paths FP4: sites recorded
  results = []
  for spec in (fused, dataclasses.replace(fused, fused=False)):
    state = step_lib.init_state(config, M.Transformer(cfg, rngs=nnx.Rngs(7)))
    scored = step_lib.score(spec, state, collected, step=1)
    assert (scored.example.old_logp is None) == spec.fused
    state, done = step_lib.update(spec, state, scored)
    assert (state.step, state.version) == (1, 1) and len(done.losses) == 1
    s = done.scored
    results.append(
      (
        done.losses[0],
        s.example.old_logp,
        s.entropy,
        s.train_sites,
        s.router_choice,
        nnx.state(state.policy, nnx.Param),
        nnx.state(state.opt),
      )
    )
  for a, b in zip(*results):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(
        np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-5, atol=1e-6
      )
  assert jax.tree.leaves(results[0][3])  # the site records are there
  k = cfg.num_experts_per_tok
  assert results[0][4].shape == (cfg.num_moe_layers, batch, length, k)  # the routers' own
