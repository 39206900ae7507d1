"""Two processes on this machine (CPU, gloo collectives, a coordinator on 127.0.0.1) run 2 RL
steps of the tiny preset as one multi-host job: their parameters agree with each other and
with a single-process run of the same global batch; only process 0 writes metrics, and the
step-2 checkpoint is written once (orbax's multi-process save).

The cost is compilation (three processes each compile the RL step), so the default case is
the cheapest arm (bf16: no FP4 packing or guidance capture), the single-process reference
runs on one device (no SPMD partitioning) at the same time as the pair, and every process
compiles at XLA's lowest backend optimisation level (how fast the code runs, not what it
computes; all three use the same flags). The TRACE arm (FP4 rollout, guidance placed across
processes, routing replay) is slow: `pytest -m slow tests/rl/test_multihost.py`.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

WORKER = textwrap.dedent("""
    import json, sys
    workdir, out, num_processes, process_id, port, arm, data = sys.argv[1:8]
    num_processes, process_id, data = int(num_processes), int(process_id), int(data)
    from trace_jax.utils import distributed
    multi = distributed.initialize(f"127.0.0.1:{port}" if num_processes > 1 else None,
                                   num_processes if num_processes > 1 else None,
                                   process_id if num_processes > 1 else None)
    import jax, numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from trace_jax.rl.config import RLConfig
    from trace_jax.run.trainer import Trainer
    assert multi == (num_processes > 1) and jax.process_count() == num_processes
    assert jax.device_count() == data, jax.devices()
    config = RLConfig.from_flat(preset="tiny", arm=arm, steps=2, prompts_per_step=2, group_size=2,
                      minibatches=1, max_new_tokens=4, sft_steps=0, eval_every=0,
                      checkpoint_every=2 if multi else 0, compute_dtype="float32",
                      mesh=(data, 1, 1))
    trainer = Trainer(config, workdir, progress=False)
    history = trainer.run()
    state = nnx.to_pure_dict(nnx.state(trainer.policy, nnx.Param))
    gathered = multihost_utils.process_allgather(state, tiled=True) if multi else state
    flat = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(gathered)}
    local = {"local" + jax.tree_util.keystr(p): np.asarray(v.addressable_shards[0].data)
             for p, v in jax.tree_util.tree_leaves_with_path(state)}
    np.savez(out, **flat, **local)
    print("LOSSES", json.dumps([m["loss"] for m in history]), flush=True)
""")

# Lowest backend optimisation: these runs are all compile time (see the module docstring).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=root,
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
  )


@pytest.mark.parametrize(
  "arm",  # the processes' own limit: 30 min
  ["bf16", pytest.param("trace", marks=[pytest.mark.slow, pytest.mark.timeout(2100)])],
)
def test_two_processes_match_one(tmp_path, arm):
  port = _free_port()
  # The pair (one device each, a 2-way "data" mesh across processes) and the reference (one
  # process, one device, the same global batch), all started at once.
  runs = [(tmp_path / "multi", tmp_path / f"p{i}.npz", 2, i, port, 2) for i in range(2)]
  runs.append((tmp_path / "single", tmp_path / "single.npz", 1, 0, 0, 1))
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", WORKER, *map(str, run[:5]), arm, str(run[5])],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=_env(1),
    )
    for run in runs
  ]
  outputs = [p.communicate(timeout=1800) for p in procs]
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-4000:]

  p0, p1, one = (np.load(tmp_path / f) for f in ("p0.npz", "p1.npz", "single.npz"))
  gathered = [k for k in one.files if not k.startswith("local")]
  assert gathered and set(gathered) <= set(p0.files)
  for key in gathered:
    np.testing.assert_array_equal(p0[key], p1[key], err_msg=key)  # one global array
    np.testing.assert_allclose(p0[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)
  # Each process holds its own shard of FSDP-split parameters (halves that differ) and an
  # identical copy of replicated ones (the norm scales).
  sharded = [k for k in p0.files if k.startswith("local") and p0[k].shape != p0[k[5:]].shape]
  replicated = [k for k in p0.files if k.startswith("local") and k not in sharded]
  assert sharded and replicated
  for key in replicated:
    np.testing.assert_array_equal(p0[key], p1[key], err_msg=key)
  for key in sharded:
    np.testing.assert_array_equal(
      np.concatenate([p0[key], p1[key]], axis=_split_axis(p0, key)), p0[key[5:]], err_msg=key
    )
  losses = [json.loads(out.split("LOSSES", 1)[1]) for out, _ in outputs]
  assert losses[0] == losses[1]
  np.testing.assert_allclose(losses[0], losses[2], rtol=1e-4, atol=1e-6)
  # Files: one metrics line per step (process 0 only), one checkpoint of step 2.
  lines = (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2]
  assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == ["2"]


def _split_axis(arrays, key) -> int:
  local, full = arrays[key].shape, arrays[key[5:]].shape
  return next(i for i, (a, b) in enumerate(zip(local, full)) if a != b)
