"""studies.length: the plan's cells, paired gain differences and collapses against loops
over fresh random cells, the results files, and the script's refusals."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from tests.scripts import refusal
from trace_jax.studies import compare, length

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "length_arms.py")


def test_the_plan_runs_seed_by_seed_with_the_corrections_on_their_seeds():
  cells = length.plan([4, 16], [0, 1, 2], [0, 2], list(length.VARIANTS))
  seeds = [seed for _, seed, _ in cells]
  assert seeds == sorted(seeds)  # every cell of a seed before the next seed's
  for seed in (0, 1, 2):
    for terms in (4, 16):
      variants = [v for t, s, v in cells if (t, s) == (length.label(terms), seed)]
      expected = [v for v in length.VARIANTS if seed != 1 or v not in length.CORRECTION_VARIANTS]
      assert variants == expected
  assert len(cells) == 2 * (3 * 5 + 2 * 2)


def test_the_plan_refuses_unknown_variants_and_unpaired_correction_seeds():
  with pytest.raises(ValueError, match=r"variants \['fp4-qat\+mask'\] are not allowed"):
    length.plan([4], [0], [0], ["trace", "fp4-qat+mask"])
  with pytest.raises(ValueError, match=r"correction_seeds \[7\] are not in seeds \[0, 1\]"):
    length.plan([4], [0, 1], [0, 7], ["trace"])


def _cells(rng, lengths=(4, 16), seeds=(0, 1, 2, 3), steps=20):
  cells = []
  for terms in lengths:
    for seed in seeds:
      initial = {"bf16": rng.uniform(0.4, 0.6), "fp4": rng.uniform(0.4, 0.6)}
      for variant in length.VARIANTS:
        if variant in length.CORRECTION_VARIANTS and seed == seeds[-1]:
          continue  # one seed fewer: the pairing drops it
        deploy = "bf16" if variant == "bf16" else "fp4"
        curves = {
          key: [list(range(1, steps + 1)), rng.uniform(0, 1, steps).tolist()]
          for key in length.PRECURSORS
        }
        summary = {
          "initial_eval_reward": initial[deploy],
          "final_eval_reward": initial[deploy] + rng.uniform(-0.3, 0.3),
          "eval_precision": deploy,
          "precursors": curves,
          "mean_train_reward": 0.5,
          "mean_k3_kl": 1e-3,
          "wall_seconds": 10.0,
        }
        cells.append(compare.Cell(variant, length.label(terms), seed, summary))
  return cells


def _gain(cell):
  return cell.summary["final_eval_reward"] - cell.summary["initial_eval_reward"]


def test_paired_gain_differences_against_a_loop_and_the_t_interval():
  rng = np.random.default_rng()
  cells = _cells(rng)
  found = {(d.length, d.arm, d.baseline): d for d in length.differences(cells)}
  assert len(found) == 2 * len(length.COMPARISONS)
  for terms in (4, 16):
    label = length.label(terms)
    mine = lambda arm, seed: next(  # noqa: E731
      c for c in cells if (c.task, c.arm, c.seed) == (label, arm, seed)
    )
    for arm, baseline in length.COMPARISONS:
      seeds = sorted(
        {c.seed for c in cells if c.task == label and c.arm == arm}
        & {c.seed for c in cells if c.task == label and c.arm == baseline}
      )
      diffs = np.array([_gain(mine(arm, s)) - _gain(mine(baseline, s)) for s in seeds])
      got = found[(label, arm, baseline)]
      assert got.gain.n == len(seeds) == (3 if "+" in baseline else 4)
      assert got.gain.mean == pytest.approx(diffs.mean())
      lo, hi = stats.t.interval(0.95, len(diffs) - 1, diffs.mean(), stats.sem(diffs))
      assert (got.gain.lo, got.gain.hi) == (pytest.approx(lo), pytest.approx(hi))
      qat = [
        np.mean(c.summary["precursors"][length.MISMATCH][1])
        for c in cells
        if c.task == label and c.arm == "fp4-qat"
      ]
      assert got.qat_seq_logratio_p90 == pytest.approx(np.mean(qat))


def test_a_collapse_is_a_fall_below_the_initial_eval_with_its_precursors():
  rng = np.random.default_rng()
  cells = _cells(rng, lengths=(4,), seeds=(0, 1))
  assert all(
    c["gain"] < -length.COLLAPSE_DROP for c in length.collapses(cells)
  )  # (random gains may fall that far)
  fallen = cells[3]
  fallen.summary["final_eval_reward"] = fallen.summary["initial_eval_reward"] - 0.25
  kept = cells[4]
  kept.summary["final_eval_reward"] = kept.summary["initial_eval_reward"] - 0.05
  found = {(c["arm"], c["seed"]): c for c in length.collapses(cells)}
  assert (kept.arm, kept.seed) not in found
  row = found[(fallen.arm, fallen.seed)]
  assert row["gain"] == pytest.approx(-0.25)
  for key in length.PRECURSORS:
    values = fallen.summary["precursors"][key][1]  # 20 steps: a tenth is 2
    assert row["first_tenth"][key] == pytest.approx(np.mean(values[:2]))
    assert row["last_tenth"][key] == pytest.approx(np.mean(values[-2:]))


def test_the_results_hold_the_differences_and_the_table_says_them(tmp_path):
  cells = _cells(np.random.default_rng())
  length.write_results(str(tmp_path), cells, {"terms": [4, 16]}, "length: test")
  saved = json.loads((tmp_path / "results.json").read_text())
  assert len(saved["cells"]) == len(cells) and saved["settings"] == {"terms": [4, 16]}
  assert {(d["terms"], d["arm"], d["baseline"]) for d in saved["differences"]} == {
    (t, a, b) for t in (4, 16) for a, b in length.COMPARISONS
  }
  table = (tmp_path / "table.md").read_text()
  assert "## Paired gain differences" in table and "trace - fp4-qat-r3" in table
  assert (tmp_path / "final_reward.png").exists()


PATHS = ("fp4-qat", "fp4-qat-r3", "trace", "trace-full")


def _map_points(rng):
  """A map like the committed one: the default engine at 4 layers over four lengths, depth
  varied at 8 terms, and other engines (skew, router dtype) that the fits must skip."""
  points = []

  def point(terms, layers, skew=0.0, router="float32"):
    metrics = {p: {"seq_logratio_p90": float(rng.uniform(0.01, 20))} for p in PATHS}
    points.append(
      {
        "terms": terms,
        "layers": layers,
        "rollout_skew": skew,
        "router_dtype": router,
        "answer_tokens": float(terms * rng.uniform(5, 8)),
        "paths": metrics,
      }
    )

  for terms in (4, 8, 16, 32):
    point(terms, 4)
    point(terms, 4, skew=0.0625)
    point(terms, 4, router="compute")
  for layers in (8, 16):
    point(8, layers)
    point(8, layers, skew=0.0625)
  return points


def test_the_extrapolation_against_a_hand_fit():
  """Per-token growth is the least-squares line through 0 over the default engine's points
  at the shallowest depth; depth the deepest over the shallowest p90 at 8 terms; the gain
  line goes through the two lengths' mean differences."""
  rng = np.random.default_rng()
  points = _map_points(rng)
  default = [p for p in points if p["rollout_skew"] == 0 and p["router_dtype"] == "float32"]
  shallow = [p for p in default if p["layers"] == 4]
  deep = {p["layers"]: p for p in default if p["terms"] == 8}
  cells = _cells(rng)
  diffs = length.differences(cells)
  ex = length.extrapolate(points, diffs)
  assert ex.depths == (4, 16)
  for path in PATHS:
    xy = sum(p["answer_tokens"] * p["paths"][path]["seq_logratio_p90"] for p in shallow)
    xx = sum(p["answer_tokens"] ** 2 for p in shallow)
    assert ex.per_token[path] == pytest.approx(xy / xx)
    factor = (
      deep[16]["paths"][path]["seq_logratio_p90"] / deep[4]["paths"][path]["seq_logratio_p90"]
    )
    assert ex.depth_factor[path] == pytest.approx(factor)
    for tokens in length.EXTRAPOLATE_TOKENS:
      assert ex.at_tokens[path][tokens] == pytest.approx(xy / xx * tokens * factor)
  (x0, y0), (x1, y1) = [
    (d.qat_seq_logratio_p90, d.gain.mean)
    for d in diffs
    if (d.arm, d.baseline) == ("trace", "fp4-qat")
  ]
  slope = (y1 - y0) / (x1 - x0)
  assert ex.gain_per_nat == pytest.approx(slope)
  assert ex.gain_at_zero == pytest.approx(y0 - slope * x0)
  if slope > 0:
    nats = (length.PAPER_GAP - (y0 - slope * x0)) / slope
    assert ex.paper_gap_nats == pytest.approx(nats)
    per_token = ex.per_token["fp4-qat"] * ex.depth_factor["fp4-qat"]
    assert ex.paper_gap_tokens == pytest.approx(nats / per_token)
  else:
    assert ex.paper_gap_nats is None and ex.paper_gap_tokens is None
  one_length = [d for d in diffs if d.length == length.label(4)]
  assert length.extrapolate(points, one_length).gain_per_nat is None
  deep[4]["paths"]["trace-full"]["seq_logratio_p90"] = 0.0  # no factor can be read
  factor = length.extrapolate(points, diffs).depth_factor
  assert np.isnan(factor["trace-full"]) and np.isfinite(factor["trace"])


