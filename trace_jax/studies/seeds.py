"""The main job across seeds, each against its matched placebo: does it learn, and is it the
reward that taught it?

For each seed two runs of the same config from the same warm start: "real" (the rewards as
scored) and "placebo" (`--reward_control=shuffle`: each group's rewards permuted within the
group, so the same groups carry advantages of the same sizes and only which sample earned
them is lost). A seed meets the main job's target when its greedy (deployment precision)
evaluation rises by at least `TARGET_GAIN`, ends at least `TARGET_GAIN` above its placebo's,
and the real run (warm start included) took at most `TARGET_SECONDS`.

Cells are `compare.Cell`s with arm "real" or "placebo", so they resume and serialise like
the arms comparison's (`compare.run_cells`, `results.json`).
"""

from __future__ import annotations

import dataclasses
import math
import os

import matplotlib.pyplot as plt

from trace_jax.studies import compare  # noqa: E402
from trace_jax.utils import markdown_table, write_json  # noqa: E402

CONTROLS = {"real": "none", "placebo": "shuffle"}  # cell arm -> RLConfig.reward_control
TARGET_GAIN = 0.15
TARGET_SECONDS = 600.0


@dataclasses.dataclass(frozen=True)
class SeedRow:
  """One seed: the real run's rise, its placebo's, and whether the target is met."""

  seed: int
  initial: float
  final: float
  best: float  # the real run's highest evaluation (after step 0)
  placebo_final: float
  wall_seconds: float  # the real run's, warm start included

  @property
  def gain(self) -> float:
    return self.final - self.initial

  @property
  def placebo_gain(self) -> float:
    return self.placebo_final - self.initial

  @property
  def above_placebo(self) -> float:
    return self.final - self.placebo_final

  @property
  def meets_target(self) -> bool:
    return (
      self.gain >= TARGET_GAIN
      and self.above_placebo >= TARGET_GAIN
      and self.wall_seconds <= TARGET_SECONDS
    )


def seed_rows(cells) -> list[SeedRow]:
  """A row per seed that has both runs, by seed."""
  index = {(c.arm, c.seed): c.summary for c in cells}
  rows = []
  for seed in sorted({c.seed for c in cells}):
    real, placebo = index.get(("real", seed)), index.get(("placebo", seed))
    if real is None or placebo is None:
      continue
    curve = real.get("curve_eval") or [[], []]
    later = [r for s, r in zip(*curve) if s > 0]
    rows.append(
      SeedRow(
        seed=seed,
        initial=real["initial_eval_reward"],
        final=real["final_eval_reward"],
        best=max(later) if later else math.nan,
        placebo_final=placebo["final_eval_reward"],
        wall_seconds=real["wall_seconds"],
      )
    )
  return rows


def markdown(cells) -> str:
  rows = seed_rows(cells)
  table = markdown_table(
    [
      "seed",
      "eval at step 0",
      "final",
      "gain",
      "best",
      "placebo final",
      "above placebo",
      "wall s",
      f"target (+{TARGET_GAIN}, +{TARGET_GAIN} over placebo, <= {TARGET_SECONDS:.0f} s)",
    ],
    [
      [
        r.seed,
        f"{r.initial:.3f}",
        f"{r.final:.3f}",
        f"{r.gain:+.3f}",
        f"{r.best:.3f}",
        f"{r.placebo_final:.3f}",
        f"{r.above_placebo:+.3f}",
        f"{r.wall_seconds:.0f}",
        "met" if r.meets_target else "missed",
      ]
      for r in rows
    ],
  )
  gains = compare.interval(r.gain for r in rows)
  gaps = compare.interval(r.above_placebo for r in rows)
  return (
    f"{table}\n\nover {gains.n} seeds (mean, 95% t interval): gain "
    f"{gains.format(signed=True)}; above placebo {gaps.format(signed=True)}"
  )


def plot(cells, path: str, title: str = "") -> str:
  """The greedy evaluation over steps: each seed's real run (solid) and placebo (dashed)."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  seeds = sorted({c.seed for c in cells})
  for i, seed in enumerate(seeds):
    color = plt.cm.tab10(i)
    for cell in cells:
      curve = cell.summary.get("curve_eval")
      if cell.seed != seed or not curve:
        continue
      style = "-" if cell.arm == "real" else "--"
      ax.plot(*curve, style, color=color, marker="o", ms=3, label=f"seed {seed} {cell.arm}")
  ax.set(xlabel="RL step", ylabel="greedy eval reward (held-out, deploy precision)")
  ax.legend(fontsize=7, ncol=2)
  return compare.save_figure(fig, title, path)


def write_results(results_dir: str, cells, settings: dict, title: str = "") -> list[SeedRow]:
  """results.json (`cells`, `settings`, `rows`), table.md and curves.png; returns the rows."""
  os.makedirs(results_dir, exist_ok=True)
  rows = seed_rows(cells)
  saved = {
    "settings": settings,
    "cells": [c.to_json() for c in cells],
    "rows": [
      dict(
        dataclasses.asdict(r),
        gain=r.gain,
        above_placebo=r.above_placebo,
        meets_target=r.meets_target,
      )
      for r in rows
    ],
  }
  write_json(os.path.join(results_dir, "results.json"), compare.jsonish(saved))
  with open(os.path.join(results_dir, "table.md"), "w") as f:
    f.write(f"# {title}\n\n{markdown(cells)}\n" if title else markdown(cells) + "\n")
  plot(cells, os.path.join(results_dir, "curves.png"), title)
  return rows
