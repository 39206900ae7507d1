"""experiments/rl.py on a damaged or full workdir, and with bad flags: only bad flags are usage errors (the flag help); every other
fault ends the run with one line naming what failed, the path and what to do, exit 1."""

import importlib.util
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import pytest

from tests.reliability.reliability_helpers import fill, full_filesystem
from trace_jax.run.checkpoint import Checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "rl.py")
HF = os.path.join(ROOT, "tests", "fixtures", "hf")
TINY = ["--preset=tiny", "--sft_steps=0", "--eval_every=0", "--steps=1"]


def _start(*flags):
  return subprocess.Popen(
    [sys.executable, SCRIPT, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


def _finish(process):
  out, err = process.communicate(timeout=600)
  return process.returncode, out, err


def _error_line(err: str) -> str:
  """The one line the run ends with; no flag help, no traceback."""
  assert "flags:" not in err and "USAGE" not in err and "Traceback" not in err, err[-3000:]
  lines = [line for line in err.splitlines() if line.startswith("rl.py: error: ")]
  assert len(lines) == 1, err[-3000:]
  return lines[0]


def test_faults_of_the_run_are_not_usage_errors(tmp_path):
  # 1. metrics.jsonl damaged in the middle (a torn last line alone would just be dropped).
  damaged_log = tmp_path / "log"
  damaged_log.mkdir()
  (damaged_log / "metrics.jsonl").write_text('{"step": 1}\n{"ste\x00\n{"step": 3}\n')
  # 2. the only checkpoint is damaged (its metadata unreadable, its arrays truncated).
  damaged_ckpt = tmp_path / "ckpt"
  Checkpoints(str(damaged_ckpt / "checkpoints")).save(1, {"x": jnp.arange(4.0)}, {"step": 1})
  (damaged_ckpt / "checkpoints" / "1" / "meta" / "metadata").write_text('{"step": ')
  processes = {
    "log": _start(f"--workdir={damaged_log}", *TINY),
    "ckpt": _start(f"--workdir={damaged_ckpt}", *TINY),
  }
  with full_filesystem(tmp_path / "fs", size_kib=64) as mounted:
    if mounted:  # 3. a full disk (where this machine lets us mount a tiny tmpfs)
      fill(str(tmp_path / "fs"))
      code, _, err = _finish(_start(f"--workdir={tmp_path / 'fs' / 'run'}", *TINY))
      assert code == 1
      assert _error_line(err).startswith(
        f"rl.py: error: workdir '{tmp_path / 'fs' / 'run'}' "
        f"is not writable: [Errno 28] No space left on device"
      )

  code, _, err = _finish(processes["log"])
  assert code == 1
  assert _error_line(err).startswith(
    f"rl.py: error: {damaged_log / 'metrics.jsonl'}, line 2: not valid JSON"
  )
  code, _, err = _finish(processes["ckpt"])
  assert code == 1
  line = _error_line(err)
  assert line.startswith(
    f"rl.py: error: no checkpoint in {damaged_ckpt / 'checkpoints'} restores (step 1: "
  ), line
  assert line.endswith("Move that directory away to start over, or use another --workdir."), line


def test_bad_flags_are_refused_before_any_work(tmp_path):
  # --temperature=nan used to pass RLConfig (nan <= 0 is False) and fail after the warm
  # start; --checkpoint_every is a flag now.
  workdir = tmp_path / "never"
  code, _, err = _finish(
    _start(f"--workdir={workdir}", "--temperature=nan", "--checkpoint_every=5")
  )
  assert code == 1
  assert "FATAL Flags parsing error" not in err
  assert "RLConfig.temperature=nan must be a finite number > 0" in err
  assert not workdir.exists()  # refused before the workdir, warm start or any compilation


@pytest.mark.slow
def test_a_failing_chat_template_is_one_line_before_the_workdir(tmp_path):
  spec = importlib.util.spec_from_file_location(
    "make_tokenizer", os.path.join(HF, "make_tokenizer.py")
  )
  make_tokenizer = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(make_tokenizer)
  checkpoint = tmp_path / "olmoe"
  shutil.copytree(
    os.path.join(HF, "olmoe"),
    checkpoint,
    ignore=shutil.ignore_patterns("expected.npz", "tokenizer*"),
  )
  make_tokenizer.write(
    str(checkpoint), 96, chat_template="{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(0) }}"
  )
  workdir = tmp_path / "never"
  code, _, err = _finish(
    _start(f"--workdir={workdir}", f"--hf_checkpoint={checkpoint}", "--steps=1", "--eval_every=0")
  )
  assert code == 1
  assert _error_line(err) == (
    f"rl.py: error: {checkpoint}/tokenizer_config.json: the chat template failed to render "
    "(RecursionError: maximum recursion depth exceeded)"
  )
  assert not workdir.exists()
