"""experiments/scale_check.py at a tiny size, 2 processes x 2 CPU devices: the synthetic
checkpoint has the parameters its flags imply, every process holds what the sharding rules
put on its devices (and no device holds a shard the whole-tensor load disagrees with), and
the timings and resident-set figures are there (their values are the script's to print,
not the test's to judge)."""

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "experiments", "scale_check.py")
SIZES = dict(d_model=64, num_experts=4, moe_ffn_dim=32, num_heads=4, num_kv_heads=2, head_dim=16)
VOCAB, LAYERS = 512, 2


def _param_count(d_model, num_experts, moe_ffn_dim, num_heads, num_kv_heads, head_dim) -> int:
  """Qwen3-MoE's parameters, counted from its architecture (untied embeddings)."""
  attention = 2 * d_model * num_heads * head_dim + 2 * d_model * num_kv_heads * head_dim
  layer = 2 * d_model + attention + 2 * head_dim + d_model * num_experts
  layer += 3 * num_experts * d_model * moe_ffn_dim
  return 2 * VOCAB * d_model + d_model + LAYERS * layer


def test_two_processes_hold_what_the_rules_put_on_their_devices(tmp_path):
  out = tmp_path / "scale.json"
  flags = [f"--{k}={v}" for k, v in SIZES.items()]
  done = subprocess.run(
    [sys.executable, SCRIPT, *flags, f"--vocab_size={VOCAB}", f"--num_layers={LAYERS}"]
    + ["--processes=2", "--devices_per_process=2", "--mesh=2,2,1", "--verify"]
    + [f"--json_out={out}", "--shard_gb=0.0002"],  # several shard files
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads(out.read_text())
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
  assert len(devices) == 4  # each process its own devices
  assert "| process | devices | rss rise MiB |" in done.stdout
