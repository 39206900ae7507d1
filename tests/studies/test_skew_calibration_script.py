"""experiments/skew_calibration.py end to end at the smallest settings: the cells, the
summary files, a rerun that skips every cell, and the skews it refuses."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.scripts import refusal

from trace_jax.studies.mismatch import MODES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "skew_calibration.py")
SMALL = ("--preset=tiny", "--sft_steps=2", "--sft_batch=4", "--rollouts=2", "--new_tokens=4")


def _run(out, *extra, timeout=600):
  cmd = [sys.executable, SCRIPT, *SMALL, f"--out={out}", *extra]
  env = {**os.environ, "PYTHONPATH": ROOT}
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_calibration_writes_every_cell_and_a_rerun_skips_them(tmp_path):
  skews = (0.0, 0.03125)
  out = tmp_path / "cal"
  done = _run(out, "--skews=0,0.03125")
  assert done.returncode == 0, done.stderr[-3000:]
  cells = {s: json.loads((out / f"skew_{s!r}.json").read_text()) for s in skews}
  assert "rollout_skew" not in cells[0.0]["config"]  # the unskewed study's own config
  assert cells[0.03125]["config"]["rollout_skew"] == 0.03125
  results = json.loads((out / "results.json").read_text())
  assert [r["rollout_skew"] for r in results["rows"]] == list(skews)
  for row in results["rows"]:
    cell = cells[row["rollout_skew"]]
    assert row["config"] == cell["config"]
    assert set(row["modes"]) == set(MODES)
    for mode in MODES:
      assert row["modes"][mode]["k3_kl"] == cell["modes"][mode]["k3_kl"]
      assert row["modes"][mode]["code_disagree_frac"] == cell["modes"][mode]["code_disagree_frac"]
  table = (out / "table.md").read_text().splitlines()
  assert len(table) == 2 + len(skews)
  assert [line.split("|")[1].strip() for line in table[2:]] == ["0", "0.03125"]
  assert (out / "k3_vs_skew.png").stat().st_size > 0

  mtimes = {s: os.stat(out / f"skew_{s!r}.json").st_mtime_ns for s in skews}
  again = _run(out, "--skews=0,0.03125", "--bf16_reference_k3=1e-5", "--fp4_reference_k3=1e-1")
  assert again.returncode == 0, again.stderr[-3000:]
  text = again.stdout + again.stderr
  assert text.count("skipped") == len(skews)
  assert {s: os.stat(out / f"skew_{s!r}.json").st_mtime_ns for s in skews} == mtimes
  rows = json.loads((out / "results.json").read_text())["rows"]
  for mode, ref in (("bf16", 1e-5), ("none", 1e-1)):
    best = min(
      rows, key=lambda r: abs(math.log(max(r["modes"][mode]["k3_kl"], 1e-30)) - math.log(ref))
    )
    assert f"mode {mode} is nearest at skew {best['rollout_skew']:g} " in again.stdout


@pytest.mark.parametrize(
  "skews, message",
  [("0,-0.01", "rollout_skew"), ("0,0", "repeats a skew"), ("0,x", "must be numbers")],
)
def test_calibration_refuses_bad_skews_before_any_work(tmp_path, skews, message):
  said = refusal("skew_calibration", *SMALL, f"--out={tmp_path / 'cal'}", f"--skews={skews}")
  assert message in said, said
  assert not (tmp_path / "cal").exists()
