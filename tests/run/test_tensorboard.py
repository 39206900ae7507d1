"""The TensorBoard events of a run equal its metrics.jsonl: every JSON number of every line
at its step, the config once as text; a resume after a crash rewrites them from the cut
metrics.jsonl, so no step appears twice; --tensorboard=false writes none. RunDir alone (no
model), and one short Trainer run with a resume."""

import json
import os
import shutil
import textwrap

import numpy as np
import pytest
from absl import flags as absl_flags
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trace_jax.rl.config import RLConfig
from trace_jax.run.rundir import RunDir, read_metrics
from trace_jax.utils import flags as config_flags

BASE = dict(preset="tiny", task="arith", checkpoint_every=0, eval_every=0)


def _config(**overrides) -> RLConfig:
  return RLConfig.from_flat(**{**BASE, **overrides})


def _events(workdir) -> EventAccumulator:
  """Every event the files hold: without purge_orphaned_data, which would hide a stale
  step's event behind a rewritten one."""
  events = EventAccumulator(
    str(workdir / "tensorboard"), size_guidance={"scalars": 0}, purge_orphaned_data=False
  )
  events.Reload()
  return events


def _curves(workdir) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} as TensorBoard reads the run's event files."""
  events = _events(workdir)
  return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _expected(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
  """The curves of metrics lines by hand: each int or float value but the step."""
  out = {}
  for record in records:
    for key, value in record.items():
      if key != "step" and type(value) in (int, float):
        out.setdefault(key, []).append((record["step"], value))
  return out


def _assert_curves_equal(workdir) -> None:
  got, want = _curves(workdir), _expected(read_metrics(str(workdir)))
  assert sorted(got) == sorted(want)
  for tag in want:
    assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
    np.testing.assert_allclose(
      [v for _, v in got[tag]], np.float32([v for _, v in want[tag]]), rtol=1e-6, err_msg=tag
    )


def _line(rng, step: int) -> dict:
  return {
    "step": step,
    "rewards/mean": float(rng.uniform()),
    "mismatch/k3_kl": float(rng.lognormal(-8, 2)),
    "tokens": int(rng.integers(1, 10_000)),
    "loss": float(rng.normal()) if step % 2 else float("nan"),
    "arm": "trace",  # neither strings, None, booleans nor lists are scalars
    "eval/reward_fp4": None,
    "stopped": False,
    "per_layer": [1.0, 2.0],
  }


def test_every_number_of_every_line_is_a_scalar_at_its_step(tmp_path):
  rng = np.random.default_rng(0)
  config = _config(seed=int(rng.integers(100)))
  rundir = RunDir(str(tmp_path), config)
  try:
    rundir.log({"step": 0, "eval/reward_fp4": 0.25, "eval/reward_bf16": 0.5})
    for step in range(1, 6):
      rundir.log(_line(rng, step))
  finally:
    rundir.close()
  _assert_curves_equal(tmp_path)
  curves = _curves(tmp_path)
  assert curves["eval/reward_fp4"] == [(0, 0.25)]  # the step-0 evaluation too
  assert np.isnan(curves["loss"][1][1])  # NaN is kept as NaN
  assert not {"arm", "stopped", "per_layer", "step"} & set(curves)
  # the config, once, as text
  texts = _events(tmp_path).Tensors("config/text_summary")
  assert len(texts) == 1 and texts[0].step == 0
  text = texts[0].tensor_proto.string_val[0].decode()
  assert json.loads(textwrap.dedent(text)) == json.loads(json.dumps(config.to_dict()))


def test_a_resume_after_a_crash_has_each_step_once(tmp_path):
  """A crash after step 5 with the newest checkpoint at step 3: the events of steps 4-5 (and
  the queued ones) were written, metrics.jsonl is cut back to 3 and steps 4-6 logged again
  with new values; the events equal metrics.jsonl."""
  rng = np.random.default_rng(1)
  config = _config()
  crashed = RunDir(str(tmp_path), config)
  crashed.log({"step": 0, "eval/reward_fp4": 0.1})
  for step in range(1, 6):
    crashed.log(_line(rng, step))
  crashed._events.close()  # what reached the disk before the crash
  crashed._unlock()  # the process died: its lock went with it; nothing else was closed
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "rewards/me')  # a torn last line
  resumed = RunDir(str(tmp_path), config)
  try:
    resumed._truncate_metrics(3)  # what `restore` does with a checkpoint at step 3
    _assert_curves_equal(tmp_path)
    for step in range(4, 7):
      resumed.log(_line(rng, step))
  finally:
    resumed.close()
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3, 4, 5, 6]
  _assert_curves_equal(tmp_path)
  assert [n for n in os.listdir(tmp_path) if "tensorboard" in n] == ["tensorboard"]
  assert len(_events(tmp_path).Tensors("config/text_summary")) == 1


def test_a_start_from_step_0_rewrites_the_events_empty(tmp_path):
  """A run with no checkpoint starts over (metrics.jsonl emptied): so do its events; the
  folders a start cut off while rewriting left are removed."""
  config = _config()
  first = RunDir(str(tmp_path), config)
  for step in range(1, 4):
    first.log({"step": step, "rewards/mean": step / 4})
  first.close()
  # a start on another host, cut off while rewriting: its staging folder and the old one
  for leftover in (".tensorboard.tmp-7-0badbeef-0123456789ab", ".tensorboard.old-7-0badbeef-a"):
    (tmp_path / leftover).mkdir()
    (tmp_path / leftover / "events.out.tfevents.0.x.history").write_bytes(b"junk")
  again = RunDir(str(tmp_path), config)
  try:
    again._truncate_metrics(0)
    assert _curves(tmp_path) == {}
    again.log({"step": 1, "rewards/mean": 0.75})
  finally:
    again.close()
  assert _curves(tmp_path) == {"rewards/mean": [(1, 0.75)]}
  assert [n for n in os.listdir(tmp_path) if "tensorboard" in n] == ["tensorboard"]


