"""experiments/compare_arms.py end to end on a tiny grid, and its resumption (slow:
`pytest -m slow tests/rl/test_compare_arms_script.py`)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.timeout(3900)  # two runs of up to 30 min each
def test_compare_arms_runs_then_resumes(tmp_path):
  cmd = [
    sys.executable,
    os.path.join(ROOT, "experiments", "compare_arms.py"),
    "--name=t",
    "--seeds=0",
    "--tasks=arith",
    "--arms=bf16,ptq,ptq-46",
    "--preset=tiny",
    "--steps=1",
    "--sft_steps=2",
    "--sft_target=0.9",
    "--eval_size=4",
    "--eval_every=1",
    "--prompts_per_step=1",
    "--group_size=2",
    "--task_options=terms=3",
    "--max_new_tokens=12",
    "--kv_precision=bf16",
    f"--workdir={tmp_path / 'runs'}",
    f"--results={tmp_path / 'res'}",
  ]
  first = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  assert first.returncode == 0, first.stderr[-3000:]
  results = json.loads((tmp_path / "res" / "t" / "results.json").read_text())
  assert [(c["arm"], c["task"], c["seed"]) for c in results["cells"]] == [
    ("bf16", "arith", 0),
    ("ptq", "arith", 0),
    ("ptq-46", "arith", 0),
  ]
  config = results["cells"][0]["summary"]["config"]  # the setting flags reached the run
  assert config["task_options"] == [["terms", 3]] and config["fp4"]["kv"] == "bf16"
  assert config["sampling"]["max_new_tokens"] == 12 and config["source"]["sft_target"] == 0.9
  ptq46 = results["cells"][2]["summary"]
  assert 0.0 <= ptq46["final_eval_reward"] <= 1.0 and ptq46["eval_precision"] == "fp4"
  for name in ("table.md", "reward_curves.png", "final_reward.png", "k3.png"):
    assert (tmp_path / "res" / "t" / name).exists()
  second = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  assert second.returncode == 0, second.stderr[-3000:]
  assert second.stdout.count("finished before, kept") == 3
