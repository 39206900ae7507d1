"""Every RL arm completes a step on the tiny hybrid Qwen3.5-MoE preset (Gated DeltaNet +
gated attention + shared expert): rollout, guidance capture, guided QAT, routing replay.

Only the `trace` arm runs by default (each arm compiles its own rollout and train step);
the others are marked slow: `pytest -m slow tests/rl/test_trainer_qwen3_5.py`.
"""

import numpy as np
import pytest

from trace_jax.rl.config import RLConfig
from trace_jax.run.trainer import Trainer

# Compiles whole RL / rollout programs: minutes on 2 cores; `pytest -m slow` runs it.
pytestmark = pytest.mark.slow

SLOW_ARMS = ["bf16", "fp4-rollout", "fp4-qat", "trace-full", "ptq"]


@pytest.mark.parametrize(
  "arm", ["trace"] + [pytest.param(a, marks=pytest.mark.slow) for a in SLOW_ARMS]
)
def test_one_step_per_arm_on_the_hybrid_preset(tmp_path, arm):
  config = RLConfig.from_flat(
    arm=arm,
    preset="qwen3_5_tiny",
    task="arith",
    steps=1,
    prompts_per_step=2,
    group_size=2,
    minibatches=1,
    max_new_tokens=4,
    sft_steps=1,
    sft_batch=4,
    eval_size=2,
    eval_every=1,
    checkpoint_every=1,
    prompt_bucket=32,
  )
  trainer = Trainer(config, str(tmp_path), progress=False)
  assert trainer.policy.cfg.linear_layers == (0, 1, 2)
  history = trainer.run()
  assert [m["step"] for m in history] == [1]
  metrics = history[0]
  for key in ("rewards/mean", "pg_clipfrac", "entropy", "completions/mean_length"):
    assert key in metrics and np.isfinite(metrics[key]), key
  if arm.startswith("trace"):  # guided arms: guidance captured and followed
    for key in (
      "mismatch/k3_kl",
      "mismatch/logp_abs_diff",
      "is_ratio/mean",
      "guidance/bytes_per_token",
      "guidance/followed_frac",
    ):
      assert key in metrics and np.isfinite(metrics[key]), key
    assert metrics["guidance/bytes_per_token"] > 0
