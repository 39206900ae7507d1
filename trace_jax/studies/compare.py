"""The arms compared across tasks and seeds: cells, resumption, intervals, tables, plots.

A comparison is a grid of cells, one per (task, seed, arm). Each cell is one RL run's
summary (run/report.py `summarize`, plus its curves), written to
`<results>/cells/<task>/seed<seed>/<arm>/summary.json` once the run finished, so a rerun
skips it (`run_cells`). Then:
  1. per arm and task, the mean of the final (deployment-precision) eval reward over seeds
     with a 95% Student-t interval (n - 1 degrees of freedom: three seeds give wide
     intervals, which is the honest answer);
  2. paired differences against `bf16` and against `fp4-qat` on the same seed (the seed
     fixes the warm start, the problems and the sampling keys, so pairing removes their
     shared variance), with the same interval;
  3. mismatch (mean k3 KL between rollout and training path) and time per arm;
  4. `results.json` (every cell: arm, task, seed, summary), `table.md`, and three plots:
     train reward curves with seed bands, final reward per arm with intervals, k3 per arm on
     a log axis.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from typing import Callable, Iterable, Sequence

import matplotlib.pyplot as plt
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from trace_jax.rl.arms import ARMS, COMPARED  # noqa: E402
from trace_jax.run import report, warmstart  # noqa: E402
from trace_jax.run.rundir import read_metrics  # noqa: E402
from trace_jax.run.trainer import Trainer  # noqa: E402
from trace_jax.utils import markdown_table, write_json  # noqa: E402
from trace_jax.utils.compiled import release_compiled_near_map_limit  # noqa: E402

ALL_ARMS = COMPARED  # the registry's arms the comparison runs by default, in its order
TRAINED_ARMS = tuple(a for a in ALL_ARMS if not ARMS[a].post_training)
DERIVED_ARMS = tuple(a for a in ALL_ARMS if ARMS[a].post_training)  # packed after training
BASELINES = ("bf16", "fp4-qat")
METRIC = "final_eval_reward"


@dataclasses.dataclass(frozen=True)
class Cell:
  """One finished RL run of the grid."""

  arm: str
  task: str
  seed: int
  summary: dict  # the run's summary.json (`run.report.summarize`, plus its curves)

  def value(self, metric: str = METRIC):
    return self.summary.get(metric)

  def to_json(self) -> dict:
    return {"arm": self.arm, "task": self.task, "seed": self.seed, "summary": self.summary}


@dataclasses.dataclass(frozen=True)
class Interval:
  """Mean and confidence interval of the mean over `n` values (NaN bounds below 2)."""

  mean: float
  lo: float
  hi: float
  n: int

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  def format(self, digits: int = 3, signed: bool = False) -> str:
    if self.n == 0 or not math.isfinite(self.mean):
      return "-"
    sign = "+" if signed else ""
    if not math.isfinite(self.lo):
      return f"{self.mean:{sign}.{digits}f}"
    return f"{self.mean:{sign}.{digits}f} [{self.lo:{sign}.{digits}f}, {self.hi:{sign}.{digits}f}]"


@dataclasses.dataclass(frozen=True)
class Row:
  """One (task, arm) of the table: the aggregates the table and the notebook show."""

  task: str
  arm: str
  seeds: int
  eval_precision: str | None
  initial: Interval
  final: Interval
  gain: Interval  # final - initial, per seed
  vs_bf16: Interval | None  # paired, on the seeds both ran
  vs_fp4_qat: Interval | None
  train_reward: Interval
  k3: float | None  # geometric mean of the runs' mean k3 KL
  seconds: float  # mean wall time per cell

  def to_json(self) -> dict:
    return dataclasses.asdict(self)  # (intervals as dicts)


@dataclasses.dataclass(frozen=True)
class Results:
  """A comparison: its settings, its cells and its table rows (results.json)."""

  settings: dict
  cells: list[Cell]
  rows: list[Row]

  def to_json(self) -> dict:
    return {
      "settings": self.settings,
      "cells": [c.to_json() for c in self.cells],
      "rows": [r.to_json() for r in self.rows],
    }


# The step metrics that precede collapse in the published reports (a cell keeps their curves).
PRECURSORS = (
  "mismatch/extreme_frac",
  "is_ratio/p99",
  "mismatch/seq_logratio_p90",
  "mismatch/router_flip_rate",
  "grad_norm",
  "entropy",
  "completions/mean_length",
)


def train_cell(config, path: str, warm_from: Sequence[str] = ()) -> dict:
  """One trained cell: `config` (an RLConfig) run in `path`, or read if it finished there
  with that config (e.g. an experiments/rl.py run copied in). A cell without a warm start of
  its own copies the first of `warm_from` (warm-start directories) that exists: the cells of
  one seed start from one policy (warm starts are keyed by their settings, so one made for
  anything else is rebuilt, never reused). Returns its summary with its curves: train reward,
  mixed-group share, eval in the deployment precision and in FP4, and `precursors`
  ({metric: [[steps], [values]]} of `PRECURSORS` it logged)."""
  first = next((p for p in warm_from if os.path.exists(p)), None)
  target = os.path.join(path, warmstart.WARMSTART_DIR)
  if first is not None and first != target and not os.path.exists(target):
    shutil.copytree(first, target)
  summary = report.finished_summary(path, config)
  if summary is None:
    start = time.time()
    trainer = Trainer(config, path)
    trainer.run()
    summary = report.summarize(config, read_metrics(path), time.time() - start, trainer.warmstart)
  metrics = read_metrics(path)
  train = [m for m in metrics if "rewards/mean" in m]
  steps = [m["step"] for m in train]
  summary["curve_train"] = [steps, [m["rewards/mean"] for m in train]]
  summary["curve_mixed"] = [steps, [m.get("reward/mixed_group_frac") for m in train]]
  summary["curve_eval"] = report.eval_curve(metrics, config.arm_spec.deploy)
  summary["curve_fp4"] = report.eval_curve(metrics, "fp4")
  summary["precursors"] = {
    key: [[m["step"] for m in train if key in m], [m[key] for m in train if key in m]]
    for key in PRECURSORS
    if any(key in m for m in train)
  }
  report.write_summary(path, summary)
  return summary


def cell_dir(results_dir: str, task: str, seed: int, arm: str) -> str:
  return os.path.join(results_dir, "cells", task.replace(":", "_"), f"seed{seed}", arm)


def jsonish(value):
  return json.loads(json.dumps(value))


def read_summary(results_dir: str, task: str, seed: int, arm: str) -> dict | None:
  """The cell's saved summary.json as it is (no config check), or None if it has none."""
  path = os.path.join(cell_dir(results_dir, task, seed, arm), "summary.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def finished_summary(
  results_dir: str,
  task: str,
  seed: int,
  arm: str,
  config: dict,
  defaults: dict | None = None,
  normalize: Callable[[dict], dict] = jsonish,
) -> dict | None:
  """The cell's summary if it finished with this config; None if it has not finished.

  Configs compare as `normalize` writes them (e.g. by flat field name, so a cell saved
  before the config had sections still matches). A field the saved config lacks counts as
  equal when the new value is its entry in `defaults` (a field added to the config class
  later, left at its default, does not invalidate finished cells).

  Raises:
    ValueError: the cell finished with a different config (mixing them would compare
      unlike runs; choose another --name).
  """
  summary = read_summary(results_dir, task, seed, arm)
  if summary is None:
    return None
  path = os.path.join(cell_dir(results_dir, task, seed, arm), "summary.json")
  saved = normalize(dict(summary.get("cell_config") or {}))
  mine = normalize(config)
  for key, value in normalize(defaults or {}).items():
    if key not in saved and mine.get(key) == value:
      saved[key] = value
  if saved != mine:
    differing = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
    raise ValueError(
      f"{path} finished with another config (fields {differing}); use another "
      f"--name or delete that cell"
    )
  return summary


