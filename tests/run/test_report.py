"""What a run leaves and prints (`run.report`): the summary a study reads, the final line and
table, the warm start's line."""

import json

import numpy as np

from trace_jax.rl.config import RLConfig
from trace_jax.run import report


def test_a_finished_run_is_read_only_for_its_own_config(tmp_path):
  """A run directory's summary.json is the run's result only if it finished the config's steps
  with no field differing: no file, another seed or arm, or more steps each give None; a field
  a resume may change (remat) does not count."""
  rng = np.random.default_rng()
  seed = int(rng.integers(1 << 20))
  config = RLConfig.from_flat(seed=seed, steps=int(rng.integers(2, 50)))
  assert report.finished_summary(str(tmp_path), config) is None  # no summary.json
  wall = float(rng.uniform(1, 1000))
  summary = {"steps": config.schedule.steps, "wall_seconds": wall, "config": config.to_dict()}
  (tmp_path / "summary.json").write_text(json.dumps(summary))
  assert report.finished_summary(str(tmp_path), config)["wall_seconds"] == wall
  assert report.finished_summary(str(tmp_path), config.replace(remat=True)) is not None
  assert report.finished_summary(str(tmp_path), config.replace(seed=seed + 1)) is None
  assert report.finished_summary(str(tmp_path), config.replace(arm="bf16")) is None
  longer = config.replace(steps=config.schedule.steps + 1)  # the run stopped short of it
  assert report.finished_summary(str(tmp_path), longer) is None


def test_the_final_line_rounds_the_eval_rewards():
  summary = {
    "eval_precision": "fp4",
    "initial_eval_reward": 0.40123456716537476,
    "final_eval_reward": 0.7870370149612427,
    "mean_k3_kl": 3.85512e-06,
    "guidance_bytes_per_token": 111.6,
    "rollout_seconds": 9.4,
    "train_seconds": 18.2,
    "wall_seconds": 52.7,
  }
  assert report.final_line(summary) == (
    "greedy fp4 eval reward 0.401 -> 0.787, mean k3_kl 3.855e-06, guidance 112 B/token, "
    "rollout 9 s, train 18 s, wall 53 s"
  )


def test_the_final_table_gives_a_standard_error_only_where_there_is_one():
  """One evaluation problem has no standard error (NaN): the reward alone, not "± nan"."""
  metrics = [
    {"step": 0, "eval/reward_fp4": 0.0, "eval/reward_fp4_se": float("nan")},
    {"step": 1, "eval/reward_fp4": 0.5, "eval/reward_fp4_se": 0.125, "eval/reward_bf16": 1.0},
  ]
  rows = report.final_table(metrics).splitlines()[2:]
  assert rows[0].startswith("| 0 | 0.000 | - |") and "nan" not in rows[0]
  assert rows[1].startswith("| 1 | 0.500 ± 0.125 | 1.000 |")


def test_the_warm_start_is_one_line():
  made = {
    "task": "chain",
    "settings": {"task": "chain", "seed": 0, "sft_steps": 20, "sft_learning_rate": 0.003},
    "steps": 20,
    "checks": [],
    "first_nll": 4.824258327484131,
    "final_nll": 2.8421373844146727,
    "loaded": False,
  }
  assert report.warmstart_line(made) == "warm start: made, 20 SFT steps, NLL 4.824 -> 2.842"
  loaded = {**made, "loaded": True, "steps": 150, "checks": [[140, 0.5], [150, 0.796875]]}
  assert report.warmstart_line(loaded) == (
    "warm start: loaded, 150 SFT steps, NLL 4.824 -> 2.842, greedy FP4 reward 0.797 on "
    "training problems at step 150"
  )
  rebuilt = {**made, "rebuilt": "it holds NaN or Inf in ['w']"}
  assert report.warmstart_line(rebuilt).startswith(
    "warm start: rebuilt (it holds NaN or Inf in ['w']), 20 SFT steps"
  )
  skipped = {"task": "chain", "steps": 0, "first_nll": None, "loaded": False, "skipped": "why"}
  assert report.warmstart_line(skipped) == "warm start: none (why)"
