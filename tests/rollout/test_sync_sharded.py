"""Weight sync on a mesh (`rollout.params.sync_params`) on 8 fake CPU devices: the rollout
weights equal single-device `quantize_params` bit for bit, every output carries its
`rollout_param_shardings` sharding, and no array passes through the host (transfer guard)."""

import os
import subprocess
import sys
import textwrap
import pytest

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 " + os.environ.get(
        "XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from trace_jax import model as M
    from trace_jax.model import sharding
    from trace_jax.model.quant import QuantConfig
    from trace_jax.rollout import params as R
    from trace_jax.rollout.config import RolloutConfig
    from trace_jax.rollout.engine import RolloutEngine

    assert jax.device_count() == 8
    cfg = M.tiny(num_layers=1)
    seed = int(np.random.default_rng().integers(1 << 16))
    devices = jax.devices()

    def bits(x):
        return np.asarray(x).view(np.uint8)

    def check(out, ref, mesh):
        targets = jax.tree.leaves(sharding.rollout_param_shardings(out, mesh))
        assert jax.tree.structure(out) == jax.tree.structure(ref)
        for got, want, target in zip(jax.tree.leaves(out), jax.tree.leaves(ref), targets):
            assert got.dtype == want.dtype and np.array_equal(bits(got), bits(want))
            assert got.sharding == target, (got.sharding, target)

    for quant, dtype in ((QuantConfig(), jnp.float32), (QuantConfig(fmt="mxfp4"), jnp.bfloat16),
                         (None, jnp.bfloat16)):
        policy = M.Transformer(cfg, rngs=nnx.Rngs(seed))
        ref = R.quantize_params(nnx.state(policy), quant, dtype=dtype)  # one device, eager
        # The learner's mesh is the rollout's (shared devices): one program, born sharded.
        mesh = sharding.make_mesh(2, 2, 2)
        sharding.shard_model(policy, mesh)
        with jax.transfer_guard("disallow"):
            out = jax.block_until_ready(R.sync_params(nnx.state(policy), quant, mesh, dtype=dtype))
        check(out, ref, mesh)
        # A rollout device group of its own: made on the learner's devices, moved device to device.
        learner = M.Transformer(cfg, rngs=nnx.Rngs(seed))
        sharding.shard_model(learner, sharding.make_mesh(2, 1, 2, devices=devices[4:]))
        group = sharding.make_mesh(4, 1, 1, devices=devices[:4])
        with jax.transfer_guard("disallow"):
            out = jax.block_until_ready(R.sync_params(nnx.state(learner), quant, group, dtype=dtype))
        check(out, ref, group)
        print("OK", quant, flush=True)

    # The engine's weight sync on a mesh takes this path.
    precision = RolloutConfig(precision="fp4", compute_dtype="float32", kernels="xla")
    engine = RolloutEngine(policy, precision, mesh=mesh)
    check(engine.params, R.quantize_params(nnx.state(policy), precision.quant, dtype=jnp.float32), mesh)
    print("OK engine", flush=True)
""")


@pytest.mark.slow
def test_sync_params_sharded_bit_identical_without_host_transfers():
  result = subprocess.run(
    [sys.executable, "-c", SCRIPT],
    capture_output=True,
    text=True,
    env=dict(os.environ),
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert result.stdout.count("OK") == 4, result.stdout
