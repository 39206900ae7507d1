"""The arms across rollout skew: does guidance change what RL learns once the rollout engine
computes differently from the trainer?

The study runs arms (bf16, fp4-qat, trace, trace-full) on the same seeds and setting at
several `RLConfig.rollout_skew` values (one `compare_arms.py` results directory per point;
skew 0 is today's engine, so its cells may be the arms comparison's own), and at a point it
may also vary the rollout correction (`RLConfig.correction`). A point is (skew, correction).
Per (arm, point), over seeds:
  1. the gain of the greedy evaluation (final - initial) with its 95% Student-t interval (the
     evaluation is never skewed: it scores the policy, not the engine);
  2. the paired difference of the final evaluation against the same arm at skew 0 with the
     default correction, and against fp4-qat at the same point (one warm start per seed, so
     a paired difference is a difference in gain);
  3. the mismatch the run trained under: k3 between the training path and the (skewed)
     rollout, the run's `mismatch/k3_kl` (geometric mean over seeds: it spans decades);
  4. the mean sampled train reward over the run's steps (the skewed rollouts' own reward).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from trace_jax.rl.config import RLConfig
from trace_jax.studies import compare
from trace_jax.utils import markdown_table, write_json

STUDY_ARMS = ("bf16", "fp4-qat", "trace", "trace-full")
SKEWS = (0.015625, 0.0625, 0.25)  # 2^-6, 2^-4, 2^-2: the calibrated range, skew 0 aside
DEFAULT_CORRECTION = "auto"
# The fields that may differ between the cells of one (arm, seed) across points.
SKEW_FIELDS = ("rollout_skew", "correction")


@dataclasses.dataclass(frozen=True, order=True)
class Point:
  """One engine setting of the study: the rollout skew and the rollout correction."""

  correction: str  # RLConfig.correction ("auto": the arm's own)
  skew: float

  @property
  def label(self) -> str:
    text = skew_label(self.skew)
    return text if self.correction == DEFAULT_CORRECTION else f"{text}, {self.correction}"


@dataclasses.dataclass(frozen=True)
class SkewRow:
  """One (arm, point): the aggregates over its seeds."""

  arm: str
  rollout_skew: float
  correction: str
  seeds: int
  gain: compare.Interval  # final - initial eval, per seed
  vs_unskewed: compare.Interval | None  # final(point) - final(skew 0), paired; None at skew 0
  vs_fp4_qat: compare.Interval | None  # final(arm) - final(fp4-qat) at the point, paired
  train_reward: compare.Interval  # each run's mean sampled reward over its steps
  k3: float | None  # geometric mean over seeds of each run's mean k3
  seconds: float  # mean wall time per cell

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def skew_label(skew: float) -> str:
  """0, 2^k for a power of two, else the value."""
  if skew == 0:
    return "0"
  k = math.log2(skew)
  return f"2^{int(k)}" if k == int(k) else f"{skew:g}"


def point_of(cell: compare.Cell) -> Point:
  """The (skew, correction) the cell ran at, from the config its run saved (a field a
  saved config lacks counts as its default)."""
  config = RLConfig.flat_dict(cell.summary["config"])
  return Point(
    correction=str(config.get("correction", DEFAULT_CORRECTION)),
    skew=float(config.get("rollout_skew", 0.0)),
  )


def check_matched(cells_by_point: Mapping[Point, Sequence[compare.Cell]]) -> None:
  """Every cell ran at its point, and the cells of one (arm, seed) differ only in the
  engine's fields and start from one warm start (their initial evaluations, never skewed,
  are equal); a skew effect is otherwise confounded.

  Raises:
    ValueError: naming the cell and the fields that differ.
  """
  first: dict[tuple[str, int], tuple[Point, dict]] = {}
  first_start: dict[tuple[str, int], float | None] = {}
  defaults = RLConfig.flat_dict(RLConfig().to_dict())
  for point, cells in sorted(cells_by_point.items()):
    for cell in cells:
      ran = point_of(cell)
      if ran != point:
        raise ValueError(
          f"{cell.arm} seed {cell.seed}: listed at rollout_skew={point.skew!r}, "
          f"correction={point.correction!r} but ran at rollout_skew={ran.skew!r}, "
          f"correction={ran.correction!r}"
        )
      saved = {**defaults, **RLConfig.flat_dict(cell.summary["config"])}
      config = {n: v for n, v in saved.items() if n not in SKEW_FIELDS}
      key = (cell.arm, cell.seed)
      if key not in first:
        first[key] = (point, config)
        first_start[key] = cell.value("initial_eval_reward")
        continue
      point0, config0 = first[key]
      start, start0 = cell.value("initial_eval_reward"), first_start[key]
      if start != start0:
        raise ValueError(
          f"{cell.arm} seed {cell.seed}: the run at {point.label} starts at initial eval "
          f"{start!r}, the run at {point0.label} at {start0!r}: not one warm start (made on "
          "another machine, or with other settings), so the two cannot be paired"
        )
      differing = sorted(n for n in set(config) | set(config0) if config.get(n) != config0.get(n))
      if differing:
        raise ValueError(
          f"{cell.arm} seed {cell.seed}: the run at {point.label} differs from the run at "
          f"{point0.label} in {differing}; only {list(SKEW_FIELDS)} may differ"
        )


def _gain(cell: compare.Cell) -> float | None:
  final, initial = cell.value(), cell.value("initial_eval_reward")
  return None if final is None or initial is None else final - initial


def _paired(mine: Sequence[compare.Cell], others: Mapping[int, compare.Cell]):
  """final(mine) - final(other) on the seeds both have, or None if they share none."""
  diffs = [
    c.value() - others[c.seed].value()
    for c in mine
    if c.seed in others and c.value() is not None and others[c.seed].value() is not None
  ]
  return compare.interval(diffs) if diffs else None


def _arms(cells_by_point) -> list[str]:
  present = {c.arm for cells in cells_by_point.values() for c in cells}
  return [a for a in compare.ALL_ARMS if a in present] + sorted(present - set(compare.ALL_ARMS))


def rows(cells_by_point: Mapping[Point, Sequence[compare.Cell]]) -> list[SkewRow]:
  """One row per (arm, point): arms in the registry's order, then the default correction's
  points by skew, then the other corrections'."""
  check_matched(cells_by_point)
  base = Point(DEFAULT_CORRECTION, 0.0)
  unskewed = {(c.arm, c.seed): c for c in cells_by_point.get(base, ())}
  out = []
  for arm in _arms(cells_by_point):
    for point in sorted(cells_by_point, key=lambda p: (p.correction != DEFAULT_CORRECTION, p)):
      cells = cells_by_point[point]
      mine = sorted((c for c in cells if c.arm == arm), key=lambda c: c.seed)
      if not mine:
        continue
      qat = {c.seed: c for c in cells if c.arm == "fp4-qat"}
      sync = {s: c for (a, s), c in unskewed.items() if a == arm}
      out.append(
        SkewRow(
          arm=arm,
          rollout_skew=point.skew,
          correction=point.correction,
          seeds=len(mine),
          gain=compare.interval(g for g in map(_gain, mine) if g is not None),
          vs_unskewed=None if point == base else _paired(mine, sync),
          vs_fp4_qat=None if arm == "fp4-qat" else _paired(mine, qat),
          train_reward=compare.interval(
            c.value("mean_train_reward") for c in mine if c.value("mean_train_reward") is not None
          ),
          k3=compare.geometric_mean(c.value("mean_k3_kl") for c in mine),
          seconds=float(np.mean([c.value("wall_seconds") or 0.0 for c in mine])),
        )
      )
  return out


