"""Asynchronous RL across staleness: what a version gap costs each arm, and what guidance
recorded under old weights still does.

The study runs the arms fp4-qat, trace and trace-full at staleness k = 0, 1, 3 on the same
seeds and setting (one `compare_arms.py` results directory per k and learning rate; k = 0 is
the synchronous loop, so its cells may be the arms comparison's own). A study may run some k
at a second learning rate too (a rate tuned for k = 0 may be too large a step for gradients
on data k versions old); each cell's rate is the one its run saved, and a row is one (arm,
learning rate, k), paired against the same arm at k = 0 at the same rate. Per row, over
seeds:
  1. the gain of the greedy evaluation (final - initial) with its 95% Student-t interval, and
     the paired difference of the final evaluation against the same arm at k = 0 on the same
     seed (one warm start per seed, so the initial evaluations are equal and the difference
     is the difference in gain); the lowest point of each run's evaluation curve (a run that
     dips and recovers ends where a steady one does), the mean evaluation over the run
     (every evaluation after step 0, less the initial one: a dip lowers it wherever it
     ends) with its interval and its paired difference against k = 0, and the mean sampled
     train reward over the run's steps, with its interval (less noisy than one final
     evaluation);
  2. the mismatch: total k3 (proximal vs behaviour, the run's `mismatch/k3_kl`), and its two
     parts from the diagnostic steps, precision k3 (training path vs rollout path at the
     rollout's weights) and version k3 (the training path at the rollout's weights vs at
     the learner's); geometric means over seeds, since k3 spans decades. At k = 0 there is
     no version gap: the total is the precision part;
  3. the decoupled objective's masked share, the largest version gap consumed, and the
     guidance's followed share by version gap (the mean over seeds of each run's
     `followed_frac_by_gap`).
With more than one learning rate, `rate_effects` asks whether a smaller step removes what k
costs: per seed, k's paired cost (k against k = 0) at the smaller rate less its cost at the
largest, on the final and on the run's mean evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np  # noqa: E402

from trace_jax.rl.config import RLConfig  # noqa: E402
from trace_jax.studies import compare  # noqa: E402
from trace_jax.utils import markdown_table, write_json  # noqa: E402

STUDY_ARMS = ("fp4-qat", "trace", "trace-full")
STALENESS = (0, 1, 3)
# The fields that may differ between the cells of one (arm, seed) across k and rates.
ASYNC_FIELDS = ("max_staleness", "version_diag_every", "learning_rate")


@dataclasses.dataclass(frozen=True)
class StalenessRow:
  """One (arm, learning rate, k): the aggregates over its seeds."""

  arm: str
  staleness: int
  seeds: int
  gain: compare.Interval  # final - initial eval, per seed
  vs_sync: compare.Interval | None  # final(k) - final(0) at this rate, by seed; None at k = 0
  lowest_eval: float | None  # mean over seeds of each run's lowest evaluation (its dips)
  run_gain: compare.Interval  # mean evaluation after step 0 - initial, per seed
  run_vs_sync: compare.Interval | None  # run_gain(k) - run_gain(0) at this rate, by seed
  train_reward: compare.Interval  # each run's mean sampled reward over its steps
  total_k3: float | None  # geometric means over seeds of each run's mean
  precision_k3: float | None
  version_k3: float | None
  masked_frac: float | None  # mean over seeds
  max_version_gap: int | None
  followed_by_gap: dict[str, float]  # {gap: mean over seeds}
  seconds: float  # mean wall time per cell
  learning_rate: float | None = None  # the cells' RLConfig.learning_rate

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def staleness_of(cell: compare.Cell) -> int:
  """The cell's max_staleness, from the config its run saved."""
  return int(RLConfig.flat_dict(cell.summary["config"]).get("max_staleness", 0))


def learning_rate_of(cell: compare.Cell) -> float:
  """The cell's learning rate, from the config its run saved (a field it lacks: the
  default)."""
  saved = RLConfig.flat_dict(cell.summary["config"])
  return float(saved.get("learning_rate", RLConfig().schedule.learning_rate))