def run_cells(
  results_dir: str,
  plan: Sequence[tuple[str, int, str]],
  config_of: Callable[[str, int, str], dict],
  runner: Callable[[str, int, str], dict],
  *,
  progress: bool = True,
  defaults: dict | None = None,
  normalize: Callable[[dict], dict] = jsonish,
) -> list[Cell]:
  """Run every (task, seed, arm) of `plan` not finished yet, in order; returns all cells.

  Args:
    plan: the cells, dependencies first (the derived arms after their task and seed's bf16).
    config_of: (task, seed, arm) -> the JSON-able settings that define the cell; a finished
      cell is reused only if they match.
    runner: (task, seed, arm) -> the cell's summary (runs the cell).
    defaults, normalize: how configs compare (`finished_summary`).
  """
  cells = []
  for i, (task, seed, arm) in enumerate(plan):
    config = config_of(task, seed, arm)
    summary = finished_summary(results_dir, task, seed, arm, config, defaults, normalize)
    if summary is None:
      if progress:
        print(f"[{i + 1}/{len(plan)}] {arm} on {task}, seed {seed}", flush=True)
      summary = dict(runner(task, seed, arm), cell_config=jsonish(config))
      release_compiled_near_map_limit()  # cells of other arms compile other programs
      write_json(os.path.join(cell_dir(results_dir, task, seed, arm), "summary.json"), summary)
    elif progress:
      print(
        f"[{i + 1}/{len(plan)}] {arm} on {task}, seed {seed}: finished before, kept", flush=True
      )
    cells.append(Cell(arm=arm, task=task, seed=seed, summary=summary))
  return cells