GUIDED_ARMS = ("trace", "trace-full")  # whose paired difference against fp4-qat is the claim


def undecided(cells: Sequence[compare.Cell]) -> list[str]:
  """The guided arms whose paired difference against fp4-qat at one point does not exclude 0
  at 95%: every such interval lies within one interval width of excluding it, so more seeds
  may decide it. An arm with fewer than two seeds paired counts as undecided."""
  qat = {c.seed: c for c in cells if c.arm == "fp4-qat"}
  out = []
  for arm in GUIDED_ARMS:
    mine = [c for c in cells if c.arm == arm]
    if not mine or not qat:
      continue
    paired = _paired(mine, qat)
    finite = paired is not None and math.isfinite(paired.lo) and math.isfinite(paired.hi)
    if not finite or paired.lo <= 0.0 <= paired.hi:
      out.append(arm)
  return out


def _sci(value: float | None) -> str:
  return "-" if value is None else f"{value:.1e}"


def markdown(cells_by_point: Mapping[Point, Sequence[compare.Cell]]) -> str:
  """The study's table: per (arm, point) the gain, the paired differences against skew 0
  and against fp4-qat, the train reward, k3 and the time per cell."""
  signed = lambda iv: "-" if iv is None else iv.format(signed=True)  # noqa: E731
  body = [
    (
      r.arm,
      skew_label(r.rollout_skew),
      r.correction,
      r.seeds,
      signed(r.gain),
      signed(r.vs_unskewed),
      signed(r.vs_fp4_qat),
      r.train_reward.format(),
      _sci(r.k3),
      f"{r.seconds:.0f}",
    )
    for r in rows(cells_by_point)
  ]
  return markdown_table(
    [
      "arm",
      "rollout_skew",
      "correction",
      "seeds",
      "gain (mean [95% CI])",
      "vs skew 0 (paired)",
      "vs fp4-qat (paired)",
      "mean train reward",
      "k3 (geo. mean)",
      "s per cell",
    ],
    body,
  )


