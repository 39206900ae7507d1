"""What an RL run leaves behind: summary.json, PNG plots, a final table."""

from __future__ import annotations

import json
import os

import matplotlib.pyplot as plt
import numpy as np  # noqa: E402

from trace_jax.rl.config import RLConfig  # noqa: E402
from trace_jax.utils import markdown_table, write_json  # noqa: E402


def eval_curve(metrics: list[dict], precision: str):
  rows = [
    (m["step"], m[f"eval/reward_{precision}"]) for m in metrics if f"eval/reward_{precision}" in m
  ]
  return [r[0] for r in rows], [r[1] for r in rows]


def final_line(summary: dict) -> str:
  """The summary's headline figures; a figure the run never logged (no RL step, no
  evaluation) reads "n/a"."""

  def show(key, spec=""):
    value = summary.get(key)
    return "n/a" if value is None else format(value, spec)

  return (
    f"greedy {summary['eval_precision']} eval reward {show('initial_eval_reward', '.3f')} -> "
    f"{show('final_eval_reward', '.3f')}, mean k3_kl {show('mean_k3_kl', '.3e')}, guidance "
    f"{show('guidance_bytes_per_token', '.0f')} B/token, rollout "
    f"{show('rollout_seconds', '.0f')} s, train {show('train_seconds', '.0f')} s, "
    f"wall {show('wall_seconds', '.0f')} s"
  )


def summarize(
  config: RLConfig, metrics: list[dict], wall_seconds: float, warmstart: dict | None = None
) -> dict:
  """The summary.json contract: arm, task, steps, initial/final eval reward (in the arm's
  deployment precision: bf16 for the bf16 arm, FP4 otherwise), mean k3 KL, guidance bytes
  per token, rollout and train seconds, the rollout kernels that ran; plus both
  precisions' evals."""
  train = [m for m in metrics if "rewards/mean" in m]
  deploy = config.arm_spec.deploy
  summary = {
    "arm": config.arm,
    "task": config.task,
    "preset": config.source.preset,
    "seed": config.seed,
    "steps": max([m["step"] for m in train], default=0),
  }
  for precision in ("fp4", "bf16"):
    steps, rewards = eval_curve(metrics, precision)
    summary[f"initial_eval_reward_{precision}"] = rewards[0] if rewards else None
    summary[f"final_eval_reward_{precision}"] = rewards[-1] if rewards else None
    ses = [m[f"eval/reward_{precision}_se"] for m in metrics if f"eval/reward_{precision}_se" in m]
    summary[f"final_eval_reward_{precision}_se"] = ses[-1] if ses else None
  summary["eval_precision"] = deploy
  summary["initial_eval_reward"] = summary[f"initial_eval_reward_{deploy}"]
  summary["final_eval_reward"] = summary[f"final_eval_reward_{deploy}"]
  summary["eval_problems"] = next(
    (m["eval/problems"] for m in reversed(metrics) if "eval/problems" in m), None
  )
  logged = lambda key: [m[key] for m in train if key in m]
  mean = lambda key: float(np.mean(logged(key))) if logged(key) else None  # None: never logged
  summary.update(
    {
      "mean_k3_kl": mean("mismatch/k3_kl"),
      "mean_logp_abs_diff": mean("mismatch/logp_abs_diff"),
      "mean_train_reward": mean("rewards/mean"),
      "guidance_bytes_per_token": mean("guidance/bytes_per_token"),
      "rollout_seconds": float(sum(m["rollout_seconds"] for m in train)),
      "train_seconds": float(sum(m["train_seconds"] for m in train)),
      "wall_seconds": wall_seconds,
      "warmstart": warmstart,
      # Which rollout implementation ran ("pallas" / "xla") and why "auto" fell back.
      "kernels": train[-1].get("kernels/rollout") if train else None,
      "kernels_fallback_reason": train[-1].get("kernels/fallback_reason") if train else None,
      "config": config.to_dict(),
    }
  )
  if config.schedule.max_staleness:  # asynchronous RL: the gaps and what they cost
    gap_key = "async/version_gap"  # one gap per batch
    guided = [m for m in train if "guidance/followed_frac" in m and gap_key in m]
    summary.update(
      {
        "mean_version_gap": mean("async/version_gap_mean"),
        "max_version_gap": max(logged("async/version_gap_max"), default=None),
        "mean_precision_k3": mean("mismatch/precision_k3"),
        "mean_version_k3": mean("mismatch/version_k3"),
        "mean_masked_frac": mean("decoupled/masked_frac"),
        "mean_followed_frac": mean("guidance/followed_frac"),
        # {gap: the mean followed share of the steps whose batch had that gap}
        "followed_frac_by_gap": {
          str(gap): float(
            np.mean([m["guidance/followed_frac"] for m in guided if m[gap_key] == gap])
          )
          for gap in sorted({m[gap_key] for m in guided})
        },
      }
    )
  return summary


def _advantage_mixed(m: dict) -> float:
  """The share of groups whose advantages came from mixed rewards (a placebo's permuted
  rewards where it ran; runs before that metric logged the true rewards' share)."""
  return m.get("reward/advantage_mixed_group_frac", m.get("reward/mixed_group_frac", np.nan))


