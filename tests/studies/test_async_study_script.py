"""experiments/async_study.py: bad flags are refused before any run; end to end on a tiny
setting (slow: `pytest -m slow tests/studies/test_async_study_script.py`)."""

import json
import os
import subprocess
import sys

import pytest

from tests.scripts import refusal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "async_study.py")


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--staleness=0,-1", "each k must be >= 0"),
    ("--setting=max_staleness=2", "['max_staleness'] are set by the study itself"),
  ],
)
def test_bad_flags_are_refused_before_any_run(tmp_path, flag, message):
  said = refusal("async_study", flag, f"--workdir={tmp_path / 'runs'}", f"--results={tmp_path}")
  assert message in said, said
  assert not (tmp_path / "runs").exists() and not (tmp_path / "study").exists()


@pytest.mark.slow
@pytest.mark.timeout(3900)  # two study runs of up to 30 min each
def test_async_study_runs_both_staleness_values_and_aggregates(tmp_path):
  setting = "preset=tiny,steps=3,sft_steps=2,eval_size=4,eval_every=3,prompts_per_step=1"
  cmd = [
    sys.executable,
    SCRIPT,
    "--seeds=0",
    "--staleness=0,1",
    "--arms=trace",
    "--version_diag_every=1",
    f"--setting={setting},group_size=2,max_new_tokens=12",
    f"--workdir={tmp_path / 'runs'}",
    f"--results={tmp_path / 'res'}",
  ]
  run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  assert run.returncode == 0, run.stderr[-3000:]
  saved = json.loads((tmp_path / "res" / "study" / "results.json").read_text())
  assert [(c["arm"], c["staleness"]) for c in saved["cells"]] == [("trace", 0), ("trace", 1)]
  sync, stale = (c["summary"] for c in saved["cells"])
  assert sync["config"]["schedule"]["max_staleness"] == 0
  assert stale["config"]["schedule"]["max_staleness"] == 1 and stale["max_version_gap"] <= 1
  row = saved["rows"][1]
  assert row["staleness"] == 1 and row["version_k3"] is not None
  assert row["vs_sync"]["mean"] == pytest.approx(
    stale["final_eval_reward"] - sync["final_eval_reward"]
  )
  assert (tmp_path / "res" / "study" / "study.png").exists()
  again = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  assert again.returncode == 0 and again.stdout.count("finished before, kept") == 2
