"""The staleness study's aggregates against hand computations on random cells."""

import json
import math
import os

import numpy as np
import pytest
from scipy import stats

from trace_jax.rl.config import RLConfig
from trace_jax.studies import compare, staleness

ARMS = ("fp4-qat", "trace")
SEEDS = (0, 1, 2, 3)
KS = (0, 1, 3)


def _cell(rng, arm, seed, k, initial, **config):
  summary = {
    "config": RLConfig.from_flat(
      arm=arm, seed=seed, max_staleness=k, version_diag_every=20 if k else 0, **config
    ).to_dict(),
    "initial_eval_reward": initial,
    "final_eval_reward": float(initial + rng.normal(0.1, 0.05)),
    "mean_k3_kl": float(10.0 ** rng.uniform(-5, -2)),
    "mean_train_reward": float(rng.uniform(0.3, 0.9)),
    "curve_eval": [[0, 20, 40], [initial, *rng.uniform(0.2, 0.9, 2).tolist()]],
    "wall_seconds": float(rng.uniform(400, 600)),
  }
  if k:
    gaps = range(k + 1)
    summary.update(
      mean_precision_k3=float(10.0 ** rng.uniform(-5, -3)),
      mean_version_k3=float(10.0 ** rng.uniform(-5, -1)),
      mean_masked_frac=float(rng.uniform(0, 1e-3)),
      max_version_gap=k,
      followed_frac_by_gap={str(g): float(rng.uniform(0.99, 1.0)) for g in gaps},
    )
  return compare.Cell(arm=arm, task="chain", seed=seed, summary=summary)


def _grid(rng):
  initial = {s: float(rng.uniform(0.4, 0.8)) for s in SEEDS}  # one warm start per seed
  return {k: [_cell(rng, a, s, k, initial[s]) for s in SEEDS for a in ARMS] for k in KS}


def _t_interval(x):
  x = np.asarray(x, np.float64)
  half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
  return x.mean(), x.mean() - half, x.mean() + half


def test_rows_match_a_hand_computation():
  rng = np.random.default_rng()
  grid = _grid(rng)
  table = {(r.arm, r.staleness): r for r in staleness.rows(grid)}
  assert list(table) == [(a, k) for a in ARMS for k in KS]
  get = lambda k, arm, key: [c.summary.get(key) for c in grid[k] if c.arm == arm]  # noqa: E731
  for arm in ARMS:
    for k in KS:
      row = table[(arm, k)]
      gains = np.subtract(get(k, arm, "final_eval_reward"), get(k, arm, "initial_eval_reward"))
      np.testing.assert_allclose(
        (row.gain.mean, row.gain.lo, row.gain.hi), _t_interval(gains), rtol=1e-12
      )
      train = get(k, arm, "mean_train_reward")
      np.testing.assert_allclose(
        (row.train_reward.mean, row.train_reward.lo, row.train_reward.hi),
        _t_interval(train),
        rtol=1e-12,
      )
      lowest = [min(curve[1]) for curve in get(k, arm, "curve_eval")]
      assert row.lowest_eval == pytest.approx(np.mean(lowest))
      run = [  # the curve's points after step 0 (steps 20 and 40), less the initial eval
        np.mean(curve[1][1:]) - initial
        for curve, initial in zip(get(k, arm, "curve_eval"), get(k, arm, "initial_eval_reward"))
      ]
      np.testing.assert_allclose(
        (row.run_gain.mean, row.run_gain.lo, row.run_gain.hi), _t_interval(run), rtol=1e-12
      )
      total = get(k, arm, "mean_k3_kl")
      np.testing.assert_allclose(row.total_k3, np.prod(total) ** (1 / len(total)), rtol=1e-9)
      assert row.seeds == len(SEEDS)
      if k == 0:
        assert row.vs_sync is None and row.version_k3 is None
        assert row.precision_k3 == pytest.approx(row.total_k3)  # no version gap in sync
        assert row.max_version_gap == 0 and row.followed_by_gap == {}
        continue
      diffs = np.subtract(get(k, arm, "final_eval_reward"), get(0, arm, "final_eval_reward"))
      np.testing.assert_allclose(
        (row.vs_sync.mean, row.vs_sync.lo, row.vs_sync.hi), _t_interval(diffs), rtol=1e-12
      )
      run_diffs = [
        np.mean(a[1][1:]) - np.mean(b[1][1:])  # one warm start: the initial evals cancel
        for a, b in zip(get(k, arm, "curve_eval"), get(0, arm, "curve_eval"))
      ]
      np.testing.assert_allclose(
        (row.run_vs_sync.mean, row.run_vs_sync.lo, row.run_vs_sync.hi),
        _t_interval(run_diffs),
        rtol=1e-12,
      )
      version = get(k, arm, "mean_version_k3")
      np.testing.assert_allclose(row.version_k3, np.prod(version) ** (1 / len(version)), rtol=1e-9)
      assert row.masked_frac == pytest.approx(np.mean(get(k, arm, "mean_masked_frac")))
      assert row.max_version_gap == k
      shares = get(k, arm, "followed_frac_by_gap")
      assert list(row.followed_by_gap) == [str(g) for g in range(k + 1)]
      for gap, mean in row.followed_by_gap.items():
        assert mean == pytest.approx(np.mean([s[gap] for s in shares]))


