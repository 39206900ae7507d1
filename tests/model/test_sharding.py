"""Sharded forward and train step on 8 fake CPU devices equal the single-device ones."""

import os
import subprocess
import sys
import textwrap

from jax.sharding import PartitionSpec as P

from trace_jax.model import sharding

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from trace_jax import model as M
    from trace_jax.model import sharding

    assert jax.device_count() == 8
    cfg = M.tiny()
    quant = M.QuantConfig()
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, cfg.vocab_size)

    def train(model, tokens, steps=3):
      opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      @nnx.jit
      def step(model, opt, tokens):
        def loss_fn(model):
          logits, aux = model(tokens[:, :-1], quant=quant)
          logp = jax.nn.log_softmax(logits)
          nll = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
          return nll + 0.01 * aux["lb_loss"]
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss
      return [float(step(model, opt, tokens)) for _ in range(steps)]

    forward = nnx.jit(lambda m, t: m(t, quant=quant)[0])
    single = M.Transformer(cfg, rngs=nnx.Rngs(0))
    ref_logits = forward(single, tokens)
    ref_losses = train(single, tokens)

    mesh = sharding.make_mesh(data=2, expert=2, model=2)
    model = sharding.shard_model(M.Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    w = model.blocks[0].moe.w_gate.get_value()
    assert w.addressable_shards[0].data.shape == (cfg.num_experts // 2, cfg.d_model, cfg.moe_ffn_dim // 2), w.addressable_shards[0].data.shape
    assert len({s.device for s in w.addressable_shards}) == 8
    sharded_tokens = jax.device_put(tokens, sharding.batch_sharding(mesh))
    with jax.set_mesh(mesh):
      logits = forward(model, sharded_tokens)
      losses = train(model, sharded_tokens)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    after = model.blocks[0].moe.w_gate.get_value()
    assert after.sharding.spec == w.sharding.spec, after.sharding
    print("OK", losses)
""")


def test_sharded_forward_and_train_step_match_single_device():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  assert "OK" in result.stdout


def test_param_specs():
  assert sharding.param_spec(("blocks", 0, "moe", "w_down"), (8, 64, 32)) == P("expert", "model", None)
  assert sharding.param_spec(("blocks", 0, "moe", "router"), (32, 8)) == P()
  assert sharding.param_spec(("blocks", 0, "attn", "q_proj"), (32, 64)) == P(None, "model")
  assert sharding.param_spec(("blocks", 0, "attn_norm", "scale"), (32,)) == P()