def test_the_results_hold_the_extrapolation_with_the_map(tmp_path):
  rng = np.random.default_rng()
  points, cells = _map_points(rng), _cells(rng)
  length.write_results(str(tmp_path), cells, {}, "length: test", map_points=points)
  saved = json.loads((tmp_path / "results.json").read_text())
  ex = saved["extrapolation"]
  assert set(ex["at_tokens"]["trace"]) == {str(t) for t in length.EXTRAPOLATE_TOKENS}
  assert ex["assumptions"] == list(length.ASSUMPTIONS)
  assert "## Extrapolation" in (tmp_path / "table.md").read_text()


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--variants=trace,fp4-qat+mask", "fp4-qat+mask"),
    ("--correction_seeds=9", "correction_seeds [9]"),
    ("--terms=four", "--terms"),
    ("--map_results=/nonexistent/results.json", "--map_results='/nonexistent/results.json'"),
  ],
)
def test_the_script_refuses_bad_flags_before_any_work(tmp_path, flag, message):
  said = refusal("length_arms", flag, f"--workdir={tmp_path}/w", f"--results={tmp_path}/r")
  assert message in said, said
  assert not os.path.exists(tmp_path / "w") and not os.path.exists(tmp_path / "r")


@pytest.mark.slow
def test_the_script_end_to_end_on_tiny_and_resumed(tmp_path):
  """Two lengths, one seed, fp4-qat and trace plus the TIS variant: every cell, the paired
  differences at both lengths, and a rerun that keeps every finished cell."""
  args = ["--preset=tiny", "--terms=2,3", "--seeds=0", "--correction_seeds=0"]
  args += ["--variants=fp4-qat,trace,fp4-qat+tis", "--steps=2", "--sft_steps=2"]
  args += ["--eval_size=8", "--eval_every=2", f"--workdir={tmp_path}/w", f"--results={tmp_path}/r"]
  run = lambda: subprocess.run(  # noqa: E731
    [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=1200
  )
  result = run()
  assert result.returncode == 0, result.stderr[-3000:]
  saved = json.loads((tmp_path / "r" / "results.json").read_text())
  assert {(c["task"], c["arm"]) for c in saved["cells"]} == {
    (f"chain{t}", v) for t in (2, 3) for v in ("fp4-qat", "trace", "fp4-qat+tis")
  }
  for cell in saved["cells"]:
    summary = cell["summary"]
    assert summary["steps"] == 2 and summary["final_eval_reward"] is not None
    assert "mismatch/router_flip_rate" in summary["precursors"]
    correction = summary["config"]["correction"]
    assert correction == ("tis" if cell["arm"] == "fp4-qat+tis" else "auto")
  pairs = {(d["terms"], d["arm"], d["baseline"]) for d in saved["differences"]}
  assert pairs == {(t, "trace", b) for t in (2, 3) for b in ("fp4-qat", "fp4-qat+tis")}
  assert saved["settings"]["max_new_tokens"]["3"] > saved["settings"]["max_new_tokens"]["2"]
  again = run()
  assert again.returncode == 0 and again.stdout.count("finished before, kept") == 6
