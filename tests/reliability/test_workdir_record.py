"""A workdir is one run's: the run's config is recorded in the workdir itself (run.json) and
checked on every start, with or without checkpoints; a resume may not change the learning-
rate schedule; a damaged log or a `checkpoints` that is not a directory is refused before
anything is cut or trained. RunDir alone: no model is built."""

import json
import os

import jax.numpy as jnp
import pytest

from trace_jax.rl.config import RLConfig
from trace_jax.run.checkpoint import Checkpoints
from trace_jax.run.rundir import RUN_RECORD, RunDir
from trace_jax.utils import append_jsonl

BASE = dict(preset="tiny", task="arith", checkpoint_every=0, eval_every=0)


def _config(**overrides) -> RLConfig:
  return RLConfig.from_flat(**{**BASE, **overrides})


def _finished_run(workdir, config: RLConfig, steps=2) -> dict:
  """What a finished run without checkpoints leaves: its record, metrics and summary."""
  rundir = RunDir(str(workdir), config)
  try:
    for step in range(1, steps + 1):
      rundir.log({"step": step, "rewards/mean": 0.25 * step})
    rundir.write_summary({"arm": config.arm, "steps": steps})
  finally:
    rundir.close()
  return {name: (workdir / name).read_bytes() for name in ("metrics.jsonl", "summary.json")}


def test_the_config_is_recorded_in_the_workdir(tmp_path):
  config = _config(arm="trace", seed=3)
  RunDir(str(tmp_path), config).close()
  saved = json.loads((tmp_path / RUN_RECORD).read_text())["config"]
  assert config.differences(saved, ignore=()) == []
  assert RLConfig.from_dict(saved) == config


def test_a_second_run_of_another_arm_without_checkpoints_is_refused(tmp_path):
  before = _finished_run(tmp_path, _config(arm="trace"))
  with pytest.raises(ValueError, match=r"run record \(run\.json\) of a different config.*'arm'"):
    RunDir(str(tmp_path), _config(arm="fp4-qat"))
  after = {name: (tmp_path / name).read_bytes() for name in before}
  assert after == before  # the first run's files are untouched
  RunDir(str(tmp_path), _config(arm="trace")).close()  # the same run may start again


def test_a_run_s_files_without_any_record_of_its_config_are_not_taken_over(tmp_path):
  append_jsonl(str(tmp_path / "metrics.jsonl"), {"step": 1, "rewards/mean": 0.5})
  with pytest.raises(ValueError, match=r"metrics\.jsonl of a run whose config is recorded nowhere"):
    RunDir(str(tmp_path), _config())
  assert not (tmp_path / RUN_RECORD).exists()


def test_unreadable_checkpoint_metadata_is_said(tmp_path, caplog):
  Checkpoints(str(tmp_path / "checkpoints")).save(1, {"x": jnp.arange(3.0)}, {"step": 1})
  RunDir(str(tmp_path), _config()).close()  # meta without a config: nothing to compare
  assert "nothing could be compared with this run's config" in caplog.text


def test_checkpoints_that_is_a_file_is_refused_before_the_log_is_cut(tmp_path):
  config = _config()
  _finished_run(tmp_path, config)
  (tmp_path / "checkpoints").rmdir()  # (empty: the run saved nothing)
  (tmp_path / "checkpoints").write_text("not a directory")
  metrics = (tmp_path / "metrics.jsonl").read_bytes()
  with pytest.raises(ValueError, match=r"checkpoints is not a directory"):
    RunDir(str(tmp_path), config)
  assert (tmp_path / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.parametrize("step", ["1", 1.5, None, True, -1])
def test_a_metrics_line_without_an_integer_step_is_named(tmp_path, step):
  append_jsonl(str(tmp_path / "metrics.jsonl"), {"step": 1})
  append_jsonl(str(tmp_path / "metrics.jsonl"), {"step": step})
  append_jsonl(str(tmp_path / "metrics.jsonl"), {"step": 3})
  with pytest.raises(ValueError, match=rf"metrics\.jsonl: record 2 has step={step!r}"):
    RunDir(str(tmp_path), _config())


def test_resuming_with_other_steps_is_refused_where_the_schedule_depends_on_them(tmp_path):
  _finished_run(tmp_path / "cosine", _config(steps=4, lr_decay="cosine"))
  with pytest.raises(ValueError, match=r"run of steps=4, and its lr_decay='cosine'.*--steps=4"):
    RunDir(str(tmp_path / "cosine"), _config(steps=6, lr_decay="cosine"))
  # a constant learning rate does not depend on `steps`: the run may be extended
  _finished_run(tmp_path / "constant", _config(steps=4, lr_decay="constant"))
  RunDir(str(tmp_path / "constant"), _config(steps=6, lr_decay="constant")).close()
  saved = json.loads((tmp_path / "constant" / RUN_RECORD).read_text())["config"]
  assert RLConfig.flat_dict(saved)["steps"] == 6


def test_checkpoint_meta_with_other_steps_is_refused_too(tmp_path):
  config = _config(steps=4)
  Checkpoints(str(tmp_path / "checkpoints")).save(
    2, {"x": jnp.arange(3.0)}, {"step": 2, "config": config.to_dict()}
  )
  with pytest.raises(ValueError, match=r"checkpoint \(step 2\) of a run of steps=4"):
    RunDir(str(tmp_path), _config(steps=6))
  assert not os.path.exists(tmp_path / RUN_RECORD)