def _x(skews: Sequence[float]):
  """Log-axis positions: skew 0 placed 4x left of the smallest nonzero skew."""
  positive = sorted(s for s in skews if s > 0)
  zero_x = positive[0] / 4 if positive else 1.0
  return (lambda s: s if s > 0 else zero_x), zero_x


def _axis(ax, skews, zero_x) -> None:
  ticks = sorted(set(skews))
  ax.set_xscale("log")
  ax.set_xticks([s if s > 0 else zero_x for s in ticks], [skew_label(s) for s in ticks])
  ax.minorticks_off()
  ax.set_xlabel("rollout skew s (each layer's output x 1 + s u on the rollout path)")


def _errorbar(ax, xs, intervals, **kwargs) -> None:
  means = [iv.mean for iv in intervals]
  err = np.asarray(
    [
      [iv.mean - iv.lo if math.isfinite(iv.lo) else 0.0 for iv in intervals],
      [iv.hi - iv.mean if math.isfinite(iv.hi) else 0.0 for iv in intervals],
    ]
  )
  ax.errorbar(xs, means, yerr=err, capsize=4, **kwargs)


def plot(cells_by_point: Mapping[Point, Sequence[compare.Cell]], out_dir: str, title="") -> list:
  """gain_vs_skew.png (each arm's gain, 95% interval, seeds as dots), k3_vs_skew.png (each
  arm's k3, log axes) and trace_vs_fp4qat.png (the paired trace - fp4-qat and trace-full -
  fp4-qat per skew). Points with another correction are drawn hollow and dashed beside."""
  table = rows(cells_by_point)
  skews = [p.skew for p in cells_by_point]
  at, zero_x = _x(skews)
  colors = {arm: plt.cm.tab10(i) for i, arm in enumerate(compare.ALL_ARMS)}
  corrections = sorted({r.correction for r in table}, key=lambda c: c != DEFAULT_CORRECTION)
  style = {c: ("o-" if c == DEFAULT_CORRECTION else "D--") for c in corrections}
  paths = []
  arms = list(dict.fromkeys(r.arm for r in table))

  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  for j, arm in enumerate(arms):
    shift = 1.06 ** (j - (len(arms) - 1) / 2)  # arms side by side on the log axis
    for corr in corrections:
      mine = [r for r in table if r.arm == arm and r.correction == corr]
      if not mine:
        continue
      xs = [at(r.rollout_skew) * shift for r in mine]
      for x, r in zip(xs, mine):
        point = Point(corr, r.rollout_skew)
        dots = [_gain(c) for c in cells_by_point[point] if c.arm == arm]
        ax.scatter([x] * len(dots), dots, color=colors.get(arm), alpha=0.35, s=10)
      label = arm if corr == DEFAULT_CORRECTION else f"{arm} ({corr})"
      _errorbar(ax, xs, [r.gain for r in mine], fmt=style[corr], color=colors.get(arm), label=label)
  ax.axhline(0.0, color="grey", lw=0.5)
  _axis(ax, skews, zero_x)
  ax.set(ylabel="eval gain (final - initial)")
  ax.set_title("gain: mean, 95% CI, seeds as dots", fontsize=9)
  ax.legend(fontsize=7)
  paths.append(compare.save_figure(fig, title, os.path.join(out_dir, "gain_vs_skew.png")))

  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  for arm in arms:
    for corr in corrections:
      mine = [r for r in table if r.arm == arm and r.correction == corr and r.k3]
      if mine:
        label = arm if corr == DEFAULT_CORRECTION else f"{arm} ({corr})"
        ys = [r.k3 for r in mine]
        ax.plot([at(r.rollout_skew) for r in mine], ys, style[corr], color=colors[arm], label=label)
  ax.set_yscale("log")
  _axis(ax, skews, zero_x)
  ax.set(ylabel="mismatch/k3_kl over the run (geo. mean over seeds)")
  ax.legend(fontsize=7)
  paths.append(compare.save_figure(fig, title, os.path.join(out_dir, "k3_vs_skew.png")))

  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  for j, arm in enumerate(a for a in arms if a.startswith("trace")):
    for corr in corrections:
      mine = [r for r in table if r.arm == arm and r.correction == corr and r.vs_fp4_qat]
      if mine:
        xs = [at(r.rollout_skew) * 1.06**j for r in mine]
        label = f"{arm} - fp4-qat" + ("" if corr == DEFAULT_CORRECTION else f" ({corr})")
        intervals = [r.vs_fp4_qat for r in mine]
        _errorbar(ax, xs, intervals, fmt=style[corr], color=colors[arm], label=label)
  ax.axhline(0.0, color="grey", lw=0.5)
  _axis(ax, skews, zero_x)
  ax.set(ylabel="final eval, paired by seed")
  ax.set_title("guided - unguided FP4 QAT: mean, 95% CI", fontsize=9)
  ax.legend(fontsize=7)
  paths.append(compare.save_figure(fig, title, os.path.join(out_dir, "trace_vs_fp4qat.png")))
  return paths