def check_matched(cells_by_k: Mapping[int, Sequence[compare.Cell]]) -> None:
  """Every cell ran at its k, and the cells of one (arm, seed) differ only in the
  asynchronous fields (a staleness effect is otherwise confounded). A field a saved config
  lacks (added to RLConfig after that run) counts as its default.

  Raises:
    ValueError: naming the cell and the fields that differ.
  """
  first: dict[tuple[str, int], tuple[int, dict]] = {}
  defaults = RLConfig.flat_dict(RLConfig().to_dict())
  for k, cells in sorted(cells_by_k.items()):
    for cell in cells:
      ran = staleness_of(cell)
      if ran != k:
        raise ValueError(
          f"{cell.arm} seed {cell.seed}: listed at staleness {k} but ran at max_staleness={ran}"
        )
      saved = {**defaults, **RLConfig.flat_dict(cell.summary["config"])}  # a field added
      config = {n: v for n, v in saved.items() if n not in ASYNC_FIELDS}  # later: its default
      key = (cell.arm, cell.seed)
      if key not in first:
        first[key] = (k, config)
        continue
      k0, config0 = first[key]
      differing = sorted(n for n in set(config) | set(config0) if config.get(n) != config0.get(n))
      if differing:
        raise ValueError(
          f"{cell.arm} seed {cell.seed}: the staleness {k} run differs from the staleness {k0} "
          f"run in {differing}; only {list(ASYNC_FIELDS)} may differ"
        )


def _mean(values) -> float | None:
  values = [v for v in values if v is not None]
  return float(np.mean(values)) if values else None


def _gain(cell: compare.Cell) -> float | None:
  final, initial = cell.value(), cell.value("initial_eval_reward")
  return None if final is None or initial is None else final - initial


def rows(cells_by_k: Mapping[int, Sequence[compare.Cell]]) -> list[StalenessRow]:
  """One row per (arm, learning rate, k): arms in the registry's order, then rates from the
  largest, then k ascending."""
  check_matched(cells_by_k)
  present = {c.arm for cells in cells_by_k.values() for c in cells}
  arms = [a for a in compare.ALL_ARMS if a in present] + sorted(present - set(compare.ALL_ARMS))
  rates = sorted(
    {learning_rate_of(c) for cells in cells_by_k.values() for c in cells}, reverse=True
  )
  sync = {(c.arm, learning_rate_of(c), c.seed): c for c in cells_by_k.get(0, ())}
  out = []
  for arm, rate in ((a, r) for a in arms for r in rates):
    for k in sorted(cells_by_k):
      mine = sorted(
        (c for c in cells_by_k[k] if c.arm == arm and learning_rate_of(c) == rate),
        key=lambda c: c.seed,
      )
      if not mine:
        continue
      if k == 0:
        vs_sync, run_vs_sync = None, None
        precision, version = [c.value("mean_k3_kl") for c in mine], []
      else:
        paired = [(c, sync.get((arm, rate, c.seed))) for c in mine]
        vs_sync = compare.interval(
          c.value() - s.value()
          for c, s in paired
          if s is not None and c.value() is not None and s.value() is not None
        )
        run_vs_sync = compare.interval(
          _run_gain(c) - _run_gain(s)
          for c, s in paired
          if s is not None and _run_gain(c) is not None and _run_gain(s) is not None
        )
        precision = [c.value("mean_precision_k3") for c in mine]
        version = [c.value("mean_version_k3") for c in mine]
      by_gap: dict[str, list[float]] = {}
      for c in mine:
        for gap, share in (c.value("followed_frac_by_gap") or {}).items():
          by_gap.setdefault(str(gap), []).append(share)
      gaps = [c.value("max_version_gap") for c in mine if c.value("max_version_gap") is not None]
      out.append(
        StalenessRow(
          arm=arm,
          staleness=k,
          seeds=len(mine),
          gain=compare.interval(_gain(c) for c in mine),
          vs_sync=vs_sync,
          lowest_eval=_mean(_lowest(c) for c in mine),
          run_gain=compare.interval(_run_gain(c) for c in mine),
          run_vs_sync=run_vs_sync,
          train_reward=compare.interval(
            c.value("mean_train_reward") for c in mine if c.value("mean_train_reward") is not None
          ),
          total_k3=compare.geometric_mean(c.value("mean_k3_kl") for c in mine),
          precision_k3=compare.geometric_mean(precision),
          version_k3=compare.geometric_mean(version),
          masked_frac=_mean(c.value("mean_masked_frac") for c in mine),
          max_version_gap=max(gaps) if gaps else (0 if k == 0 else None),
          followed_by_gap={g: float(np.mean(v)) for g, v in sorted(by_gap.items(), key=_gap)},
          seconds=float(np.mean([c.value("wall_seconds") or 0.0 for c in mine])),
          learning_rate=rate,
        )
      )
  return out


