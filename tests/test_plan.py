"""The memory planner against hand-derived bytes of a published geometry.

(That its figures equal the bytes really placed on devices is checked in
tests/model/test_sharding.py, on 8 fake devices.)"""

import os
import subprocess
import sys

import pytest

from trace_jax.model.config import get_preset
from trace_jax import plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def qwen3_rows():
  config = plan.PlanConfig(mesh=(8, 8, 1), batch=64, context=2048, micro_batch=8)
  return plan.plan(get_preset("qwen3_30b_a3b"), config)


def test_qwen3_30b_rows_match_hand_derivation(qwen3_rows):
  rows = qwen3_rows
  layers, kv_heads, head_dim, d, vocab = 48, 4, 128, 2048, 151936
  experts, ffn = 128, 768
  # KV cache: 8 sequences per data shard, K and V, bf16; FP4: 0.5 B per element, one E4M3
  # scale byte per 16, one f32 global scale per (token, head).
  tokens = 64 // 8 * 2048
  bf16 = 2 * layers * tokens * kv_heads * head_dim * 2
  fp4 = 2 * layers * tokens * kv_heads * (head_dim // 2 + head_dim // 16 + 4)
  assert rows["KV cache (bf16)"] == bf16
  assert rows["KV cache (FP4)"] == fp4
  assert rows["recurrent state"] == 0
  # Master weights: routed experts over expert x data (64), everything FSDP over data (8),
  # norms replicated.
  expert_params = layers * 3 * experts * d * ffn
  attn_params = layers * d * (32 * 128 + 2 * kv_heads * 128) + layers * 32 * 128 * d
  other = 2 * vocab * d + layers * d * experts  # embed, lm_head, routers
  norms = layers * (2 * d + 2 * head_dim) + d
  master = 4 * (expert_params / 64 + (attn_params + other) / 8 + norms)
  assert rows["master weights (f32)"] == pytest.approx(master, rel=1e-9)
  assert rows["optimizer state (Adam)"] == pytest.approx(2 * master, rel=1e-6)
  # Guidance (compact, layers 24..47, every site): per token and site a float32 global
  # scale per row (per KV head for k/v, per chosen expert for moe_mid), one E4M3 byte per
  # 16 elements and one mantissa bit per element; routing int16 (128 experts), all layers.
  compact = lambda rows, width: rows * (4 + width // 16 + width // 8)
  per_layer = (
    compact(1, d)
    + compact(1, 32 * head_dim)
    + 2 * compact(kv_heads, head_dim)
    + compact(1, d)
    + compact(8, ffn)
  )
  per_token = 24 * per_layer + layers * 8 * 2
  assert rows["guidance"] == per_token * tokens  # model=1: split over data only
  # Remat keeps one d_model bf16 vector per token and layer instead of every residual.
  assert rows["activations (remat)"] < rows["activations (no remat)"] / 4
  assert rows["activations (remat)"] >= layers * 8 // 8 * 2048 * d * 2


@pytest.mark.slow
def test_plan_script_prints_the_table():
  """The CLI at full Qwen3.5 size (`pytest -m slow tests/rl/test_plan.py`)."""
  cmd = [
    sys.executable,
    os.path.join(ROOT, "experiments", "plan.py"),
    "--preset=qwen3_5_35b_a3b",
    "--mesh=8,8,1",
    "--batch=64",
    "--context=1024",
  ]
  result = subprocess.run(
    cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONPATH=ROOT)
  )
  assert result.returncode == 0, result.stderr[-3000:]
  for row in (
    "master weights (f32)",
    "optimizer state (Adam)",
    "FP4 rollout weights",
    "KV cache (bf16)",
    "KV cache (FP4)",
    "recurrent state",
    "guidance",
    "activations (no remat)",
    "activations (remat)",
    "H200 (141 GB)",
  ):
    assert row in result.stdout, row


def test_bad_plan_configs():
  with pytest.raises(ValueError, match="batch=6 must divide over data=4"):
    plan.PlanConfig(mesh=(4, 1, 1), batch=6)
  with pytest.raises(ValueError, match="mesh"):
    plan.PlanConfig(mesh=(8, 8))