def write_results(
  results_dir: str,
  cells_by_point: Mapping[Point, Sequence[compare.Cell]],
  settings: dict,
  title: str = "",
) -> list[SkewRow]:
  """results.json (`settings`, `cells` with their `rollout_skew` and `correction`, `rows`),
  table.md and the three plots in `results_dir`; returns the rows. Nothing is written if
  the cells are not matched (`check_matched`)."""
  table = rows(cells_by_point)
  os.makedirs(results_dir, exist_ok=True)
  saved = {
    "settings": settings,
    "cells": [
      dict(c.to_json(), rollout_skew=p.skew, correction=p.correction)
      for p, cells in sorted(cells_by_point.items())
      for c in cells
    ],
    "rows": [r.to_json() for r in table],
  }
  write_json(os.path.join(results_dir, "results.json"), compare.jsonish(saved))
  text = markdown(cells_by_point)
  with open(os.path.join(results_dir, "table.md"), "w") as f:
    f.write(f"# {title}\n\n{text}\n" if title else text + "\n")
  plot(cells_by_point, results_dir, title)
  return table


def load_results(results_dir: str) -> tuple[dict, dict[Point, list[compare.Cell]]]:
  """A study's results.json: its settings and its cells by point (what `write_results`
  saved; the rows are `rows(cells_by_point)` again)."""
  with open(os.path.join(results_dir, "results.json")) as f:
    saved = json.load(f)
  cells_by_point: dict[Point, list[compare.Cell]] = {}
  for c in saved["cells"]:
    point = Point(correction=c.pop("correction"), skew=float(c.pop("rollout_skew")))
    cells_by_point.setdefault(point, []).append(compare.Cell(**c))
  return saved["settings"], dict(sorted(cells_by_point.items()))