def _lowest(cell: compare.Cell) -> float | None:
  """The lowest point of the run's evaluation curve (`curve_eval`: steps, values)."""
  curve = cell.value("curve_eval")
  return float(min(curve[1])) if curve and curve[1] else None


def _run_gain(cell: compare.Cell) -> float | None:
  """The run's mean evaluation after step 0 (`curve_eval`) less its initial evaluation."""
  curve, initial = cell.value("curve_eval"), cell.value("initial_eval_reward")
  later = [v for step, v in zip(*curve) if step > 0] if curve else []
  return float(np.mean(later)) - initial if later and initial is not None else None


@dataclasses.dataclass(frozen=True)
class RateEffect:
  """What a smaller learning rate does to k's cost, for one (arm, k > 0, rate below the
  largest): per seed, (x(k) - x(0)) at `rate` less (x(k) - x(0)) at `top_rate`, for x the final
  evaluation (`final`) and the run's mean evaluation (`run`). > 0: the smaller step costs k
  less than the larger one does."""

  arm: str
  staleness: int
  rate: float
  top_rate: float
  final: compare.Interval
  run: compare.Interval
  final_by_seed: dict[int, float]
  run_by_seed: dict[int, float]

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def rate_effects(cells_by_k: Mapping[int, Sequence[compare.Cell]]) -> list[RateEffect]:
  """One `RateEffect` per (arm, k > 0, smaller rate) whose seeds ran all four cells (k and
  k = 0 at both rates); none with a single rate."""
  check_matched(cells_by_k)
  by = {
    (c.arm, learning_rate_of(c), k, c.seed): c for k, cells in cells_by_k.items() for c in cells
  }
  rates = sorted({key[1] for key in by if key[1] is not None}, reverse=True)
  present = {key[0] for key in by}
  arms = [a for a in compare.ALL_ARMS if a in present] + sorted(present - set(compare.ALL_ARMS))
  seeds = sorted({key[3] for key in by})
  metrics = {"final": lambda c: c.value(), "run": _run_gain}
  out = []
  for arm in arms:
    for k in sorted(k for k in cells_by_k if k > 0):
      for rate in rates[1:]:
        effect = {name: {} for name in metrics}
        for seed in seeds:
          cells = [by.get((arm, r, kk, seed)) for r in (rate, rates[0]) for kk in (k, 0)]
          if any(c is None for c in cells):
            continue
          for name, f in metrics.items():
            x = [f(c) for c in cells]
            if all(v is not None for v in x):
              effect[name][seed] = (x[0] - x[1]) - (x[2] - x[3])
        if effect["final"]:
          out.append(
            RateEffect(
              arm=arm,
              staleness=k,
              rate=rate,
              top_rate=rates[0],
              final=compare.interval(effect["final"].values()),
              run=compare.interval(effect["run"].values()),
              final_by_seed=effect["final"],
              run_by_seed=effect["run"],
            )
          )
  return out


