"""An RL run under faults: SIGKILL during a checkpoint save, a damaged latest
checkpoint, divergence, a crash before the first checkpoint. Each resumes from the last
good checkpoint, logs every step exactly once and ends where an uninterrupted run ends."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax.rl import optimizer as optimizer_lib
from trace_jax.rl import step as step_lib
from trace_jax.rl.config import RLConfig
from trace_jax.rl.metrics import TIMING_METRICS
from trace_jax.rl.step import DivergenceError
from trace_jax.run.rundir import read_metrics
from trace_jax.run.trainer import Trainer

# Compiles whole RL / rollout programs: minutes on 2 cores; `pytest -m slow` runs it.
pytestmark = pytest.mark.slow

# The smallest run the trainer allows: bf16 arm, 1 problem x 2 samples, 2 new tokens, no SFT,
# no evaluation, a checkpoint every step; a constant learning rate, so a resume may extend the
# run's steps (a decaying schedule is built from them, and such a resume is refused).
CONFIG = dict(
  arm="bf16",
  task="arith",
  preset="tiny",
  steps=3,
  prompts_per_step=1,
  group_size=2,
  minibatches=1,
  max_new_tokens=2,
  sft_steps=0,
  eval_every=0,
  eval_size=1,
  checkpoint_every=1,
  prompt_bucket=16,
  lr_decay="constant",
)


def _config(**overrides) -> RLConfig:
  return RLConfig.from_flat(**{**CONFIG, **overrides})


def _params(trainer):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.policy)))


def _steps(workdir):
  return [m["step"] for m in read_metrics(str(workdir))]


def _strip(metrics):
  """The metrics without the ones that time the run (they differ between identical runs)."""
  return [{k: v for k, v in m.items() if k not in TIMING_METRICS} for m in metrics]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
  """A run killed with SIGKILL during the save of step 2, started first: it compiles in its
  own process while this one makes the uninterrupted run (2 cores: about half the wall time)."""
  workdir = tmp_path_factory.mktemp("killed") / "run"
  process = subprocess.Popen(
    [sys.executable, "-c", KILL_SCRIPT, str(workdir), repr(CONFIG)],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  yield workdir, process
  if process.poll() is None:
    process.kill()
    process.communicate()


@pytest.fixture(scope="module")
def straight(killed, tmp_path_factory):
  """An uninterrupted 3-step run: (workdir, final params, metrics)."""
  workdir = tmp_path_factory.mktemp("straight")
  trainer = Trainer(_config(), str(workdir), progress=False)
  trainer.run()
  return workdir, _params(trainer), read_metrics(str(workdir))


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    from orbax.checkpoint._src.path import atomicity
    from trace_jax.rl.config import RLConfig
    from trace_jax.run.trainer import Trainer

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def killing_finalize(self, *args, **kwargs):
      # The step-2 checkpoint is written but not yet renamed into place: die right here.
      if self.get_final().name == "2":
        print("killing during the save of step 2", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
      return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = killing_finalize
    config = RLConfig.from_flat(**{**eval(sys.argv[2]), "steps": 3})
    Trainer(config, sys.argv[1], progress=False).run()
    print("not killed")
""")


def test_sigkill_during_checkpoint_save_then_resume(killed, straight):
  workdir, process = killed
  stdout, stderr = process.communicate(timeout=900)
  assert process.returncode == -signal.SIGKILL, stderr[-3000:]
  assert "killing during the save of step 2" in stdout
  stale = glob.glob(str(workdir / "checkpoints" / "2.orbax-checkpoint-tmp*"))
  assert stale, os.listdir(workdir / "checkpoints")  # the kill left a half-made checkpoint
  assert _steps(workdir) == [1, 2]  # step 2 was logged, then killed before its checkpoint

  resumed = Trainer(_config(), str(workdir), progress=False)
  assert resumed.step == 1  # the last complete checkpoint
  assert not glob.glob(str(workdir / "checkpoints" / "*orbax-checkpoint-tmp*"))  # cleaned
  assert _steps(workdir) == [1]  # the log agrees with the checkpoint it resumes from
  resumed.run()
  assert _steps(workdir) == [1, 2, 3]  # every step exactly once
  _, params, metrics = straight
  jax.tree.map(np.testing.assert_array_equal, _params(resumed), params)
  assert _strip(read_metrics(str(workdir))) == _strip(metrics)


