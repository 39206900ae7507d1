"""`run.rundir.RunDir`: the workdir's config check before a resume."""

import logging
import os

import jax.numpy as jnp
import pytest

from trace_jax.rl.config import RLConfig
from trace_jax.run.checkpoint import Checkpoints
from trace_jax.run.rundir import RunDir


def _save(workdir, step: int, config: RLConfig) -> None:
  Checkpoints(os.path.join(workdir, "checkpoints")).save(
    step, {"x": jnp.arange(4.0) + step}, {"step": step, "config": config.to_dict()}
  )


def test_resume_whose_checkpoint_metadata_all_fail_to_read_says_nothing_was_compared(
  tmp_path, caplog
):
  """Every checkpoint's metadata unreadable: the saved config cannot be compared, and the
  run says so in one line naming the workdir and the steps (it used to pass silently)."""
  workdir = str(tmp_path / "run")
  for step in (2, 5):
    _save(workdir, step, RLConfig.from_flat(preset="tiny", seed=3))
    with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata"), "w") as f:
      f.write("{ torn")
  with caplog.at_level(logging.WARNING, logger="trace_jax.run.rundir"):
    RunDir(workdir, RLConfig.from_flat(preset="tiny", seed=0)).close()
  lines = [r.getMessage() for r in caplog.records if r.name == "trace_jax.run.rundir"]
  assert lines == [
    f"{workdir}: no checkpoint's metadata reads (steps [2, 5]) and there is no run.json: "
    "nothing could be compared with this run's config; the resume goes on unchecked"
  ]


def test_a_readable_checkpoint_is_compared_and_says_nothing_more(tmp_path, caplog):
  """The newest readable metadata is compared (a torn newer one is passed over): the same
  config resumes quietly, another is refused by the fields that differ."""
  workdir = str(tmp_path / "run")
  _save(workdir, 1, RLConfig.from_flat(preset="tiny", seed=3))
  _save(workdir, 4, RLConfig.from_flat(preset="tiny", seed=3))
  with open(os.path.join(workdir, "checkpoints", "4", "meta", "metadata"), "w") as f:
    f.write("{ torn")
  with caplog.at_level(logging.WARNING, logger="trace_jax.run.rundir"):
    RunDir(workdir, RLConfig.from_flat(preset="tiny", seed=3)).close()
  assert not [r for r in caplog.records if r.name == "trace_jax.run.rundir"]
  with pytest.raises(ValueError, match=r"fields that differ: \['seed'\]"):
    RunDir(workdir, RLConfig.from_flat(preset="tiny", seed=0))


def test_a_checkpoint_of_the_other_optimizer_layout_names_scan_layers(tmp_path):
  """Under scan_layers the optimizer's moments are stored by layer stack, without it per
  layer: a checkpoint saved one way does not restore the other, and the error says to resume
  with the --scan_layers it was saved with."""
  from flax import nnx

  from trace_jax import model as M
  from trace_jax.rl import step as step_lib
  from trace_jax.run.checkpoint import CheckpointError

  workdir = str(tmp_path / "run")
  config = RLConfig.from_flat(preset="tiny", seed=0, lr_decay="constant")

  def state(scan):
    policy = M.Transformer(M.tiny(num_layers=2, scan_layers=scan), rngs=nnx.Rngs(0))
    return step_lib.init_state(config, policy).replace(step=1)

  run = RunDir(workdir, config)
  run.save(state(False))
  run.close()
  run = RunDir(workdir, config)
  with pytest.raises(
    CheckpointError,
    match=r"per layer \(no scan_layers\), this run's by layer "
    r"stack \(scan_layers\): resume with --scan_layers=false, as it was saved",
  ):
    run.restore(state(True))
  run.close()
  run = RunDir(workdir, config)
  assert run.restore(state(False)).step == 1  # the layout it was saved with restores
  run.close()


def test_a_decaying_run_is_not_extended_and_the_refusal_says_how_to_start_one_that_can_be(
  tmp_path,
):
  """More --steps than a cosine run started with is refused (its schedule is built from
  steps), and the refusal names the start that can be extended: --lr_decay=constant, which
  then extends."""
  for decay, workdir in (("cosine", tmp_path / "cosine"), ("constant", tmp_path / "constant")):
    RunDir(str(workdir), RLConfig.from_flat(preset="tiny", steps=3, lr_decay=decay)).close()
  with pytest.raises(ValueError) as refused:
    RunDir(str(tmp_path / "cosine"), RLConfig.from_flat(preset="tiny", steps=5))
  assert "resume it with --steps=3, or use another --workdir" in str(refused.value)
  assert "A run that can be extended later starts with --lr_decay=constant" in str(refused.value)
  constant = RLConfig.from_flat(preset="tiny", steps=5, lr_decay="constant")
  RunDir(str(tmp_path / "constant"), constant).close()
