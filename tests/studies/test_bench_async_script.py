"""experiments/bench_async.py end to end at its smallest settings: every (split, k) row in
its JSON, with the groups' devices disjoint and the metrics each loop has."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "bench_async.py")


@pytest.mark.slow  # four child processes, each compiling the tiny preset's step: ~2.5 min
def test_bench_async_smoke_writes_every_row(tmp_path):
  out = tmp_path / "bench.json"
  done = subprocess.run(
    [sys.executable, SCRIPT, "--smoke", "--steps=5", "--splits=0,2", "--staleness=0,1"]
    + [f"--json_out={out}"],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [(r["split"], r["k"]) for r in rows] == [(0, 0), (0, 1), (2, 0), (2, 1)]
  for r in rows:
    assert r["steps_per_second"] > 0 and r["learner_wait_seconds"] >= 0
    assert (r["rollout_wait_seconds"] is None) == (r["k"] == 0)  # a thread only with k > 0
    assert (r["publish_seconds"] is None) == (r["split"] == 0)  # published only to a group
    if r["split"]:  # 8 fake devices, batch 8: 2 rollout replicas, learner data axis 4
      rollout = set(r["rollout_devices"].split(","))
      learner = set(r["learner_devices"].split(","))
      assert len(rollout) == 2 and len(learner) == r["learner_data"] == 4
      assert not rollout & learner
  assert rows[0]["vs_sync_shared"] == 1.0
  assert "| shared | sync |" in done.stdout
