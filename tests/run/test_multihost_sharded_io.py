"""Two processes on this machine (CPU, gloo collectives), two devices each, one (2, 2, 1)
mesh across them: the weight sync makes each process's slices of the rollout weights in
place (no host transfer) equal to one process's `quantize_params` bit for bit; a checkpoint
saved across the processes restores onto the mesh with each process reading its own
shards; and the export's per-tensor fetch gathers just one tensor across processes, giving
the single-process bytes."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent("""
    import sys
    workdir, process_id, port, seed = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    from trace_jax.utils import distributed
    assert distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from trace_jax import model as M
    from trace_jax.export import compressed_tensors as ct
    from trace_jax.model import sharding
    from trace_jax.model.quant import QuantConfig
    from trace_jax.rollout import params as R
    from trace_jax.run.checkpoint import Checkpoints

    assert jax.process_count() == 2 and jax.device_count() == 4
    cfg = M.tiny(num_layers=1)
    quant = QuantConfig()
    with jax.default_device(jax.local_devices()[0]):  # one process's copy, on one device
        local = M.Transformer(cfg, rngs=nnx.Rngs(seed))
        ref = R.quantize_params(nnx.state(local), quant, dtype=jnp.float32)
    mesh = sharding.make_mesh(2, 2, 1)
    policy = M.Transformer(cfg, rngs=nnx.Rngs(seed))
    sharding.shard_model(policy, mesh)
    assert not jax.tree.leaves(nnx.state(policy))[0].is_fully_addressable

    def same_bits(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()

    def check_local(out, want, targets=None):
        targets = targets or [x.sharding for x in jax.tree.leaves(out)]
        for got, want, target in zip(jax.tree.leaves(out), jax.tree.leaves(want), targets):
            assert got.sharding == target, (got.sharding, target)
            for shard in got.addressable_shards:
                assert same_bits(shard.data, np.asarray(want)[shard.index])

    with jax.transfer_guard("disallow"):
        synced = jax.block_until_ready(R.sync_params(nnx.state(policy), quant, mesh, dtype=jnp.float32))
    check_local(synced, ref, jax.tree.leaves(sharding.rollout_param_shardings(synced, mesh)))
    print("OK sync", flush=True)

    saved = nnx.to_pure_dict(nnx.state(policy))
    checkpoints = Checkpoints(workdir)
    checkpoints.save(1, {"policy": nnx.state(policy)}, {"step": 1})
    like = M.Transformer(cfg, rngs=nnx.Rngs(seed + 1))
    sharding.shard_model(like, mesh)
    restored = Checkpoints(workdir).restore(1, {"policy": nnx.state(like)})["policy"]
    check_local(nnx.to_pure_dict(restored), nnx.to_pure_dict(nnx.state(local)),
                [x.sharding for x in jax.tree.leaves(saved)])
    print("OK checkpoint", flush=True)

    config = ct.ExportConfig()
    want, _ = ct.hf_tensors(local, config)
    got, _ = ct.hf_tensors(policy, config)
    assert sorted(got) == sorted(want)
    assert all(same_bits(got[n], want[n]) for n in want)
    print("OK export", flush=True)
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_sync_checkpoint_and_export_across_two_processes(tmp_path):
  """About a minute (two processes compile): `pytest -m slow`."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=root,
    XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {flags}",
  )
  port, seed = _free_port(), int.from_bytes(os.urandom(2), "little")
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", WORKER, str(tmp_path / "checkpoints"), str(i), str(port), str(seed)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
    )
    for i in range(2)
  ]
  outputs = [p.communicate(timeout=600) for p in procs]
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-4000:]
    assert out.count("OK") == 3, out