def rate_markdown(cells_by_k: Mapping[int, Sequence[compare.Cell]]) -> str:
  """`rate_effects` as a table ("" with a single rate)."""
  effects = rate_effects(cells_by_k)
  if not effects:
    return ""
  seeds = lambda d: " ".join(f"{v:+.3f}" for _, v in sorted(d.items()))  # noqa: E731
  body = [
    (
      e.arm,
      e.staleness,
      f"{e.rate:.2g} vs {e.top_rate:.2g}",
      e.final.n,
      e.final.format(signed=True),
      seeds(e.final_by_seed),
      e.run.format(signed=True),
      seeds(e.run_by_seed),
    )
    for e in effects
  ]
  return markdown_table(
    [
      "arm",
      "k",
      "learning rates",
      "seeds",
      "cost removed, final eval",
      "by seed",
      "cost removed, eval over the run",
      "by seed",
    ],
    body,
  )


def _gap(item) -> int:
  return int(item[0])


def _sci(value: float | None) -> str:
  return "-" if value is None else f"{value:.1e}"


def markdown(cells_by_k: Mapping[int, Sequence[compare.Cell]]) -> str:
  """The study's table: gain, paired difference against k = 0, the k3 split, the masked
  share, the largest gap and the followed share per gap."""
  signed = lambda iv: "-" if iv is None else iv.format(signed=True)  # noqa: E731
  body = [
    (
      r.arm,
      "-" if r.learning_rate is None else f"{r.learning_rate:.2g}",
      r.staleness,
      r.seeds,
      signed(r.gain),
      signed(r.vs_sync),
      signed(r.run_gain),
      signed(r.run_vs_sync),
      "-" if r.lowest_eval is None else f"{r.lowest_eval:.3f}",
      r.train_reward.format(),
      _sci(r.total_k3),
      _sci(r.precision_k3),
      "0 (sync)" if r.staleness == 0 else _sci(r.version_k3),
      _sci(r.masked_frac),
      "-" if r.max_version_gap is None else r.max_version_gap,
      ", ".join(f"{g}: {v:.5f}" for g, v in r.followed_by_gap.items()) or "-",
      f"{r.seconds:.0f}",
    )
    for r in rows(cells_by_k)
  ]
  return markdown_table(
    [
      "arm",
      "learning rate",
      "k",
      "seeds",
      "gain (mean [95% CI])",
      "vs k = 0 (paired, same rate)",
      "eval over the run - initial",
      "vs k = 0 (paired)",
      "lowest eval",
      "mean train reward",
      "total k3",
      "precision k3",
      "version k3",
      "masked share",
      "max gap",
      "followed by gap",
      "s per cell",
    ],
    body,
  )


