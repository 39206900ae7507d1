"""Device groups across processes (RLConfig.rollout_devices with jax.distributed): two
processes of 4 CPU devices each on this machine (gloo collectives, a coordinator on
127.0.0.1), the rollout group process 0's devices, the learner's (4, 1, 1) mesh process 1's,
max_staleness k = 2 (and k = 0), 4 steps of the tiny preset.

Bit for bit equal to the one-process run of the same config (8 devices) is not what CPU gives:
with gloo enabled the learner's all-reduces over its own 4 devices sum in another order than
one process's (a small matmul's gradient differs in its last bits), so the properties tested
are: a rerun equals the run bit for bit (metrics and parameters); the one-process run agrees to
float tolerance (all but a few elements; those within the Adam steps' size), its rewards and
version gaps exactly; the groups' arrays lie on their own processes' devices; and a failing
side stops both processes in one line each. Slow: each pair compiles the tiny RL step (on 2
cores: ~3.5 min for the first test's seven processes at once, ~1 min for the second's four).
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from trace_jax.rl.config import RLConfig
from trace_jax.rl.metrics import TIMING_METRICS

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent("""
    import json, logging, sys
    workdir, out, nproc, pid, port, fail, k = sys.argv[1:8]
    nproc, pid, k = int(nproc), int(pid), int(k)
    from trace_jax.utils import distributed
    distributed.initialize(f"127.0.0.1:{port}" if nproc > 1 else None,
                           nproc if nproc > 1 else None, pid if nproc > 1 else None)
    import jax, numpy as np
    from flax import nnx
    jax.config.update("jax_default_matmul_precision", "highest")
    from trace_jax.rl import step as step_lib
    from trace_jax.rl.config import RLConfig
    from trace_jax.run.trainer import Trainer
    if fail == "rollout" and pid == 0:  # batch 2 (step 3) fails on the rollout process
      collect = step_lib.collect
      def failing(spec, engine, task, tokenizer, step, version):
        if step == 3:
          raise OSError("rollout host lost")
        return collect(spec, engine, task, tokenizer, step, version)
      step_lib.collect = failing
    if fail == "learner" and pid == 1:  # step 2's update fails on the learner process
      update = step_lib.update
      def failing(spec, state, scored):
        if state.step == 1:
          raise OSError("learner device lost")
        return update(spec, state, scored)
      step_lib.update = failing
    config = RLConfig.from_flat(task="arith", preset="tiny", steps=4, prompts_per_step=2,
      group_size=4, max_new_tokens=4, sft_warm_start=False, eval_every=0, checkpoint_every=0,
      prompt_bucket=32, tensorboard=False, mesh=(4, 1, 1), lr_decay="constant",
      rollout_devices=4, max_staleness=k)
    ids = lambda tree: sorted({d.id for leaf in jax.tree.leaves(tree) for d in leaf.devices()})
    with Trainer(config, workdir, progress=False) as trainer:
      history = trainer.run()
      if trainer.role == "rollout":
        record = {"role": "rollout", "engine": ids(trainer._server.engine.params)}
      else:
        policy = nnx.to_pure_dict(nnx.state(trainer.policy))
        np.savez(out, **{jax.tree_util.keystr(p): np.asarray(v)
                         for p, v in jax.tree_util.tree_leaves_with_path(policy)})
        record = {"role": trainer.role, "history": history, "policy": ids(policy),
                  "opt": ids(nnx.state(trainer.state.opt)),
                  "ring": ids([trainer._async.ring.get(v) for v in trainer._async.ring.versions]),
                  "local": [d.id for d in jax.local_devices()]}
    print("RECORD", json.dumps(record), flush=True)