def plot(metrics: list[dict], workdir: str, title: str) -> list[str]:
  """reward.png (train reward, share of mixed-reward groups, greedy evals) and mismatch.png
  (k3 KL, |dlogp|) over steps."""
  train = [m for m in metrics if "rewards/mean" in m]
  paths = []
  fig, ax = plt.subplots(figsize=(7, 4))
  if train:
    steps = [m["step"] for m in train]
    rewards = np.asarray([m["rewards/mean"] for m in train])
    ax.plot(steps, rewards, alpha=0.3, label="train reward (sampled)")
    window = min(10, len(rewards))
    smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1 :], smooth, label=f"train reward, mean of {window}")
    # groups that carry an advantage (not all-equal rewards): a placebo's, not the true ones
    mixed = np.asarray([_advantage_mixed(m) for m in train])
    if np.isfinite(mixed).any():
      ax.plot(
        steps[window - 1 :],
        np.convolve(mixed, np.ones(window) / window, mode="valid"),
        ls="--",
        color="grey",
        label=f"groups with mixed rewards, mean of {window}",
      )
  for precision, marker in (("fp4", "o"), ("bf16", "s")):
    steps, rewards = eval_curve(metrics, precision)
    if steps:
      ax.plot(steps, rewards, marker=marker, label=f"greedy eval, {precision}")
  ax.set(xlabel="step", ylabel="reward", title=title, ylim=(-0.02, 1.02))
  ax.legend()
  paths.append(os.path.join(workdir, "reward.png"))
  fig.tight_layout()
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 4))
  if train:
    steps = [m["step"] for m in train]
    ax.semilogy(steps, [max(m["mismatch/k3_kl"], 1e-12) for m in train], label="mismatch/k3_kl")
    ax.semilogy(
      steps,
      [max(m["mismatch/logp_abs_diff"], 1e-12) for m in train],
      label="mismatch/logp_abs_diff",
    )
  ax.set(xlabel="step", title=f"{title}: rollout vs training path")
  ax.legend()
  paths.append(os.path.join(workdir, "mismatch.png"))
  fig.tight_layout()
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths


def _with_se(m: dict, key: str) -> str:
  """The reward and its standard error; none where it is undefined (one problem: NaN)."""
  if key not in m:
    return "-"
  se = m.get(f"{key}_se")
  return f"{m[key]:.3f}" + ("" if se is None or not np.isfinite(se) else f" ± {se:.3f}")


def warmstart_line(warmstart: dict) -> str:
  """The warm-start record (`run.warmstart`) as one line: made, loaded, rebuilt or skipped,
  its SFT steps and NLLs, and where a level target stopped it."""
  if warmstart.get("skipped"):
    return f"warm start: none ({warmstart['skipped']})"
  how = "loaded" if warmstart.get("loaded") else "made"
  if warmstart.get("rebuilt"):
    how = f"rebuilt ({warmstart['rebuilt']})"
  line = f"warm start: {how}, {warmstart.get('steps', 0)} SFT steps"
  first, final = warmstart.get("first_nll"), warmstart.get("final_nll")
  if first is not None and final is not None:
    line += f", NLL {first:.3f} -> {final:.3f}"
  if warmstart.get("checks"):  # the level checks of a target: [steps done, greedy reward]
    done, reward = warmstart["checks"][-1]
    line += f", greedy FP4 reward {reward:.3f} on training problems at step {done}"
  return line


def final_table(metrics: list[dict]) -> str:
  rows = []
  for m in metrics:
    if "eval/reward_fp4" in m or "eval/reward_bf16" in m:
      fmt = lambda k, f="{:.3f}": f.format(m[k]) if k in m else "-"
      rows.append(
        (
          m["step"],
          _with_se(m, "eval/reward_fp4"),
          _with_se(m, "eval/reward_bf16"),
          fmt("rewards/mean"),
          "-" if np.isnan(_advantage_mixed(m)) else f"{_advantage_mixed(m):.2f}",
          fmt("mismatch/k3_kl", "{:.2e}"),
          fmt("mismatch/mantissa_disagree_frac", "{:.4f}"),
        )
      )
  return markdown_table(
    [
      "step",
      "eval fp4",
      "eval bf16",
      "train reward",
      "mixed groups",
      "k3_kl",
      "mantissa-bit disagree",
    ],
    rows,
  )


def write_summary(workdir: str, summary: dict) -> None:
  write_json(os.path.join(workdir, "summary.json"), summary)


def finished_summary(workdir: str, config: RLConfig) -> dict | None:
  """The summary.json of a run in `workdir` that finished `config` (its steps, and no
  field that differs, `RLConfig.differences`): a study reads it instead of rerunning the
  run (its wall time is the run's own). None when there is none, or another config's."""
  try:
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
  except FileNotFoundError:
    return None
  saved = summary.get("config") or {}
  if summary.get("steps") != config.schedule.steps or config.differences(saved):
    return None
  return summary
