"""experiments/scale_check.py at a tiny size, 2 processes x 2 CPU devices: the synthetic
checkpoint has the parameters its flags imply, every process holds what the sharding rules
put on its devices (and no device holds a shard the whole-tensor load disagrees with), the
timings and resident-set figures are there (their values are the script's to print, not the
test's to judge); in float32 with the experts split across the processes, the sharded
model's logits are the unsharded load's and two RL steps run on the mesh from the loaded
policy."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "experiments", "scale_check.py")
SIZES = dict(d_model=64, num_experts=4, moe_ffn_dim=32, num_heads=4, num_kv_heads=2, head_dim=16)
VOCAB, LAYERS = 512, 2
# Lowest backend optimisation: the RL steps are mostly compile time (what runs, not how fast).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _param_count(d_model, num_experts, moe_ffn_dim, num_heads, num_kv_heads, head_dim) -> int:
  """Qwen3-MoE's parameters, counted from its architecture (untied embeddings)."""
  attention = 2 * d_model * num_heads * head_dim + 2 * d_model * num_kv_heads * head_dim
  layer = 2 * d_model + attention + 2 * head_dim + d_model * num_experts
  layer += 3 * num_experts * d_model * moe_ffn_dim
  return 2 * VOCAB * d_model + d_model + LAYERS * layer


def _scale_check(tmp_path, *flags: str) -> tuple[list[dict], str]:
  """The script's per-process rows and its stdout, at the tiny sizes on 2 x 2 devices."""
  out = tmp_path / "scale.json"
  sizes = [f"--{k}={v}" for k, v in SIZES.items()]
  done = subprocess.run(
    [sys.executable, SCRIPT, *sizes, f"--vocab_size={VOCAB}", f"--num_layers={LAYERS}"]
    + ["--processes=2", "--devices_per_process=2", *flags, f"--json_out={out}"],
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=FAST_COMPILE),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(out.read_text()), done.stdout


def test_two_processes_hold_what_the_rules_put_on_their_devices(tmp_path):
  rows, stdout = _scale_check(
    tmp_path,
    "--mesh=2,2,1",
    "--verify",
    "--shard_gb=0.0002",  # several shard files
  )
  assert [r["process"] for r in rows] == [0, 1]
  params = _param_count(**SIZES)
  devices = set()
  for r in rows:
    assert r["model_bytes"] == 2 * params  # bf16
    assert 0 < r["checkpoint_bytes"] - r["model_bytes"] < 64 * 1024  # plus the headers
    assert r["read_bytes"] == r["checkpoint_bytes"]
    assert r["devices"] == len(r["device_bytes"]) == 2
    assert r["held_bytes"] == sum(r["device_bytes"].values())
    assert set(r["device_bytes"].values()) == {r["expected_device_bytes"]}
    # Split over data x expert (4 ways) except the replicated norms: under half the model.
    assert r["model_bytes"] / 4 <= r["expected_device_bytes"] < r["model_bytes"] / 2
    assert r["verified_shards_mismatched"] == 0
    assert r["peak_reset"] and 0 < r["rss_rise_bytes"] < 512 * 2**20
    assert r["load_gb_s"] > 0 and r["read_gb_s"] > 0
    assert r["held_gb_s"] is None or r["held_gb_s"] > 0
    # Timings are reported, never compared: on a loaded machine either may be the larger.
    assert r["abstract_seconds"] > 0 and r["load_seconds"] > 0
    devices |= set(r["device_bytes"])
    # "data" spans the processes, "expert" each one's two devices: each holds every expert.
    assert r["experts_held"] == list(range(SIZES["num_experts"]))
    assert "rl" not in r  # --rl_steps=0
  assert len(devices) == 4  # each process its own devices
  assert "| process | devices | rss rise MiB |" in stdout
  assert "expert weights span processes: no" in stdout


@pytest.mark.slow
def test_float32_logits_and_rl_steps_with_the_experts_split_across_processes(tmp_path):
  rows, stdout = _scale_check(
    tmp_path, "--mesh=1,4,1", "--dtype=float32", "--rl_steps=2", "--arm=trace"
  )
  assert [r["process"] for r in rows] == [0, 1]
  params = _param_count(**SIZES)
  for r in rows:
    assert r["dtype"] == "float32" and r["model_bytes"] == 4 * params
    assert 0 < r["checkpoint_bytes"] - 2 * params < 64 * 1024  # bf16 on disk
    assert set(r["device_bytes"].values()) == {r["expected_device_bytes"]}
    assert r["rss_bound_bytes"] == 2 * r["held_bytes"] + 0.4e9
    # The sharded forward on the fixed batch, gathered: the one-device unsharded load's.
    assert r["logits_rel_l2"] <= 1e-4
    rl = r["rl"]
    assert rl["arm"] == "trace" and rl["start_equals_load"]  # the Trainer starts from the load
    assert [m["step"] for m in rl["steps"]] == [1, 2]
    for m in rl["steps"]:
      assert all(math.isfinite(m[k]) for k in ("loss", "mismatch/k3_kl", "mismatch/logp_abs_diff"))
      assert 0 <= m["rewards/mean"] <= 1
      assert m["rollout_seconds"] > 0 and m["train_seconds"] > 0
  # The expert axis spans the processes: each holds its own half of every layer's experts.
  assert [r["experts_held"] for r in rows] == [[0, 1], [2, 3]]
  assert "expert weights span processes: yes" in stdout
  # One global job: every process reports the same step metrics.
  values = [
    [{k: v for k, v in m.items() if "seconds" not in k} for m in r["rl"]["steps"]] for r in rows
  ]
  assert values[0] == values[1]
  assert "2 RL steps of arm trace on mesh 1,4,1 across 2 process(es)" in stdout
