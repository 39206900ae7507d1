"""The mismatch study script end to end (slow: `pytest -m slow`)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.timeout(2100)  # its run's own limit: 30 min
def test_mismatch_script_writes_its_contract(tmp_path):
  out = tmp_path / "m.json"
  cmd = [
    sys.executable,
    os.path.join(ROOT, "experiments", "mismatch.py"),
    "--preset=tiny",
    "--sft_steps=20",
    "--rollouts=8",
    "--new_tokens=12",
    f"--json_out={out}",
  ]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  assert result.returncode == 0, result.stderr[-3000:]
  data = json.loads(out.read_text())
  for mode in ("bf16", "none", "none+replay", "compact", "full"):
    for key in (
      "k3_kl",
      "kl",
      "logp_abs_diff",
      "prob_diff_max",
      "code_disagree_frac",
      "one_step_frac",
    ):
      assert key in data["modes"][mode]
  assert 0 < data["modes"]["none"]["one_step_frac"] <= 1
  qwen = data["qwen3_30b_a3b_bytes_per_token"]
  assert qwen["experts+kv"]["compact"] < qwen["all"]["compact"] < qwen["all"]["full"]
  assert data["bytes_per_token"]["full"] > data["bytes_per_token"]["compact"] > 0
  assert len(data["sweep"]) == 2 * 3
  assert data["modes"]["full"]["k3_kl"] < data["modes"]["none"]["k3_kl"]
  assert (tmp_path / "m.png").exists()
