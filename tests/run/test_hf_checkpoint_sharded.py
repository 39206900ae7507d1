"""RL from a checkpoint read straight onto the learner's mesh (`from_hf(..., mesh=)` through
`policy_source.load_hf_policy`), against the same run from a checkpoint read whole and placed
afterwards: 8 fake CPU devices, in a subprocess (the device count is fixed at jax's import).

Slow (two whole runs, ~1 min): `pytest -m slow tests/run/test_hf_checkpoint_sharded.py`. The
default suite keeps the parts: the sharded load equals the whole load bit for bit
(tests/model/test_hf_sharded.py), and RL steps from a checkpoint loaded onto a mesh across
processes (tests/studies/test_scale_check_script.py)."""

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
  """
  import os, sys
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  sys.path.insert(0, TESTS)
  import jax, numpy as np
  from flax import nnx
  from trace_jax.model import hf, sharding
  from trace_jax.rl.config import RLConfig
  from trace_jax.run import policy_source
  from trace_jax.run.trainer import Trainer
  from tests.run.test_hf_checkpoint import SYSTEM, TINY, checkpoint

  path = checkpoint(ROOT, "qwen3_moe")
  config = RLConfig.from_flat(
    arm="trace", hf_checkpoint=path, system_prompt=SYSTEM, mesh=[4, 2, 1], **TINY
  )
  reads = []
  def spy(path, mesh=None, **overrides):
    reads.append(mesh)
    return hf.from_hf(path, mesh=mesh, **overrides)
  policy_source.from_hf = spy
  runs = {}
  for how in ("sharded", "whole"):
    if how == "whole":  # the checkpoint read whole onto one device, then placed by the rules
      policy_source.from_hf = lambda path, mesh=None, **overrides: hf.from_hf(path, **overrides)
    trainer = Trainer(config, os.path.join(ROOT, how), progress=False)
    state = nnx.state(trainer.policy, nnx.Param)
    rules = sharding.param_shardings(trainer.policy, trainer.mesh)
    for (p, leaf), (_, want) in zip(nnx.to_flat_state(state), nnx.to_flat_state(rules)):
      assert leaf.get_value().sharding.is_equivalent_to(want.get_value(), leaf.get_value().ndim), p
    start = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
    history = trainer.run()
    end = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.policy, nnx.Param)))
    runs[how] = (start, [(m["loss"], m["rewards/mean"], m["mismatch/k3_kl"]) for m in history], end)
    trainer.close()
  assert reads and reads[0] is not None and reads[0].devices.size == 8, reads
  jax.tree.map(np.testing.assert_array_equal, runs["sharded"][0], runs["whole"][0])
  assert runs["sharded"][1] == runs["whole"][1], (runs["sharded"][1], runs["whole"][1])
  jax.tree.map(np.testing.assert_array_equal, runs["sharded"][2], runs["whole"][2])
  print("OK", runs["sharded"][1])
  """
)


@pytest.mark.slow
def test_rl_from_a_checkpoint_read_onto_the_mesh_equals_read_whole_then_placed(tmp_path):
  tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  script = f"TESTS = {tests!r}\nROOT = {str(tmp_path)!r}\n" + _SCRIPT
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env
  )
  assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