def test_unmatched_cells_are_refused_naming_the_difference():
  rng = np.random.default_rng()
  grid = _grid(rng)
  grid[3][1] = _cell(rng, "trace", 0, 3, 0.5, temperature=0.5)
  with pytest.raises(ValueError, match=r"trace seed 0.*staleness 3.*temperature"):
    staleness.rows(grid)
  grid = _grid(rng)
  for cells in grid.values():  # every cell run with a level stop at 0.65
    for cell in cells:
      cell.summary["config"]["source"]["sft_target"] = 0.65
  source = grid[3][0].summary["config"]["source"]
  del source["sft_target"]  # a run saved before the field existed ran without a target (0)
  with pytest.raises(ValueError, match=r"fp4-qat seed 0.*\['sft_target'\]"):
    staleness.rows(grid)
  for cells in grid.values():  # every cell run without a target: the old run matches them
    for cell in cells:
      cell.summary["config"]["source"]["sft_target"] = 0.0
  del source["sft_target"]
  assert len(staleness.rows(grid)) == len(ARMS) * len(KS)
  source["sft_target"] = 0.5  # the same field at another value
  with pytest.raises(ValueError, match=r"fp4-qat seed 0.*\['sft_target'\]"):
    staleness.rows(grid)
  grid[1] = grid[3]  # cells that ran at k = 3 listed as k = 1
  with pytest.raises(ValueError, match="listed at staleness 1 but ran at max_staleness=3"):
    staleness.rows(grid)


def test_a_second_learning_rate_pairs_against_k_0_at_that_rate():
  rng = np.random.default_rng()
  rates = (8e-5, 4e-5)
  initial = {s: float(rng.uniform(0.4, 0.8)) for s in SEEDS}
  grid = {
    k: [
      _cell(rng, a, s, k, initial[s], learning_rate=lr) for lr in rates for s in SEEDS for a in ARMS
    ]
    for k in (0, 3)
  }
  table = staleness.rows(grid)
  keys = [(r.arm, r.learning_rate, r.staleness) for r in table]
  assert keys == [(a, lr, k) for a in ARMS for lr in rates for k in (0, 3)]
  final = {
    (c.arm, staleness.learning_rate_of(c), k, c.seed): c.summary["final_eval_reward"]
    for k, cells in grid.items()
    for c in cells
  }
  for r in table:
    if r.staleness == 0:
      continue
    diffs = [
      final[(r.arm, r.learning_rate, 3, s)] - final[(r.arm, r.learning_rate, 0, s)] for s in SEEDS
    ]
    np.testing.assert_allclose(
      (r.vs_sync.mean, r.vs_sync.lo, r.vs_sync.hi), _t_interval(diffs), rtol=1e-12
    )
  text = staleness.markdown(grid)
  assert text.count("| 4e-05 |") == len(ARMS) * 2 and text.count("| 8e-05 |") == len(ARMS) * 2

  # what the smaller rate removes of k = 3's cost: per seed, a difference of paired differences
  cells = {
    (c.arm, staleness.learning_rate_of(c), k, c.seed): c for k, cs in grid.items() for c in cs
  }
  run = lambda c: np.mean(c.summary["curve_eval"][1][1:]) - c.summary["initial_eval_reward"]  # noqa: E731
  effects = staleness.rate_effects(grid)
  assert [(e.arm, e.staleness, e.rate, e.top_rate) for e in effects] == [
    (a, 3, 4e-5, 8e-5) for a in ARMS
  ]
  for e in effects:
    for name, f in (("final", lambda c: c.summary["final_eval_reward"]), ("run", run)):
      x = {(lr, k, s): f(cells[(e.arm, lr, k, s)]) for lr in rates for k in (0, 3) for s in SEEDS}
      want = [
        (x[(4e-5, 3, s)] - x[(4e-5, 0, s)]) - (x[(8e-5, 3, s)] - x[(8e-5, 0, s)]) for s in SEEDS
      ]
      got = getattr(e, name)
      np.testing.assert_allclose((got.mean, got.lo, got.hi), _t_interval(want), rtol=1e-12)
      np.testing.assert_allclose(list(getattr(e, f"{name}_by_seed").values()), want, rtol=1e-12)
  assert staleness.rate_markdown(grid).count("| 4e-05 vs 8e-05 |") == len(ARMS)
  assert staleness.rate_effects(_grid(rng)) == [] and staleness.rate_markdown(_grid(rng)) == ""


def test_write_results_writes_the_table_the_json_and_the_plot(tmp_path):
  rng = np.random.default_rng()
  grid = _grid(rng)
  out = str(tmp_path / "study")
  table = staleness.write_results(out, grid, {"seeds": list(SEEDS)}, "a study")
  with open(os.path.join(out, "results.json")) as f:
    saved = json.load(f)
  assert [c["staleness"] for c in saved["cells"]] == [k for k in KS for _ in SEEDS for _ in ARMS]
  assert [(r["arm"], r["staleness"]) for r in saved["rows"]] == [
    (r.arm, r.staleness) for r in table
  ]
  text = open(os.path.join(out, "table.md")).read()
  assert text.startswith("# a study") and "0 (sync)" in text
  assert text.count("\n| fp4-qat |") == len(KS)
  assert os.path.getsize(os.path.join(out, "study.png")) > 0
  settings, loaded = staleness.load_results(out)
  assert settings == {"seeds": list(SEEDS)}
  assert loaded == {
    k: [compare.Cell(**json.loads(json.dumps(c.to_json()))) for c in grid[k]] for k in KS
  }
  assert staleness.markdown(loaded) == staleness.markdown(grid)
  grid[1][0] = _cell(rng, "fp4-qat", 0, 1, 0.5, group_size=4)
  with pytest.raises(ValueError):  # unmatched: nothing (re)written
    staleness.write_results(str(tmp_path / "other"), grid, {})
  assert not os.path.exists(tmp_path / "other")