def interval(values: Iterable[float], confidence: float = 0.95) -> Interval:
  """Mean and Student-t confidence interval of the mean; NaN bounds for fewer than 2 values
  (one run says nothing about its spread)."""
  x = np.asarray([v for v in values if v is not None], np.float64)
  n = int(x.size)
  if n == 0:
    return Interval(math.nan, math.nan, math.nan, 0)
  mean = float(x.mean())
  if n < 2:
    return Interval(mean, math.nan, math.nan, 1)
  half = float(stats.t.ppf(0.5 + confidence / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
  return Interval(mean, mean - half, mean + half, n)


def by_key(cells: Sequence[Cell]) -> dict[tuple[str, str, int], Cell]:
  return {(c.task, c.arm, c.seed): c for c in cells}


def arm_interval(cells, task: str, arm: str, metric: str = METRIC) -> Interval:
  return interval(c.value(metric) for c in cells if c.task == task and c.arm == arm)


def paired_difference(cells, task: str, arm: str, baseline: str, metric: str = METRIC) -> Interval:
  """arm - baseline on the seeds both ran, with the interval of the mean difference."""
  index = by_key(cells)
  diffs = []
  for (t, a, seed), cell in sorted(index.items()):
    if t == task and a == arm and (task, baseline, seed) in index:
      mine, theirs = cell.value(metric), index[(task, baseline, seed)].value(metric)
      if mine is not None and theirs is not None:
        diffs.append(mine - theirs)
  return interval(diffs)


def geometric_mean(values: Iterable[float | None]) -> float | None:
  """The geometric mean of the values that are not None (k3 spans decades); None if none."""
  x = [v for v in values if v is not None]
  return float(np.exp(np.mean(np.log(np.maximum(x, 1e-30))))) if x else None


def tasks_and_arms(cells) -> tuple[list[str], list[str]]:
  tasks = list(dict.fromkeys(c.task for c in cells))
  present = {c.arm for c in cells}
  arms = [a for a in ALL_ARMS if a in present] + sorted(present - set(ALL_ARMS))
  return tasks, arms


def table_rows(cells) -> list[Row]:
  """One row per (task, arm)."""
  tasks, arms = tasks_and_arms(cells)
  rows = []
  for task in tasks:
    for arm in arms:
      mine = [c for c in cells if c.task == task and c.arm == arm]
      if not mine:
        continue
      gains = [
        c.value() - c.value("initial_eval_reward")
        for c in mine
        if c.value() is not None and c.value("initial_eval_reward") is not None
      ]
      rows.append(
        Row(
          task=task,
          arm=arm,
          seeds=len(mine),
          eval_precision=mine[0].summary.get("eval_precision"),
          initial=arm_interval(cells, task, arm, "initial_eval_reward"),
          final=arm_interval(cells, task, arm),
          gain=interval(gains),
          vs_bf16=None if arm == "bf16" else paired_difference(cells, task, arm, "bf16"),
          vs_fp4_qat=None if arm == "fp4-qat" else paired_difference(cells, task, arm, "fp4-qat"),
          train_reward=arm_interval(cells, task, arm, "mean_train_reward"),
          k3=geometric_mean(c.value("mean_k3_kl") for c in mine),
          seconds=float(np.mean([c.value("wall_seconds") or 0.0 for c in mine])),
        )
      )
  return rows


def _k3(value: float | None) -> str:
  return "-" if value is None else f"{value:.2e}"


def markdown(cells, confidence: float = 0.95) -> str:
  """The comparison table: mean and interval across seeds, paired differences, k3, time."""
  signed = lambda iv: "-" if iv is None else iv.format(signed=True)  # noqa: E731
  rows = [
    (
      r.task,
      r.arm,
      r.seeds,
      r.eval_precision,
      r.initial.format(),
      r.final.format(),
      signed(r.gain),
      signed(r.vs_bf16),
      signed(r.vs_fp4_qat),
      r.train_reward.format(),
      _k3(r.k3),
      f"{r.seconds:.0f}",
    )
    for r in table_rows(cells)
  ]
  pct = f"{100 * confidence:.0f}%"
  return markdown_table(
    [
      "task",
      "arm",
      "seeds",
      "eval in",
      "initial eval",
      f"final eval (mean [{pct} CI])",
      "gain (final - initial)",
      "vs bf16 (paired)",
      "vs fp4-qat (paired)",
      "mean train reward",
      "k3 KL (geo. mean)",
      "s per cell",
    ],
    rows,
  )


def with_variant(cells, variant_cells, arm: str, variant: str) -> list[Cell]:
  """`cells` plus the runs of `arm` in `variant_cells` renamed `variant`: an ablation (the
  same arm with one setting changed, from the same warm starts on the same seeds) read as one
  more arm, so that `paired_difference(cells, task, variant, arm)` pairs it seed by seed."""
  renamed = [dataclasses.replace(c, arm=variant) for c in variant_cells if c.arm == arm]
  if not renamed:
    found = sorted({c.arm for c in variant_cells})
    raise ValueError(f"with_variant: arm={arm!r} has no cells in the variant (its arms: {found})")
  if variant in {c.arm for c in cells}:
    raise ValueError(f"with_variant: variant={variant!r} is already an arm of the comparison")
  return [*cells, *renamed]


def ablation_markdown(cells, arm: str, variant: str) -> str:
  """`variant` against `arm` (cells from `with_variant`), per task: the seeds both ran, each
  one's final evaluation, and the paired differences (variant - arm, same seed) of the
  initial evaluation, the final evaluation and the gain, with mean train reward and k3."""
  index = by_key(cells)
  rows = []
  for task in tasks_and_arms(cells)[0]:
    seeds = sorted(s for (t, a, s) in index if t == task and a == arm and (t, variant, s) in index)
    if not seeds:
      continue
    pairs = [(index[(task, arm, s)], index[(task, variant, s)]) for s in seeds]
    diff = lambda f: interval(f(v) - f(a) for a, v in pairs).format(signed=True)  # noqa: E731
    gain = lambda c: c.value() - c.value("initial_eval_reward")  # noqa: E731
    rows.append(
      (
        task,
        len(seeds),
        interval(a.value() for a, _ in pairs).format(),
        interval(v.value() for _, v in pairs).format(),
        diff(lambda c: c.value("initial_eval_reward")),
        diff(lambda c: c.value()),
        diff(gain),
        interval(a.value("mean_train_reward") for a, _ in pairs).format(),
        interval(v.value("mean_train_reward") for _, v in pairs).format(),
        _k3(geometric_mean(a.value("mean_k3_kl") for a, _ in pairs)),
        _k3(geometric_mean(v.value("mean_k3_kl") for _, v in pairs)),
      )
    )
  return markdown_table(
    [
      "task",
      "seeds",
      f"{arm} final eval",
      f"{variant} final eval",
      "initial: variant - arm (paired)",
      "final: variant - arm (paired)",
      "gain: variant - arm (paired)",
      f"{arm} train reward",
      f"{variant} train reward",
      f"{arm} k3",
      f"{variant} k3",
    ],
    rows,
  )


def curve_band(cells, task, arm, key="curve_train", window=5):
  curves = [c.summary.get(key) for c in cells if c.task == task and c.arm == arm]
  curves = [c for c in curves if c and len(c[0])]
  if not curves:
    return None
  length = min(len(c[0]) for c in curves)
  steps = np.asarray(curves[0][0][:length])
  values = np.asarray([c[1][:length] for c in curves], np.float64)
  if key == "curve_train" and length >= window:  # smooth the sampled reward per seed
    kernel = np.ones(window) / window
    values = np.asarray([np.convolve(v, kernel, mode="valid") for v in values])
    steps = steps[window - 1 :]
  return steps, values.mean(0), values.min(0), values.max(0)


def save_figure(fig, title: str, path: str) -> str:
  """Title, lay out, write and close one figure; returns its path."""
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def plot(cells, out_dir: str, title: str = "") -> list[str]:
  """reward_curves.png, final_reward.png, k3.png in `out_dir`; returns their paths."""
  tasks, arms = tasks_and_arms(cells)
  paths = []
  colors = {arm: plt.cm.tab10(i) for i, arm in enumerate(ALL_ARMS)}

  fig, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 7), squeeze=False)
  for j, task in enumerate(tasks):
    for row, (key, label) in enumerate(
      (
        ("curve_train", "train reward (sampled, mean of 5)"),
        ("curve_eval", "greedy eval reward (deploy precision)"),
      )
    ):
      ax = axes[row, j]
      for arm in arms:
        band = curve_band(cells, task, arm, key)
        if band is None:
          continue
        steps, mean, lo, hi = band
        ax.plot(steps, mean, label=arm, color=colors.get(arm))
        ax.fill_between(steps, lo, hi, alpha=0.15, color=colors.get(arm))
      ax.set(xlabel="step", ylabel=label, title=f"{task}: mean over seeds, band = min..max")
      ax.legend(fontsize=7)
  paths.append(save_figure(fig, title, os.path.join(out_dir, "reward_curves.png")))

  fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
  for j, task in enumerate(tasks):
    ax = axes[0, j]
    for i, arm in enumerate(arms):
      iv = arm_interval(cells, task, arm)
      if iv.n == 0:
        continue
      seeds = [c.value() for c in cells if c.task == task and c.arm == arm]
      ax.scatter([i] * len(seeds), seeds, color=colors.get(arm), alpha=0.5, s=12)
      err = None if not math.isfinite(iv.lo) else [[iv.mean - iv.lo], [iv.hi - iv.mean]]
      ax.errorbar([i], [iv.mean], yerr=err, fmt="o", color=colors.get(arm), capsize=4)
    ax.set_xticks(range(len(arms)), arms, rotation=30)
    ax.set(ylabel="final greedy eval reward", title=f"{task}: mean, 95% CI, seeds as dots")
  paths.append(save_figure(fig, title, os.path.join(out_dir, "final_reward.png")))

  fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
  for j, task in enumerate(tasks):
    ax = axes[0, j]
    shown = [a for a in arms if a not in DERIVED_ARMS]
    for i, arm in enumerate(shown):
      k3 = [c.value("mean_k3_kl") for c in cells if c.task == task and c.arm == arm]
      k3 = [max(v, 1e-12) for v in k3 if v is not None]
      if k3:
        ax.scatter([i] * len(k3), k3, color=colors.get(arm))
    ax.set_yscale("log")
    ax.set_xticks(range(len(shown)), shown, rotation=30)
    ax.set(ylabel="mean k3 KL, rollout vs training path", title=f"{task}: one dot per seed")
  paths.append(save_figure(fig, title, os.path.join(out_dir, "k3.png")))
  return paths


def write_results(results_dir: str, cells, settings: dict, title: str = "") -> Results:
  """results.json, table.md and the plots; returns the results."""
  os.makedirs(results_dir, exist_ok=True)
  results = Results(settings=settings, cells=list(cells), rows=table_rows(cells))
  write_json(os.path.join(results_dir, "results.json"), jsonish(results.to_json()))
  table = markdown(cells)
  with open(os.path.join(results_dir, "table.md"), "w") as f:
    f.write(f"# {title}\n\n{table}\n" if title else table + "\n")
  plot(cells, results_dir, title)
  return results


def load_results(results_dir: str) -> Results:
  """A comparison's results.json (its rows recomputed from its cells)."""
  with open(os.path.join(results_dir, "results.json")) as f:
    saved = json.load(f)
  cells = [Cell(**c) for c in saved["cells"]]
  return Results(settings=saved["settings"], cells=cells, rows=table_rows(cells))
