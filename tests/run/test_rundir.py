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
