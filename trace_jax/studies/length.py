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
  with its collapse precursors (`PRECURSORS`) over its first and last tenth of steps;
- with the mismatch map's points (`studies.mismatch_map`), an extrapolation to the paper's
  setting (`extrapolate`): each path's sequence-level mismatch per answer token and its
  growth with depth, measured on the map, and the gain difference per nat of fp4-qat's
  mismatch, measured across the lengths here, each carried to longer answers under the
  assumptions it states.
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
# The paper's gap: TRACE 75.3 against plain FP4 QAT 59.6 (accuracy, as a fraction)
PAPER_GAP = 0.157
EXTRAPOLATE_TOKENS = (1024, 4096, 16384)  # answer lengths of the paper's setting
ASSUMPTIONS = (
  "a path's sequence-level log-ratio p90 grows in proportion to the answer's tokens (a line "
  "through 0, fitted on the map's points with its default engine at its shallowest depth)",
  "depth multiplies it by the factor the map measured between its shallowest and deepest "
  "models at one answer length, and by no more beyond that depth",
  "the gain difference trace - fp4-qat is linear in fp4-qat's sequence-level mismatch (a "
  "line through the lengths' mean differences), and a longer answer changes nothing else",
)


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


def _default_engine(points) -> list[dict]:
  """The map's points with its default engine: no skew, the router in float32."""
  return [p for p in points if p["rollout_skew"] == 0 and p["router_dtype"] == "float32"]


def per_token_mismatch(points) -> dict[str, float]:
  """path -> sequence-level log-ratio p90 per answer token: the least-squares line through
  0 over the map's default-engine points at their shallowest depth, sum(x y) / sum(x^2)
  with x the answer tokens and y the p90."""
  points = _default_engine(points)
  shallow = [p for p in points if p["layers"] == min(q["layers"] for q in points)]
  x = np.array([p["answer_tokens"] for p in shallow], float)
  out = {}
  for path in shallow[0]["paths"]:
    y = np.array([p["paths"][path]["seq_logratio_p90"] for p in shallow], float)
    out[path] = float(np.dot(x, y) / np.dot(x, x))
  return out


def depth_factor(points) -> tuple[tuple[int, int], dict[str, float]] | None:
  """((shallowest, deepest) layers, path -> p90 at the deepest / at the shallowest) at the
  answer length the map varied depth at (default engine); None without such a length. A
  shallowest p90 of 0 gives NaN (no factor can be read), never a division error."""
  points = _default_engine(points)
  by_terms: dict[int, dict[int, dict]] = {}
  for p in points:
    by_terms.setdefault(p["terms"], {})[p["layers"]] = p
  terms = max(by_terms, key=lambda t: len(by_terms[t]))
  depths = by_terms[terms]
  if len(depths) < 2:
    return None
  lo, hi = depths[min(depths)], depths[max(depths)]
  p90 = lambda point, path: point["paths"][path]["seq_logratio_p90"]  # noqa: E731
  ratio = {
    path: p90(hi, path) / p90(lo, path) if p90(lo, path) else math.nan for path in lo["paths"]
  }
  return (min(depths), max(depths)), ratio


@dataclasses.dataclass(frozen=True)
class Extrapolation:
  """The study's numbers carried to the paper's setting, under `assumptions`."""

  per_token: dict[str, float]  # path -> seq. log-ratio p90 per answer token (the map)
  depths: tuple[int, int] | None  # the map's shallowest and deepest models
  depth_factor: dict[str, float] | None  # path -> p90 deepest / shallowest (the map)
  at_tokens: dict[str, dict[int, float]]  # path -> {answer tokens: p90, depth included}
  gain_per_nat: float | None  # trace - fp4-qat gain difference per nat of fp4-qat's p90
  gain_at_zero: float | None  # that line at no mismatch
  paper_gap_nats: float | None  # fp4-qat's p90 at which the line reaches PAPER_GAP
  paper_gap_tokens: float | None  # the answer length that gives it (deepest model)
  assumptions: tuple[str, ...] = ASSUMPTIONS

  def to_json(self) -> dict:
    out = dataclasses.asdict(self)
    out["at_tokens"] = {p: {str(t): v for t, v in by.items()} for p, by in self.at_tokens.items()}
    return out


