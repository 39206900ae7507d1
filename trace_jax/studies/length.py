"""Guidance's payoff against answer length: the arms, and the corrections frameworks ship, at
two or more chain lengths, paired seed by seed (experiments/length_arms.py runs it).

A cell is (length, seed, variant). A variant is an arm with, optionally, another rollout
correction: `fp4-qat+tis` is fp4-qat with token TIS, `fp4-qat+geo_mask` with the geometric
sequence mask. Within a (length, seed) every variant starts from one SFT warm start and sees
the same problems and sampling keys, so a difference of gains (final - initial eval) on one
seed is paired.

What the table reads:
- per length, the paired gain differences of `COMPARISONS` (trace against fp4-qat, routing
  replay alone and each correction; replay alone against fp4-qat), with 95% intervals;
- fp4-qat's sequence-level mismatch at that length (the mean over its steps of
  `mismatch/seq_logratio_p90`, then over seeds), the axis the difference is read against;
- collapses: a cell whose final eval fell more than `COLLAPSE_DROP` below its initial eval,
  with its collapse precursors (`PRECURSORS`) over its first and last tenth of steps.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from trace_jax.studies import compare
from trace_jax.utils import markdown_table, write_json

# name: (arm, rollout correction; None: the arm's own)
VARIANTS = {
  "bf16": ("bf16", None),
  "fp4-qat": ("fp4-qat", None),
  "fp4-qat-r3": ("fp4-qat-r3", None),
  "trace": ("trace", None),
  "trace-full": ("trace-full", None),
  "fp4-qat+tis": ("fp4-qat", "tis"),
  "fp4-qat+geo_mask": ("fp4-qat", "geo_mask"),
}
CORRECTION_VARIANTS = ("fp4-qat+tis", "fp4-qat+geo_mask")  # run on fewer seeds
COMPARISONS = (
  ("trace", "fp4-qat"),
  ("trace", "fp4-qat-r3"),
  ("trace", "fp4-qat+tis"),
  ("trace", "fp4-qat+geo_mask"),
  ("trace-full", "fp4-qat"),
  ("fp4-qat-r3", "fp4-qat"),
)
PRECURSORS = compare.PRECURSORS  # kept per cell as curves (`compare.train_cell`)
COLLAPSE_DROP = 0.1  # a final eval this far below the initial one is a collapse
MISMATCH = "mismatch/seq_logratio_p90"  # the sequence-level mismatch a difference is read by
GAIN = "gain"  # the summary key `with_gain` adds: final - initial eval reward


def label(terms: int) -> str:
  """The cells' task label of a length: "chain<terms>"."""
  return f"chain{terms}"


def terms_of(task_label: str) -> int:
  return int(task_label.removeprefix("chain"))


def check_variants(names) -> list[str]:
  """`names` in `VARIANTS` order; a ValueError names any unknown one."""
  unknown = sorted(set(names) - set(VARIANTS))
  if unknown:
    raise ValueError(f"variants {unknown} are not allowed; use some of {list(VARIANTS)}")
  return [v for v in VARIANTS if v in names]


def plan(lengths, seeds, correction_seeds, variants) -> list[tuple[str, int, str]]:
  """The cells (label, seed, variant), seed by seed, so that every finished seed completes
  its pairs at every length before the next seed starts (a study cut short still pairs).
  The correction variants run on `correction_seeds` only (a subset of `seeds`)."""
  extra = sorted(set(correction_seeds) - set(seeds))
  if extra:
    raise ValueError(f"correction_seeds {extra} are not in seeds {list(seeds)}: none would pair")
  cells = []
  for seed in seeds:
    for terms in lengths:
      for variant in check_variants(variants):
        if variant in CORRECTION_VARIANTS and seed not in correction_seeds:
          continue
        cells.append((label(terms), seed, variant))
  return cells


def with_gain(cells) -> list[compare.Cell]:
  """The cells with `GAIN` (final - initial eval reward; None where either is missing)."""
  out = []
  for c in cells:
    final, initial = c.value(), c.value("initial_eval_reward")
    gain = None if final is None or initial is None else final - initial
    out.append(dataclasses.replace(c, summary={**c.summary, GAIN: gain}))
  return out


