"""experiments/kv_ablation.py on two synthetic comparisons: the paired table it writes, and
what it refuses (settings that differ beyond the ablated one, warm starts that differ)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.scripts import refusal
from trace_jax.rl.config import RLConfig
from trace_jax.studies import compare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "kv_ablation.py")
WARM = {"settings": {"seed": 0, "sft_steps": 400}, "steps": 240}


def _write(path, rng, arms, overrides, warm=WARM, loaded=False):
  config = RLConfig.from_flat(**overrides).to_dict()
  cells = [
    compare.Cell(
      arm=arm,
      task="chain",
      seed=seed,
      summary={
        "initial_eval_reward": float(rng.uniform(0.4, 0.7)),
        "final_eval_reward": float(rng.uniform(0.5, 0.9)),
        "mean_train_reward": float(rng.uniform()),
        "eval_precision": "fp4",
        "mean_k3_kl": float(10 ** rng.uniform(-6, -2)),
        "wall_seconds": 100.0,
        "curve_eval": [[0, 20], rng.uniform(size=2).tolist()],
        "curve_train": [[1, 2, 3], rng.uniform(size=3).tolist()],
        "warmstart": {**warm, "loaded": loaded},
        "config": config,
      },
    )
    for seed in (0, 1, 2)
    for arm in arms
  ]
  compare.write_results(str(path), cells, {"overrides": overrides}, "t")
  return {(c.arm, c.seed): c.summary for c in cells}


def _run(base, variant, *extra):
  cmd = [sys.executable, SCRIPT, f"--base={base}", f"--variant={variant}", *extra]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_kv_ablation_writes_the_paired_table_and_refuses_other_changes(tmp_path):
  rng = np.random.default_rng(47)
  setting = {"fp4_sites": "experts+kv", "steps": 60}
  base = _write(tmp_path / "long", rng, ("bf16", "trace"), setting)
  variant = _write(
    tmp_path / "kv", rng, ("trace",), {**setting, "kv_precision": "bf16"}, loaded=True
  )
  done = _run(tmp_path / "long", tmp_path / "kv")
  assert done.returncode == 0, done.stderr[-3000:]
  table = (tmp_path / "kv" / "ablation" / "table.md").read_text()
  diffs = [
    variant[("trace", s)]["final_eval_reward"] - base[("trace", s)]["final_eval_reward"]
    for s in range(3)
  ]
  # the base left kv_precision at its default: the title shows what it resolved to (FP4 under
  # experts+kv), not the missing flag
  assert f"{np.mean(diffs):+.3f} [" in table and "(kv_precision: fp4 -> bf16)" in table
  s1 = base[("trace", 1)]
  assert f"seed 1: trace {s1['initial_eval_reward']:.3f} -> {s1['final_eval_reward']:.3f}" in table
  for name in ("reward_curves.png", "final_reward.png", "k3.png"):
    assert (tmp_path / "kv" / "ablation" / name).stat().st_size > 0
  _write(tmp_path / "other", rng, ("trace",), {**setting, "kv_precision": "bf16", "steps": 30})
  said = refusal("kv_ablation", f"--base={tmp_path / 'long'}", f"--variant={tmp_path / 'other'}")
  assert "also differ in {'steps': (60, 30)}" in said, said
  _write(
    tmp_path / "cold",
    rng,
    ("trace",),
    {**setting, "kv_precision": "bf16"},
    warm={**WARM, "steps": 400},
  )
  said = refusal("kv_ablation", f"--base={tmp_path / 'long'}", f"--variant={tmp_path / 'cold'}")
  assert "warm starts differ" in said, said
