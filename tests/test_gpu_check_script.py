"""experiments/gpu_check.py's --out and its full-depth rollout section, on smoke shapes."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "experiments", "gpu_check.py")


def test_smoke_rollout_writes_both_arms_and_the_report(tmp_path):
  out = tmp_path / "gpu"
  args = ["--smoke", "--sections=rollout", f"--out={out}", "--rollout_prompts=3"]
  args += ["--rollout_prompt_len=5", "--rollout_new_tokens=6"]
  result = subprocess.run(
    [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  results = json.loads((out / "results.json").read_text())
  assert results["sections"]["rollout"]["status"] == "ok"
  arms = {a["arm"]: a for a in results["measured"]["rollout"]["arms"]}
  assert set(arms) == {"trace", "bf16"}
  for arm in arms.values():
    # no stop token: every prompt generates every new token
    assert arm["generated_tokens"] == 3 * 6 and arm["tokens_per_second"] > 0
    assert arm["program_argument_bytes"] >= arm["weights_bytes"] > 0
  # FP4 weights: packed codes and scales, smaller than the bf16 arm's
  assert arms["trace"]["weights_bytes"] < arms["bf16"]["weights_bytes"]
  report = (out / "report.md").read_text()
  assert "## rollout" in report and "FP4 (trace arm)" in report and "## targets" in report


def test_bad_rollout_arms_are_refused_before_any_work(tmp_path):
  result = subprocess.run(
    [sys.executable, SCRIPT, "--smoke", "--rollout_arms=fp8", f"--out={tmp_path / 'o'}"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode != 0 and "--rollout_arms=['fp8'] is not allowed" in result.stderr
  assert not (tmp_path / "o").exists()