""")

TIMING = TIMING_METRICS


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(workdir, out, nproc, pid, port, fail="none", k=2):
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=root,
    XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // nproc}",
  )
  return subprocess.Popen(
    [sys.executable, "-c", WORKER, *map(str, (workdir, out, nproc, pid, port, fail, k))],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
  )


def _pair(tmp_path, name, fail="none", k=2):
  port = _free_port()
  return [_start(tmp_path / name, tmp_path / f"{name}{i}.npz", 2, i, port, fail, k) for i in (0, 1)]


def _finish(procs, timeout=900):
  start, results = time.monotonic(), []
  for p in procs:
    out, err = p.communicate(timeout=max(1, timeout - (time.monotonic() - start)))
    record = json.loads(out.split("RECORD", 1)[1]) if "RECORD" in out else None
    results.append({"rc": p.returncode, "record": record, "err": err})
  return results


def _strip(history):
  return [
    {k: v for k, v in m.items() if k not in TIMING and not k.startswith("async/")} for m in history
  ]


def test_two_processes_reproduce_and_agree_with_one(tmp_path):
  runs = {"a": _pair(tmp_path, "a"), "b": _pair(tmp_path, "b"), "zero": _pair(tmp_path, "z", k=0)}
  runs["one"] = [_start(tmp_path / "one", tmp_path / "one1.npz", 1, 0, 0)]
  done = {name: _finish(procs) for name, procs in runs.items()}
  for name, results in done.items():
    for r in results:
      assert r["rc"] == 0, (name, r["err"][-4000:])
  (rollout, learner), (_, rerun), (one,) = done["a"], done["b"], done["one"]
  rollout, learner, rerun, one = (r["record"] for r in (rollout, learner, rerun, one))
  # the groups: process 0's devices generate, process 1's train, nothing shared
  assert rollout["role"] == "rollout" and learner["role"] == "learner"
  local = learner["local"]
  assert len(local) == 4 and not set(local) & set(rollout["engine"])
  assert learner["policy"] == learner["opt"] == learner["ring"] == local
  assert len(rollout["engine"]) == 4
  history = learner["history"]
  assert [m["step"] for m in history] == [1, 2, 3, 4]
  assert [m["async/version_gap"] for m in history] == [0, 1, 2, 2]
  assert [m["async/rollout_version"] for m in history] == [0, 0, 0, 1]
  assert all(m["async/rollout_devices"] == ",".join(map(str, rollout["engine"])) for m in history)
  assert all(m["async/learner_devices"] == ",".join(map(str, local)) for m in history)
  # only the learner's process wrote the metrics: one line per step
  lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
  # a rerun: bit for bit
  assert _strip(history) == _strip(rerun["history"])
  a, b, c = (np.load(tmp_path / f) for f in ("a1.npz", "b1.npz", "one1.npz"))
  assert sorted(a.files) == sorted(c.files)
  # Against one process: an all-reduce's last-bit difference can tip a near-zero Adam
  # moment, and Adam moves an element by about the learning rate a step whatever its
  # gradient's size. So nearly every element agrees to float tolerance, and none differs
  # by more than the 4 steps' largest total move, 2 * lr each.
  lr = RLConfig.from_flat(task="arith", preset="tiny").schedule.learning_rate
  for key in a.files:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    close = np.isclose(a[key], c[key], rtol=1e-5, atol=1e-6)
    assert close.mean() >= 0.999, (key, int((~close).sum()), close.size)
    np.testing.assert_allclose(a[key], c[key], rtol=0, atol=4 * 2 * lr, err_msg=key)
  # one process, 8 devices: the same batches (rewards, lengths, gaps), floats to tolerance
  for mine, theirs in zip(history, one["history"]):
    for key in ("rewards/mean", "completions/mean_length", "async/version_gap"):
      assert mine[key] == theirs[key], key
    np.testing.assert_allclose(mine["loss"], theirs["loss"], rtol=1e-4, atol=1e-6)
  # k = 0 across processes: each batch made with the weights of the update just before it
  zero = done["zero"][1]["record"]["history"]
  assert [m["async/version_gap"] for m in zero] == [0, 0, 0, 0]
  assert [m["async/rollout_version"] for m in zero] == [0, 1, 2, 3]
  for key in ("rewards/mean", "completions/mean_length"):  # step 1: the same batch
    assert zero[0][key] == history[0][key], key


def test_a_failing_side_stops_both_processes_in_one_line(tmp_path):
  runs = {side: _pair(tmp_path, side, fail=side) for side in ("rollout", "learner")}
  done = {side: _finish(procs, timeout=600) for side, procs in runs.items()}
  lines = {
    "rollout": "rollout worker (devices 0,1,2,3) failed generating batch 2: OSError: "
    "rollout host lost",
    "learner": "learner (devices 2048,2049,2050,2051) failed at step 2: OSError: learner "
    "device lost; the rollout worker stops",
  }
  for side, results in done.items():
    for pid, r in enumerate(results):
      assert r["rc"] != 0, (side, pid)
      errors = [line for line in r["err"].splitlines() if line.startswith("ERROR:")]
      assert len(errors) == 1, (side, pid, errors)
      assert errors[0].endswith(lines[side]), (side, pid, errors)
