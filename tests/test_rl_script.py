"""experiments/rl.py as a person meets it: its help, and what it prints."""

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import types

import pytest
from absl import flags

from tests.scripts import ROOT, load_script
from trace_jax.model.config import PRESETS
from trace_jax.rl.arms import ARMS
from trace_jax.rl.config import RLConfig

# A run whose steps are cheap: Ctrl-C lands between steps, each one checkpointed.
SMOKE = [
  "--preset=tiny",
  "--sft_steps=0",
  "--eval_every=0",
  "--prompts_per_step=1",
  "--group_size=2",
  "--max_new_tokens=4",
  "--checkpoint_every=1",
  "--lr_decay=constant",
  "--notensorboard",
]


def test_help_lists_the_run_flags_by_section_and_exits_0(capsys):
  rl, _ = load_script("rl")
  with pytest.raises(SystemExit) as exit_:
    rl.parse_flags(["rl.py", "--steps=3", "--help"])
  assert exit_.value.code == 0
  text = capsys.readouterr().out
  for section in ("source", "task", "arm", "sampling", "schedule", "evaluation", "scale-out"):
    assert f"\n{section}:" in text, section
  words = " ".join(text.split())  # as wrapped
  assert "dataset:PATH" in words and "rg:NAME" in words
  assert "(default: small; one of: " + ", ".join(PRESETS) + ")" in words
  for name, arm in ARMS.items():  # every arm, with what it does
    assert f" {name} ({arm.describe()})" in words, name
  assert "\n  --steps: RL steps.\n      (default: 150; an integer)" in text
  assert "--lr_decay" in text and "one of: constant, cosine, linear" in text
  assert "--workdir" in text and "--coordinator_address" in text  # the script's own flags


@contextlib.contextmanager
def _flags(rl, *argv):
  """experiments/rl.py's flags parsed from `argv`, unparsed again after (they are global)."""
  rl.parse_flags(["rl.py", *argv])
  try:
    yield
  finally:
    flags.FLAGS.unparse_flags()


class _InterruptedRun:
  """A Trainer stand-in: resumed at step 5 (newest checkpoint: step 5), Ctrl-C at step 7,
  after step 6 was saved."""

  def __init__(self, config, workdir):
    self.config, self.workdir, self.step, self.state = config, os.path.abspath(workdir), 5, None
    self.warmstart = {"task": config.task, "steps": 3, "first_nll": 4.5, "final_nll": 2.25}
    self.saved = 5
    checkpoints = os.path.join(self.workdir, "checkpoints")
    self.checkpoints = types.SimpleNamespace(directory=checkpoints, latest_step=lambda: self.saved)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    pass

  def run(self):
    self.step, self.saved = 7, 6
    raise KeyboardInterrupt


def test_a_resume_says_its_step_and_ctrl_c_ends_with_the_command_that_resumes(
  tmp_path, monkeypatch, capsys
):
  """A resume names its step and checkpoint; Ctrl-C ends with one line (the step reached,
  the checkpoint a rerun resumes from, and the command, shell-quoted: a workdir with a
  space stays one argument), exit status 130."""
  rl, _ = load_script("rl")
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(rl, "Trainer", _InterruptedRun)
  workdir = str(tmp_path / "the run's dir")
  given = ["--preset=tiny", "--steps=9", "--task=chain", "--mesh=1,1,1", "--noscan_layers"]
  with _flags(rl, f"--workdir={workdir}", *given):
    with pytest.raises(SystemExit) as exit_:
      rl.main(["rl.py"])
    before = rl.interrupted_line(RLConfig(), workdir, None)  # Ctrl-C while starting
  assert before == (
    "rl.py: interrupted before the first RL step; to start it again: python experiments/rl.py "
    + shlex.join([f"--workdir={workdir}", *given[2:4], given[0], given[4], given[1]])
  )
  assert exit_.value.code == 130
  out, err = capsys.readouterr()
  assert out.splitlines() == [
    f"workdir {workdir}; warm start: made, 3 SFT steps, NLL 4.500 -> 2.250",
    f"resuming from step 5 (checkpoint {workdir}/checkpoints/5)",
  ]
  (line,) = err.splitlines()
  head = (
    f"rl.py: interrupted at step 7 of 9; it resumes from the checkpoint of step 6 "
    f"({workdir}/checkpoints/6): "
  )
  assert line.startswith(head), line
  assert shlex.split(line[len(head) :]) == [
    "python",
    "experiments/rl.py",
    f"--workdir={workdir}",
    "--task=chain",
    "--mesh=1,1,1",
    "--preset=tiny",
    "--noscan_layers",
    "--steps=9",
  ]


def test_the_export_command_is_shell_quoted(monkeypatch):
  rl, _ = load_script("rl")
  monkeypatch.chdir(ROOT)
  config = RLConfig.from_flat(preset="tiny", activations="fp8")
  trainer = types.SimpleNamespace(
    config=config,
    workdir="/tmp/my run's dir",
    checkpoints=types.SimpleNamespace(latest_step=lambda: 3),
  )
  line = rl.export_command(trainer)
  assert line.startswith("export for vLLM (nvfp4, fp4_sites=all): python ")
  assert shlex.split(line.split(": ", 1)[1]) == [
    "python",
    "experiments/export.py",
    "--workdir=/tmp/my run's dir",
    "--out=/tmp/my run's dir/export",
    "--activations=none",
  ]


@pytest.mark.slow
def test_ctrl_c_mid_run_ends_with_one_line_and_its_command_resumes(tmp_path):
  """SIGINT to a real run (tens of seconds: an RL step compiles): one line, no traceback,
  the workdir released; the printed command, run with --steps past the step it reached,
  resumes from the checkpoint it names and finishes."""
  workdir = tmp_path / "a run"
  run = subprocess.Popen(
    [sys.executable, "experiments/rl.py", f"--workdir={workdir}", *SMOKE, "--steps=1000"],
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1"),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  deadline = time.monotonic() + 600
  metrics = workdir / "metrics.jsonl"  # two lines: step 1 was saved before step 2 logged
  while run.poll() is None and time.monotonic() < deadline:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
      break
    time.sleep(0.2)
  run.send_signal(signal.SIGINT)
  _, err = run.communicate(timeout=300)
  assert run.returncode == 130 and "Traceback" not in err, err[-3000:]
  line = err.strip().splitlines()[-1].split("\r")[-1]  # after the progress bar
  found = re.fullmatch(
    r"rl\.py: interrupted at step (\d+) of 1000; it resumes from the checkpoint of step "
    r"(\d+) \((.*)\): (python .*)",
    line,
  )
  assert found, line
  reached, saved = int(found[1]), int(found[2])
  assert reached >= saved >= 1 and found[3] == str(workdir / "checkpoints" / str(saved))
  assert not (workdir / "run.lock").exists() or "run.lock" not in os.listdir(workdir)
  command = shlex.split(found[4])
  assert command[:3] == ["python", "experiments/rl.py", f"--workdir={workdir}"]
  resumed = subprocess.run(
    [sys.executable, *command[1:], f"--steps={reached + 1}"],
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resuming from step {saved} (checkpoint {found[3]})" in resumed.stdout