def extrapolate(points, diffs) -> Extrapolation:
  """The map's `points` (results.json's list) and the study's `differences`, carried to
  `EXTRAPOLATE_TOKENS` answer tokens and to the gap the paper reports (`PAPER_GAP`)."""
  per_token = per_token_mismatch(points)
  depth = depth_factor(points)
  depths, factor = depth if depth else (None, None)
  scale = lambda path: factor[path] if factor else 1.0  # noqa: E731
  at_tokens = {
    path: {t: slope * t * scale(path) for t in EXTRAPOLATE_TOKENS}
    for path, slope in per_token.items()
  }
  line = [
    (d.qat_seq_logratio_p90, d.gain.mean)
    for d in diffs
    if (d.arm, d.baseline) == ("trace", "fp4-qat") and d.qat_seq_logratio_p90 is not None
  ]
  per_nat = at_zero = nats = tokens = None
  if len({x for x, _ in line}) >= 2:
    per_nat, at_zero = (float(v) for v in np.polyfit(*np.array(line).T, 1))
    if per_nat > 0:
      nats = (PAPER_GAP - at_zero) / per_nat
      tokens = nats / (per_token["fp4-qat"] * scale("fp4-qat"))
  return Extrapolation(per_token, depths, factor, at_tokens, per_nat, at_zero, nats, tokens)


def extrapolation_markdown(ex: Extrapolation) -> str:
  """The extrapolation as a table of predicted mismatch and the paper-gap reading."""
  paths = list(ex.per_token)
  rows = [
    (
      path,
      f"{ex.per_token[path]:.4f}",
      "-" if ex.depth_factor is None else f"{ex.depth_factor[path]:.2f}",
      *(f"{ex.at_tokens[path][t]:.1f}" for t in EXTRAPOLATE_TOKENS),
    )
    for path in paths
  ]
  depth = "-" if ex.depths is None else f"{ex.depths[0]} -> {ex.depths[1]} layers"
  head = ["path", "p90 per token", f"depth factor ({depth})"]
  head += [f"p90 at {t} tokens" for t in EXTRAPOLATE_TOKENS]
  lines = [
    "## Extrapolation (sequence-level log-ratio p90; assumptions below)",
    markdown_table(head, rows),
  ]
  if ex.gain_per_nat is None:
    lines.append("The gain difference needs two lengths with fp4-qat's mismatch for a slope.")
  else:
    said = (
      f"trace - fp4-qat gains {ex.gain_per_nat:+.4f} per nat of fp4-qat's p90 "
      f"({ex.gain_at_zero:+.3f} at none)"
    )
    if ex.paper_gap_nats is not None:
      said += (
        f"; at that slope the paper's gap ({PAPER_GAP:.3f}) comes at "
        f"{ex.paper_gap_nats:.1f} nats, about {ex.paper_gap_tokens:.0f} answer tokens"
      )
    lines.append(said + ".")
  lines.append("Assumptions:\n" + "\n".join(f"- {a}" for a in ex.assumptions))
  return "\n\n".join(lines)


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


def markdown(cells, map_points=None) -> str:
  """The arms per length (`compare.markdown`), the paired gain differences, collapses and,
  with the mismatch map's points, the extrapolation."""
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
  if map_points:
    parts.append(extrapolation_markdown(extrapolate(map_points, differences(cells))))
  return "\n\n".join(parts)


def write_results(results_dir: str, cells, settings: dict, title: str, map_points=None) -> None:
  """results.json (`settings`, `cells`, `rows`, `differences`, `collapses` and, with the
  mismatch map's points, `extrapolation`), table.md and the comparison's plots in
  `results_dir`."""
  compare.write_results(results_dir, cells, settings, title)  # plots, cells and rows
  saved = compare.load_results(results_dir).to_json()
  saved["differences"] = [d.to_json() for d in differences(cells)]
  saved["collapses"] = collapses(cells)
  if map_points:
    saved["extrapolation"] = extrapolate(map_points, differences(cells)).to_json()
  write_json(os.path.join(results_dir, "results.json"), compare.jsonish(saved))
  with open(os.path.join(results_dir, "table.md"), "w") as f:
    f.write(f"# {title}\n\n{markdown(cells, map_points)}\n")