def _damage_latest(checkpoints: str) -> int:
  """Truncate the largest array data file of the newest checkpoint; return its step."""
  step = max(int(name) for name in os.listdir(checkpoints) if name.isdigit())
  files = [
    f
    for f in glob.glob(
      os.path.join(checkpoints, str(step), "state", "**", "d", "*"), recursive=True
    )
    if os.path.isfile(f)
  ]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.truncate(os.path.getsize(largest) // 3)
  return step


def test_damaged_latest_checkpoint_falls_back_to_the_previous(straight, tmp_path, caplog):
  source, params, metrics = straight
  workdir = tmp_path / "run"
  shutil.copytree(source, workdir)
  assert _damage_latest(str(workdir / "checkpoints")) == 3
  resumed = Trainer(_config(), str(workdir), progress=False)
  assert resumed.step == 2  # step 3 does not restore; step 2 (orbax keeps 2) does
  assert [s for s, _ in resumed.checkpoints.skipped] == [3]
  assert any(
    "checkpoint step 3" in r.getMessage() and "does not restore" in r.getMessage()
    for r in caplog.records
  )
  assert os.listdir(workdir / "checkpoints_unusable")[0].startswith("3-")  # kept, moved aside
  assert _steps(workdir) == [1, 2]
  resumed.run()  # re-does step 3 (its checkpoint number is free again)
  assert _steps(workdir) == [1, 2, 3]
  jax.tree.map(np.testing.assert_array_equal, _params(resumed), params)
  assert resumed.checkpoints.latest_step() == 3


def test_divergence_stops_before_saving_and_keeps_the_last_good_checkpoint(straight, tmp_path):
  source, params, _ = straight
  workdir = tmp_path / "run"
  shutil.copytree(source, workdir)
  # The saved config keeps its learning rate (so the resume is accepted), but the update is
  # made with 1e30 (an optimizer of that rate holding the restored Adam state): step 4 blows
  # the weights up to ~1e30, finite and with a healthy loss.
  trainer = Trainer(_config(steps=4), str(workdir), progress=False)
  assert trainer.step == 3
  by_layer = step_lib.scans_layers(trainer.policy)  # the restored moments' layout
  opt = nnx.Optimizer(
    trainer.policy, optimizer_lib.optimizer(1e30, by_layer=by_layer), wrt=nnx.Param
  )
  nnx.update(opt, nnx.state(trainer.state.opt))
  trainer.state = trainer.state.replace(opt=opt)
  with pytest.raises(
    DivergenceError,
    match=r"^step 4 diverged: max \|parameter\| is 1(\.\d+)?e\+30, "
    r"beyond RLConfig.max_param_abs=10000\. Nothing of step "
    r"4 was saved; the latest checkpoint, step 3 in .*, is "
    r"the last good one",
  ):
    trainer.run()
  assert trainer.checkpoints.latest_step() == 3  # nothing of step 4 was saved
  assert _steps(workdir) == [1, 2, 3]  # nor logged
  again = Trainer(_config(steps=4), str(workdir), progress=False)
  assert again.step == 3
  jax.tree.map(np.testing.assert_array_equal, _params(again), params)


@pytest.mark.slow  # a fresh run (~10 s); the test above covers the guard in the default suite
def test_huge_learning_rate_diverges_at_step_one_and_saves_nothing(tmp_path):
  # Once, --learning_rate=1e30 --minibatches=1 logged step 1, exited 0 and
  # saved weights of 1e30 that every resume then died on.
  with pytest.raises(DivergenceError, match=r"step 1 diverged.*no checkpoint was saved"):
    Trainer(_config(learning_rate=1e30, steps=2), str(tmp_path), progress=False).run()
  assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()]
  assert not os.path.exists(tmp_path / "metrics.jsonl") or _steps(tmp_path) == []


def test_crash_before_the_first_checkpoint_logs_each_step_once(tmp_path):
  # What a crash at step 2 of 2 with checkpoint_every=20 left: the step-0 evaluation, steps 1
  # and 2, a torn append, no checkpoint and no summary. The rerun starts from step 0, so none
  # of it may stay (the old code kept the step-0 line and logged it again).
  config = _config(checkpoint_every=20, steps=2)
  Trainer(config, str(tmp_path), progress=False).close()  # the run's record, made at its start
  lines = [json.dumps({"step": s, "rewards/mean": 0.5}) for s in (0, 1, 2)]
  (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"ste')
  trainer = Trainer(config, str(tmp_path), progress=False)
  assert trainer.step == 0
  assert (tmp_path / "metrics.jsonl").read_text() == ""
