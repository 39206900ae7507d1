"""experiments/skew_study.py: bad flags are refused before any run; end to end on a tiny
setting (slow: `pytest -m slow tests/studies/test_skew_study_script.py`)."""

import json
import os
import subprocess
import sys

import pytest

from tests.scripts import refusal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "skew_study.py")


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--skews=0.25,-0.5", "--skews=0.25,-0.5"),
    ("--skews=nan", "must be a finite number >= 0"),
    ("--skews=0.25,0.25", "must name distinct skews"),
    ("--arms=ptq", "['ptq'] are not trained arms"),
    ("--correction_variant=clip", "--correction_variant='clip'"),
    ("--setting=rollout_skew=0.1", "['rollout_skew'] are set by the study itself"),
  ],
)
def test_bad_flags_are_refused_before_any_run(tmp_path, flag, message):
  said = refusal(
    "skew_study", flag, f"--workdir={tmp_path / 'runs'}", f"--results={tmp_path / 'r'}"
  )
  assert message in said, said
  assert not (tmp_path / "runs").exists() and not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.timeout(3900)  # two study runs of up to 30 min each
def test_skew_study_runs_every_point_and_aggregates(tmp_path):
  setting = "preset=tiny,steps=2,sft_steps=2,eval_size=4,eval_every=2,prompts_per_step=1"
  cmd = [
    sys.executable,
    SCRIPT,
    "--seeds=0",
    "--more_seeds=",  # one seed never decides a point: no seeds added
    "--skews=0.25,0",
    "--arms=fp4-qat,trace",
    "--correction_variant=tis",
    f"--setting={setting},group_size=2,max_new_tokens=12",
    f"--workdir={tmp_path / 'runs'}",
    f"--results={tmp_path / 'res'}",
  ]
  run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  assert run.returncode == 0, run.stderr[-3000:]
  saved = json.loads((tmp_path / "res" / "results.json").read_text())
  points = [(c["arm"], c["rollout_skew"], c["correction"]) for c in saved["cells"]]
  assert sorted(points) == sorted(
    (a, s, c)
    for a in ("fp4-qat", "trace")
    for s, c in ((0.0, "auto"), (0.25, "auto"), (0.25, "tis"))
  )
  for c in saved["cells"]:  # each cell's own config carries its engine
    assert c["summary"]["config"]["rollout_skew"] == c["rollout_skew"]
    assert c["summary"]["config"]["correction"] == c["correction"]
  by = {(c["arm"], c["rollout_skew"], c["correction"]): c["summary"] for c in saved["cells"]}
  start = {by[k]["initial_eval_reward"] for k in by}
  assert len(start) == 1  # one warm start per seed, copied to every point
  row = next(r for r in saved["rows"] if (r["arm"], r["rollout_skew"]) == ("trace", 0.25))
  assert row["correction"] == "auto" and row["vs_fp4_qat"]["mean"] == pytest.approx(
    by[("trace", 0.25, "auto")]["final_eval_reward"]
    - by[("fp4-qat", 0.25, "auto")]["final_eval_reward"]
  )
  for name in ("table.md", "gain_vs_skew.png", "k3_vs_skew.png", "trace_vs_fp4qat.png"):
    assert (tmp_path / "res" / name).exists()
  again = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  assert again.returncode == 0 and again.stdout.count("finished before, kept") == 6
