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


def test_a_workdir_in_the_hf_checkpoint_it_starts_from_is_refused_before_any_write(tmp_path):
  """--workdir equal to or inside the --hf_checkpoint directory (also through a symbolic
  link) is refused naming both paths, and nothing is written there."""
  source = tmp_path / "model"
  source.mkdir()
  (source / "config.json").write_text("{}")
  (tmp_path / "link").symlink_to(source)
  config = RLConfig.from_flat(preset="tiny", hf_checkpoint=str(source))
  for workdir, where in (
    (source, "is"),
    (source / "run", "lies inside"),
    (tmp_path / "link" / "run", "lies inside"),
  ):
    with pytest.raises(ValueError, match=rf"{where} the hf_checkpoint directory") as refused:
      RunDir(str(workdir), config)
    assert str(workdir) in str(refused.value) and str(source) in str(refused.value)
  assert sorted(os.listdir(source)) == ["config.json"]
  RunDir(str(tmp_path / "beside"), config).close()  # a sibling folder is fine


def test_a_workdir_in_another_run_s_folders_is_refused_before_any_write(tmp_path):
  """A workdir inside another run's checkpoints/ (or its warmstart/, tensorboard/), or that
  folder itself, is refused naming both paths before it is made; a folder of that name in
  a directory that holds no run is an ordinary workdir."""
  first = tmp_path / "first"
  RunDir(str(first), RLConfig.from_flat(preset="tiny")).close()  # records run.json
  before = sorted(os.listdir(first))
  for inner, where in (
    ("checkpoints", "is"),
    ("checkpoints/second", "lies inside"),
    ("warmstart/x", "lies inside"),
    ("tensorboard/y/z", "lies inside"),
  ):
    workdir = first / inner
    with pytest.raises(ValueError, match=rf"\) {where} .* folder of the run in") as refused:
      RunDir(str(workdir), RLConfig.from_flat(preset="tiny", seed=1))
    assert str(workdir) in str(refused.value) and str(first) in str(refused.value)
  assert sorted(os.listdir(first)) == before and not os.listdir(first / "checkpoints")
  RunDir(str(tmp_path / "plain" / "checkpoints" / "run"), RLConfig.from_flat(preset="tiny")).close()


def test_a_run_recorded_on_a_mesh_resumes_on_it_under_the_default(tmp_path, monkeypatch, caplog):
  """A run whose run.json records mesh 1,1,1 (the old default, or one without a mesh field,
  saved before it existed) resumes under today's default -1,1,1 on 8 devices on its own
  mesh, saying so; a fresh workdir takes all 8."""
  import json

  import jax

  from trace_jax.run.rundir import on_devices

  old = str(tmp_path / "old")
  RunDir(old, RLConfig.from_flat(preset="tiny", mesh=(1, 1, 1))).close()
  monkeypatch.setattr(jax, "device_count", lambda: 8)
  default = RLConfig.from_flat(preset="tiny")
  with caplog.at_level(logging.WARNING, logger="trace_jax.run.rundir"):
    resumed = on_devices(default, old)
  assert resumed.mesh == (1, 1, 1)
  assert "resuming on the mesh (1, 1, 1) its run.json records" in caplog.text
  RunDir(old, resumed).close()  # the record's config: accepted
  record = os.path.join(old, "run.json")
  with open(record) as f:
    saved = json.load(f)
  del saved["config"]["mesh"]
  with open(record, "w") as f:
    json.dump(saved, f)
  assert on_devices(default, old).mesh == (1, 1, 1)
  assert on_devices(default, str(tmp_path / "new")).mesh == (8, 1, 1)
  assert on_devices(RLConfig.from_flat(preset="tiny", mesh=(2, 1, 1)), old).mesh == (2, 1, 1)


def _files(folder) -> dict:
  """Every file under `folder` (the lock file aside: the lock is the run's, not its records)
  with its bytes."""
  out = {}
  for directory, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(directory, name)
      if name != "run.lock":
        with open(path, "rb") as f:
          out[os.path.relpath(path, folder)] = f.read()
  return out


def _finished(workdir, config: RLConfig, *, summary: bool = True) -> None:
  """What a finished run of `config` leaves: its record, a checkpoint at its last step, its
  metrics (the step-0 evaluation and each step) and summary.json."""
  steps = config.schedule.steps
  rundir = RunDir(workdir, config)
  try:
    for step in range(steps + 1):
      rundir.log({"step": step, "eval/reward_fp4": 0.1 * step})
    if summary:
      rundir.write_summary({"arm": config.arm, "steps": steps})
  finally:
    rundir.close()
  _save(workdir, steps, config)


@pytest.mark.parametrize("steps", [0, 2])
def test_fewer_steps_than_the_run_reached_are_refused_leaving_its_records(tmp_path, steps):
  """--steps below the step a run reached (steps=0 too) is refused before anything is
  written, naming that step and the evaluation command; the run's files keep every byte.
  A constant learning rate: other steps are otherwise allowed (an extension)."""
  workdir = str(tmp_path / "my run")
  config = RLConfig.from_flat(preset="tiny", steps=4, lr_decay="constant", tensorboard=False)
  _finished(workdir, config)
  before = _files(workdir)
  with pytest.raises(ValueError) as refused:
    RunDir(workdir, config.replace(steps=steps))
  message = str(refused.value)
  assert "\n" not in message
  assert f"the run there already reached step 4, past steps={steps}" in message
  assert f"python experiments/eval.py --workdir='{workdir}'" in message
  assert _files(workdir) == before
  RunDir(workdir, config.replace(steps=6)).close()  # an extension goes on


def test_a_finished_run_started_again_with_its_steps_is_refused_unless_it_lacks_its_summary(
  tmp_path,
):
  """The same steps again: refused once summary.json reports them (nothing to run; its
  summary would be rewritten); a run that trained its steps but never wrote its summary
  may start to write it."""
  config = RLConfig.from_flat(preset="tiny", steps=3, tensorboard=False)
  finished = str(tmp_path / "finished")
  _finished(finished, config)
  before = _files(finished)
  with pytest.raises(ValueError, match=r"already finished its steps=3 \(summary\.json\)"):
    RunDir(finished, config)
  assert _files(finished) == before
  unreported = str(tmp_path / "unreported")
  _finished(unreported, config, summary=False)
  RunDir(unreported, config).close()


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
