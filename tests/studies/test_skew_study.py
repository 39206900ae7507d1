"""The skew study's aggregates against hand computations on random cells."""

import json
import math
import os

import numpy as np
import pytest
from scipy import stats

from trace_jax.rl.config import RLConfig
from trace_jax.studies import compare, skew

ARMS = ("bf16", "fp4-qat", "trace")
SEEDS = (0, 1, 2)
POINTS = (
  skew.Point("auto", 0.0),
  skew.Point("auto", 2.0**-6),
  skew.Point("auto", 0.25),
  skew.Point("tis", 0.25),
)


def _cell(rng, arm, seed, point, initial, **config):
  flat = dict(arm=arm, seed=seed, rollout_skew=point.skew, correction=point.correction, **config)
  summary = {
    "config": RLConfig.from_flat(**flat).to_dict(),
    "initial_eval_reward": initial,
    "final_eval_reward": float(initial + rng.normal(0.3, 0.1)),
    "mean_k3_kl": float(10.0 ** rng.uniform(-6, -2)),
    "mean_train_reward": float(rng.uniform(0.3, 0.9)),
    "wall_seconds": float(rng.uniform(100, 300)),
  }
  return compare.Cell(arm=arm, task="chain_flawed", seed=seed, summary=summary)


def _grid(rng):
  initial = {s: float(rng.uniform(0.3, 0.6)) for s in SEEDS}  # one warm start per seed
  return {p: [_cell(rng, a, s, p, initial[s]) for s in SEEDS for a in ARMS] for p in POINTS}


def _t_interval(x):
  x = np.asarray(x, np.float64)
  half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
  return x.mean(), x.mean() - half, x.mean() + half


def _close(interval, x):
  np.testing.assert_allclose((interval.mean, interval.lo, interval.hi), _t_interval(x), rtol=1e-12)


def test_rows_match_a_hand_computation():
  rng = np.random.default_rng()
  grid = _grid(rng)
  table = {(r.arm, r.correction, r.rollout_skew): r for r in skew.rows(grid)}
  order = sorted(POINTS, key=lambda p: (p.correction != "auto", p.skew))
  assert list(table) == [(a, p.correction, p.skew) for a in ARMS for p in order]
  get = lambda p, arm, key: [c.summary[key] for c in grid[p] if c.arm == arm]  # noqa: E731
  base = POINTS[0]
  for arm in ARMS:
    for p in POINTS:
      row = table[(arm, p.correction, p.skew)]
      assert row.seeds == len(SEEDS)
      final = get(p, arm, "final_eval_reward")
      _close(row.gain, np.subtract(final, get(p, arm, "initial_eval_reward")))
      _close(row.train_reward, get(p, arm, "mean_train_reward"))
      k3 = get(p, arm, "mean_k3_kl")
      np.testing.assert_allclose(row.k3, np.prod(k3) ** (1 / len(k3)), rtol=1e-9)
      assert row.seconds == pytest.approx(np.mean(get(p, arm, "wall_seconds")))
      if p == base:
        assert row.vs_unskewed is None
      else:
        _close(row.vs_unskewed, np.subtract(final, get(base, arm, "final_eval_reward")))
      if arm == "fp4-qat":
        assert row.vs_fp4_qat is None
      else:
        _close(row.vs_fp4_qat, np.subtract(final, get(p, "fp4-qat", "final_eval_reward")))


def test_unmatched_cells_are_refused_naming_the_difference():
  rng = np.random.default_rng()
  grid = _grid(rng)
  start = grid[POINTS[2]][2].summary["initial_eval_reward"]
  grid[POINTS[2]][2] = _cell(rng, "trace", 0, POINTS[2], start, learning_rate=1e-4)
  with pytest.raises(ValueError, match=r"trace seed 0.*2\^-2.*\['learning_rate'\]"):
    skew.rows(grid)
  grid = _grid(rng)
  grid[POINTS[1]][0] = _cell(rng, "bf16", 0, POINTS[1], 0.123)  # another warm start
  with pytest.raises(ValueError, match=r"bf16 seed 0.*initial eval 0.123.*cannot be paired"):
    skew.rows(grid)
  grid = _grid(rng)
  grid[POINTS[1]] = grid[POINTS[2]]  # cells that ran at 2^-2 listed at 2^-6
  with pytest.raises(
    ValueError, match=r"listed at rollout_skew=0.015625.*ran at rollout_skew=0.25"
  ):
    skew.rows(grid)


def test_write_results_writes_the_table_the_json_and_the_plots(tmp_path):
  rng = np.random.default_rng()
  grid = _grid(rng)
  out = str(tmp_path / "skew")
  table = skew.write_results(out, grid, {"seeds": list(SEEDS)}, "a study")
  saved = json.loads(open(os.path.join(out, "results.json")).read())
  assert [(c["rollout_skew"], c["correction"]) for c in saved["cells"]] == [
    (p.skew, p.correction) for p in sorted(POINTS) for _ in SEEDS for _ in ARMS
  ]
  assert [(r["arm"], r["rollout_skew"], r["correction"]) for r in saved["rows"]] == [
    (r.arm, r.rollout_skew, r.correction) for r in table
  ]
  text = open(os.path.join(out, "table.md")).read()
  assert text.startswith("# a study") and "| trace | 2^-6 | auto |" in text
  assert text.count("\n| fp4-qat |") == len(POINTS) and "| 2^-2 | tis |" in text
  for name in ("gain_vs_skew.png", "k3_vs_skew.png", "trace_vs_fp4qat.png"):
    assert os.path.getsize(os.path.join(out, name)) > 0
  settings, loaded = skew.load_results(out)
  assert settings == {"seeds": list(SEEDS)}
  assert loaded == {
    p: [compare.Cell(**json.loads(json.dumps(c.to_json()))) for c in grid[p]]
    for p in sorted(POINTS)
  }
  assert skew.markdown(loaded) == skew.markdown(grid)
  grid[POINTS[1]][0] = _cell(rng, "bf16", 0, POINTS[1], 0.5, group_size=4)
  with pytest.raises(ValueError):  # unmatched: nothing (re)written
    skew.write_results(str(tmp_path / "other"), grid, {})
  assert not os.path.exists(tmp_path / "other")


def test_skew_labels_and_points():
  assert [skew.skew_label(s) for s in (0.0, 2.0**-9, 0.25, 0.3)] == ["0", "2^-9", "2^-2", "0.3"]
  assert skew.Point("auto", 0.25).label == "2^-2"
  assert skew.Point("tis", 0.25).label == "2^-2, tis"
  rng = np.random.default_rng()
  cell = _cell(rng, "trace", 1, skew.Point("tis", 0.0625), 0.4)
  assert skew.point_of(cell) == skew.Point("tis", 0.0625)


@pytest.mark.parametrize("arm", skew.STUDY_ARMS)
def test_the_study_arms_run_without_a_correction_by_default(arm):
  """Why the study's correction variant is TIS: "correction off" is these arms' own loss."""
  assert RLConfig(arm=arm).loss_config == RLConfig(arm=arm, correction="none").loss_config
  assert RLConfig(arm=arm, correction="tis").loss_config.rollout_correction == "tis"
