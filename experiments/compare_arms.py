"""Every arm on the same seed, warm start and budget, side by side.

  python experiments/compare_arms.py --out=runs/arms            # ~25 min on 2 cores
  python experiments/compare_arms.py --out=/tmp/arms --steps=10 --sft_steps=20   # quick
  python experiments/compare_arms.py --out=runs/arms-ekv --fp4_sites=experts+kv --fmt=mxfp4

Runs bf16, fp4-rollout, fp4-qat, trace and trace-full through experiments/rl.py's trainer,
each in <out>/<arm>, all starting from one SFT warm start (made once, copied). The ptq row
is the bf16 run's policy quantized to FP4 and evaluated in FP4 (its FP4 evaluations). Writes
<out>/comparison.json, <out>/comparison.png and prints a markdown table.
"""

import os
import shutil
import time

from absl import app, flags, logging
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from trace_jax.rl import report  # noqa: E402
from trace_jax.rl.config import RLConfig  # noqa: E402
from trace_jax.rl.trainer import Trainer, read_metrics  # noqa: E402
from trace_jax.rl.warmstart import WARMSTART_DIR  # noqa: E402
from trace_jax.utils import markdown_table, write_json  # noqa: E402

_OUT = flags.DEFINE_string("out", "runs/arms", "Directory for the runs.")
_STEPS = flags.DEFINE_integer("steps", None, "RL steps (default: RLConfig's).")
_SFT = flags.DEFINE_integer("sft_steps", None, "Warm-start steps (default: RLConfig's).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed shared by all arms.")
_TASK = flags.DEFINE_string("task", "arith", "Task.")
_PRESET = flags.DEFINE_string("preset", None, "Model preset (default: RLConfig's).")
_FP4_SITES = flags.DEFINE_string("fp4_sites", None, "FP4 scope: all or experts+kv (default: RLConfig's).")
_FMT = flags.DEFINE_string("fmt", None, "FP4 format: nvfp4 or mxfp4 (default: RLConfig's).")

TRAINED = ("bf16", "fp4-rollout", "fp4-qat", "trace", "trace-full")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax and JAX log every save at INFO
  overrides = {k: v for k, v in (("steps", _STEPS.value), ("sft_steps", _SFT.value),
                                 ("preset", _PRESET.value), ("fp4_sites", _FP4_SITES.value),
                                 ("fmt", _FMT.value)) if v is not None}
  out = os.path.abspath(_OUT.value)
  summaries = {}
  for arm in TRAINED:
    config = RLConfig(arm=arm, seed=_SEED.value, task=_TASK.value, **overrides)
    workdir = os.path.join(out, arm)
    first = os.path.join(out, TRAINED[0], WARMSTART_DIR)
    if arm != TRAINED[0] and os.path.exists(first) and not os.path.exists(
        os.path.join(workdir, WARMSTART_DIR)):
      shutil.copytree(first, os.path.join(workdir, WARMSTART_DIR))  # the same starting policy
    start = time.time()
    trainer = Trainer(config, workdir)
    trainer.run()
    metrics = read_metrics(workdir)
    summaries[arm] = report.summarize(config, metrics, time.time() - start, trainer.warmstart)
    summaries[arm]["curve_fp4"] = report.eval_curve(metrics, "fp4")
    report.write_summary(workdir, summaries[arm])
  ptq = dict(summaries["bf16"], arm="ptq", eval_precision="fp4",
             initial_eval_reward=summaries["bf16"]["initial_eval_reward_fp4"],
             final_eval_reward=summaries["bf16"]["final_eval_reward_fp4"])
  summaries["ptq"] = ptq

  rows = []
  for arm, s in summaries.items():
    rows.append((arm, s["eval_precision"], f"{s['initial_eval_reward']:.3f}",
                 f"{s['final_eval_reward']:.3f}", f"{s['final_eval_reward_fp4']:.3f}",
                 f"{s['final_eval_reward_bf16']:.3f}", f"{s['mean_train_reward']:.3f}",
                 f"{s['mean_k3_kl']:.2e}", f"{s['mean_logp_abs_diff']:.2e}",
                 f"{s['guidance_bytes_per_token']:.0f}", f"{s['rollout_seconds']:.0f}",
                 f"{s['train_seconds']:.0f}"))
  table = markdown_table(["arm", "eval in", "initial eval", "final eval", "final fp4", "final bf16",
                          "mean train reward", "mean k3_kl", "mean |dlogp|", "guidance B/token",
                          "rollout s", "train s"], rows)
  fig, ax = plt.subplots(figsize=(7, 4))
  for arm in TRAINED:
    steps, rewards = summaries[arm]["curve_fp4"]
    ax.plot(steps, rewards, marker="o", label=arm)
  ax.set(xlabel="step", ylabel="greedy FP4 eval reward", title=f"arms on {_TASK.value}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "comparison.png"), dpi=110)
  write_json(os.path.join(out, "comparison.json"), summaries)
  print()
  print(table)


if __name__ == "__main__":
  app.run(main)