def test_tensorboard_false_writes_nothing(tmp_path):
  rundir = RunDir(str(tmp_path), _config(tensorboard=False))
  try:
    rundir._truncate_metrics(0)
    rundir.log({"step": 1, "rewards/mean": 0.5})
  finally:
    rundir.close()
  assert not (tmp_path / "tensorboard").exists()
  assert read_metrics(str(tmp_path)) == [{"step": 1, "rewards/mean": 0.5}]
  # and a resume may turn it on (how the run logs, not what it computes): the events then
  # hold the lines logged before
  rundir = RunDir(str(tmp_path), _config(tensorboard=True))
  try:
    rundir._truncate_metrics(1)
  finally:
    rundir.close()
  assert _curves(tmp_path) == {"rewards/mean": [(1, 0.5)]}


def test_the_flag_and_its_refusals(tmp_path):
  for argv, want in (([], True), (["--tensorboard=false"], False), (["--notensorboard"], False)):
    flag_values = absl_flags.FlagValues()
    holders = config_flags.define_flags(RLConfig, flag_values=flag_values)
    flag_values(["rl.py", *argv])
    assert config_flags.from_flags(RLConfig, holders).evaluation.tensorboard is want, argv
  with pytest.raises(ValueError, match=r"RLConfig.tensorboard='no' must be a bool"):
    _config(tensorboard="no")
  (tmp_path / "elsewhere").mkdir()
  for make in (
    lambda path: path.write_text("not a directory"),
    lambda path: path.symlink_to(tmp_path / "elsewhere"),  # the rename would replace the link
  ):
    (tmp_path / "run").mkdir()
    make(tmp_path / "run" / "tensorboard")
    with pytest.raises(ValueError, match=r"tensorboard is not a directory.*--tensorboard=false"):
      RunDir(str(tmp_path / "run"), _config())
    RunDir(str(tmp_path / "run"), _config(tensorboard=False)).close()  # then it is not ours
    shutil.rmtree(tmp_path / "run")


def test_a_log_waits_only_for_a_full_queue(tmp_path):
  """The events are written by a thread: lines queued beyond the thread's pace are all
  written by close, in order."""
  from trace_jax.run.tensorboard import EventLog

  events = EventLog(str(tmp_path), [], {"arm": "trace"}, max_pending=2)
  lines = [{"step": s, "rewards/mean": s / 100} for s in range(1, 51)]
  for line in lines:
    events.log(line)
    line["rewards/mean"] = -1.0  # changed after it was queued: the queued value is written
  events.close()
  events.close()  # idempotent
  got = _curves(tmp_path)["rewards/mean"]
  assert [s for s, _ in got] == list(range(1, 51))
  np.testing.assert_allclose([v for _, v in got], np.float32([s / 100 for s in range(1, 51)]))
  with pytest.raises(ValueError, match="closed"):
    events.log({"step": 51})


def _trainer_config(**overrides) -> RLConfig:
  base = dict(
    task="arith",
    preset="tiny",
    steps=2,
    prompts_per_step=2,
    group_size=2,
    minibatches=1,
    max_new_tokens=4,
    sft_steps=0,
    eval_size=2,
    eval_every=1,
    checkpoint_every=1,
    prompt_bucket=32,
    lr_decay="constant",
  )
  return RLConfig.from_flat(**{**base, **overrides})


@pytest.mark.slow  # ~75 s on 2 cores: two runs' compilations
def test_a_trainer_run_and_its_resume_log_what_metrics_jsonl_holds(tmp_path):
  """A run of 2 steps whose step-2 checkpoint is lost (a crash between its line and its
  save): the resume from step 1 reruns step 2; its events are the new line's, once."""
  from trace_jax.run.trainer import Trainer

  config = _trainer_config()
  with Trainer(config, str(tmp_path), progress=False) as first:
    first.run()
  _assert_curves_equal(tmp_path)
  assert [s for s, _ in _curves(tmp_path)["eval/reward_fp4"]] == [0, 1, 2]  # step 0 too
  shutil.rmtree(tmp_path / "checkpoints" / "2")
  with Trainer(config, str(tmp_path), progress=False) as resumed:
    assert resumed.step == 1
    resumed.run()
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2]
  _assert_curves_equal(tmp_path)
  assert [s for s, _ in _curves(tmp_path)["rollout_seconds"]] == [1, 2]


def test_a_failed_write_is_said_once_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
  """A full disk under the writer thread: one warning, the rest dropped, no log call waits
  forever (the queue still drains), close returns."""
  from trace_jax.run import tensorboard

  def full_disk(self, step, values):
    raise OSError(28, "No space left on device")

  events = tensorboard.EventLog(str(tmp_path), [], {"arm": "trace"}, max_pending=2)
  monkeypatch.setattr(tensorboard._EventsFile, "write_scalars", full_disk)
  with caplog.at_level("WARNING", logger="trace_jax.run.tensorboard"):
    for step in range(1, 50):  # more than the queue holds
      events.log({"step": step, "rewards/mean": 0.5})
    events.close()
  warnings = [r for r in caplog.records if "writing TensorBoard events failed" in r.message]
  assert len(warnings) == 1 and "No space left" in warnings[0].message
  assert _curves(tmp_path) == {}