def plot(cells_by_k: Mapping[int, Sequence[compare.Cell]], path: str, title: str = "") -> str:
  """Left: each arm's gain against k (mean, 95% interval, seeds as dots), one line per
  learning rate (the largest solid, smaller ones dotted). Middle: the same for the eval over
  the run (`StalenessRow.run_gain`: a dip the run recovers from shows there). Right: its
  precision and version k3 against k (log axis)."""
  table = rows(cells_by_k)
  lines = list(dict.fromkeys((r.arm, r.learning_rate) for r in table))
  top_rate = max((r.learning_rate for r in table if r.learning_rate is not None), default=None)
  colors = {arm: plt.cm.tab10(i) for i, arm in enumerate(compare.ALL_ARMS)}
  fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4))
  for j, (arm, rate) in enumerate(lines):
    mine = [r for r in table if r.arm == arm and r.learning_rate == rate]
    scaled = len({r for _, r in lines}) > 1 and rate != top_rate
    label = f"{arm}, lr {rate:.2g}" if rate is not None and len({r for _, r in lines}) > 1 else arm
    ks = np.asarray([r.staleness for r in mine], np.float64) + 0.06 * (j - len(lines) / 2)
    style = "o:" if scaled else "o-"
    for ax, field, of_cell in ((left, "gain", _gain), (middle, "run_gain", _run_gain)):
      for x, k in zip(ks, (r.staleness for r in mine)):
        dots = [of_cell(c) for c in cells_by_k[k] if c.arm == arm and learning_rate_of(c) == rate]
        ax.scatter([x] * len(dots), dots, color=colors.get(arm), alpha=0.4, s=10)
      ivs = [getattr(r, field) for r in mine]
      err = np.asarray(
        [
          [iv.mean - iv.lo if math.isfinite(iv.lo) else 0.0 for iv in ivs],
          [iv.hi - iv.mean if math.isfinite(iv.hi) else 0.0 for iv in ivs],
        ]
      )
      means = [iv.mean for iv in ivs]
      ax.errorbar(ks, means, yerr=err, fmt=style, color=colors.get(arm), capsize=4, label=label)
    precision = [r.precision_k3 or math.nan for r in mine]
    version = [math.nan if r.staleness == 0 else (r.version_k3 or math.nan) for r in mine]
    right.plot(ks, precision, style, color=colors.get(arm), label=f"{label} precision")
    right.plot(
      ks, version, "s:" if scaled else "s--", color=colors.get(arm), label=f"{label} version"
    )
  ks = sorted(cells_by_k)
  for ax in (left, middle):
    ax.axhline(0.0, color="grey", lw=0.5)
  left.set(xlabel="max staleness k", ylabel="eval gain (final - initial)", xticks=ks)
  left.set_title("gain: mean, 95% CI, seeds as dots")
  middle.set(xlabel="max staleness k", ylabel="mean eval after step 0 - initial", xticks=ks)
  middle.set_title("eval over the run (dips show here)")
  right.set_yscale("log")
  right.set(xlabel="max staleness k", ylabel="k3 (geo. mean over seeds)", xticks=ks)
  right.set_title("mismatch split: precision (solid), version (dashed)")
  left.legend(fontsize=7)
  right.legend(fontsize=6, ncol=2)
  return compare.save_figure(fig, title, path)


def write_results(
  results_dir: str,
  cells_by_k: Mapping[int, Sequence[compare.Cell]],
  settings: dict,
  title: str = "",
) -> list[StalenessRow]:
  """results.json (`settings`, `cells` with their `staleness`, `rows`, `rate_effects`),
  table.md and study.png in `results_dir`; returns the rows. Nothing is written if the cells
  are not matched (`check_matched`)."""
  table = rows(cells_by_k)
  effects = rate_effects(cells_by_k)
  os.makedirs(results_dir, exist_ok=True)
  saved = {
    "settings": settings,
    "cells": [
      dict(c.to_json(), staleness=k) for k, cells in sorted(cells_by_k.items()) for c in cells
    ],
    "rows": [r.to_json() for r in table],
    "rate_effects": [e.to_json() for e in effects],
  }
  write_json(os.path.join(results_dir, "results.json"), compare.jsonish(saved))
  text = markdown(cells_by_k)
  if effects:
    text += (
      "\n\nWhat the smaller learning rate removes of k's cost (paired by seed: k - (k = 0) at "
      "the smaller rate less k - (k = 0) at the larger; > 0: less cost):\n\n"
      + rate_markdown(cells_by_k)
    )
  with open(os.path.join(results_dir, "table.md"), "w") as f:
    f.write(f"# {title}\n\n{text}\n" if title else text + "\n")
  plot(cells_by_k, os.path.join(results_dir, "study.png"), title)
  return table


def load_results(results_dir: str) -> tuple[dict, dict[int, list[compare.Cell]]]:
  """A study's results.json: its settings and its cells by staleness (what `write_results`
  saved; the rows are `rows(cells_by_k)` again)."""
  with open(os.path.join(results_dir, "results.json")) as f:
    saved = json.load(f)
  cells_by_k: dict[int, list[compare.Cell]] = {}
  for c in saved["cells"]:
    k = int(c.pop("staleness"))
    cells_by_k.setdefault(k, []).append(compare.Cell(**c))
  return saved["settings"], dict(sorted(cells_by_k.items()))