def mean_precursor(cell: compare.Cell, key: str, part: slice = slice(None)) -> float | None:
  """The mean of a precursor's curve over `part` of its steps (None: not logged)."""
  curve = (cell.summary.get("precursors") or {}).get(key)
  values = [v for v in (curve[1][part] if curve else []) if v is not None]
  finite = [v for v in values if math.isfinite(v)]
  return float(np.mean(finite)) if finite else None


@dataclasses.dataclass(frozen=True)
class Difference:
  """One paired gain difference at one length."""

  length: str
  arm: str
  baseline: str
  gain: compare.Interval  # arm - baseline, on the seeds both ran
  qat_seq_logratio_p90: float | None  # fp4-qat's sequence-level mismatch at this length

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), "terms": terms_of(self.length)}


def differences(cells) -> list[Difference]:
  """`COMPARISONS` at every length the cells hold (those with no paired seed left out)."""
  cells = with_gain(cells)
  out = []
  for length in sorted({c.task for c in cells}, key=terms_of):
    qat = [mean_precursor(c, MISMATCH) for c in cells if c.task == length and c.arm == "fp4-qat"]
    qat = [v for v in qat if v is not None]
    for arm, baseline in COMPARISONS:
      gain = compare.paired_difference(cells, length, arm, baseline, metric=GAIN)
      if gain.n:
        mismatch = float(np.mean(qat)) if qat else None
        out.append(Difference(length, arm, baseline, gain, mismatch))
  return out


def collapses(cells) -> list[dict]:
  """The cells whose final eval fell more than `COLLAPSE_DROP` below their initial eval,
  each with its precursors' means over the first and the last tenth of its steps."""
  out = []
  for c in with_gain(cells):
    gain = c.value(GAIN)
    if gain is None or gain >= -COLLAPSE_DROP:
      continue
    steps = len(((c.summary.get("precursors") or {}).get("grad_norm") or [[]])[0])
    tenth = max(steps // 10, 1)
    out.append(
      {
        "length": c.task,
        "arm": c.arm,
        "seed": c.seed,
        "gain": gain,
        "first_tenth": {k: mean_precursor(c, k, slice(0, tenth)) for k in PRECURSORS},
        "last_tenth": {k: mean_precursor(c, k, slice(-tenth, None)) for k in PRECURSORS},
      }
    )
  return out


def markdown(cells) -> str:
  """The arms per length (`compare.markdown`), the paired gain differences and collapses."""
  rows = [
    (
      terms_of(d.length),
      f"{d.arm} - {d.baseline}",
      d.gain.n,
      d.gain.format(signed=True),
      "-" if d.qat_seq_logratio_p90 is None else f"{d.qat_seq_logratio_p90:.3f}",
    )
    for d in differences(cells)
  ]
  parts = [
    compare.markdown(cells),
    "## Paired gain differences (final - initial eval, arm - baseline, 95% CI over seeds)",
    markdown_table(
      ["terms", "difference", "seeds", "gain difference", "fp4-qat seq. log-ratio p90"], rows
    ),
  ]
  fallen = collapses(cells)
  if fallen:
    lines = [
      f"- {f['arm']} at {f['length']}, seed {f['seed']}: gain {f['gain']:+.3f}" for f in fallen
    ]
    parts += ["## Collapses (final eval more than 0.1 below the initial)", "\n".join(lines)]
  else:
    parts.append(f"No cell collapsed (no final eval more than {COLLAPSE_DROP} below its initial).")
  return "\n\n".join(parts)


def write_results(results_dir: str, cells, settings: dict, title: str) -> None:
  """results.json (`settings`, `cells`, `rows`, `differences`, `collapses`), table.md and
  the comparison's plots in `results_dir`."""
  compare.write_results(results_dir, cells, settings, title)  # plots, cells and rows
  saved = compare.load_results(results_dir).to_json()
  saved["differences"] = [d.to_json() for d in differences(cells)]
  saved["collapses"] = collapses(cells)
  write_json(os.path.join(results_dir, "results.json"), compare.jsonish(saved))
  with open(os.path.join(results_dir, "table.md"), "w") as f:
    f.write(f"# {title}\n\n{markdown(cells)}\n")
