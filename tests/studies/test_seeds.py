"""The main job's seeds study on synthetic cells: each seed's rise against its placebo, the
target, and the files it writes."""

import json
import os

import numpy as np
import pytest

from trace_jax.studies import compare, seeds


def _cell(arm, seed, curve, wall):
  steps = list(range(0, 20 * len(curve), 20))
  return compare.Cell(
    arm=arm,
    task="chain",
    seed=seed,
    summary={
      "initial_eval_reward": curve[0],
      "final_eval_reward": curve[-1],
      "wall_seconds": wall,
      "curve_eval": [steps, list(curve)],
    },
  )


def test_rows_against_a_hand_computation(tmp_path):
  rng = np.random.default_rng()
  cells, expected = [], {}
  for seed in (0, 1, 2):
    start = float(rng.uniform(0.2, 0.6))
    real = [start, *rng.uniform(0.2, 0.9, size=5).tolist()]
    placebo = [start, *rng.uniform(0.1, 0.6, size=5).tolist()]
    wall = float(rng.uniform(300, 900))
    cells += [_cell("placebo", seed, placebo, wall / 2), _cell("real", seed, real, wall)]
    met = real[-1] - start >= 0.15 and real[-1] - placebo[-1] >= 0.15 and wall <= 600
    expected[seed] = (real[-1] - start, real[-1] - placebo[-1], max(real[1:]), met)
  cells.append(_cell("real", 3, [0.1, 0.9], 100.0))  # no placebo: no row
  rows = seeds.seed_rows(cells)
  assert [r.seed for r in rows] == [0, 1, 2]
  for r in rows:
    gain, gap, best, met = expected[r.seed]
    assert r.gain == pytest.approx(gain) and r.above_placebo == pytest.approx(gap)
    assert r.best == pytest.approx(best) and r.meets_target == met

  out = tmp_path / "main_job"
  seeds.write_results(str(out), cells, {"seeds": [0, 1, 2, 3]}, "t")
  saved = json.loads((out / "results.json").read_text())
  assert len(saved["cells"]) == 7 and [r["seed"] for r in saved["rows"]] == [0, 1, 2]
  assert [r["meets_target"] for r in saved["rows"]] == [expected[s][3] for s in (0, 1, 2)]
  gains = compare.interval(expected[s][0] for s in (0, 1, 2))
  assert f"gain {gains.format(signed=True)}" in (out / "table.md").read_text()
  assert os.path.getsize(out / "curves.png") > 0


@pytest.mark.parametrize(
  "final, placebo, wall, met",
  [
    (0.55, 0.35, 500.0, True),  # +0.15 exactly over the start and 0.2 over the placebo
    (0.54, 0.30, 500.0, False),  # rose 0.14
    (0.60, 0.46, 500.0, False),  # 0.14 above its placebo
    (0.60, 0.30, 601.0, False),  # too slow
  ],
)
def test_the_target_needs_the_rise_the_gap_and_the_time(final, placebo, wall, met):
  cells = [_cell("real", 0, [0.40, final], wall), _cell("placebo", 0, [0.40, placebo], wall)]
  (row,) = seeds.seed_rows(cells)
  assert row.meets_target == met
