"""Aggregation of the arms comparison on synthetic cells: intervals, paired differences,
resumption, and the files it writes."""

import json
import math
import os

import numpy as np
import pytest

from trace_jax.studies import compare

T_975_DF2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom (tables)


def _cells(rng, arms=("bf16", "fp4-qat", "trace", "ptq"), seeds=(0, 1, 2), tasks=("arith",)):
  cells = []
  for task in tasks:
    for seed in seeds:
      for arm in arms:
        steps = list(range(1, 11))
        cells.append(
          compare.Cell(
            arm=arm,
            task=task,
            seed=seed,
            summary={
              "final_eval_reward": float(rng.uniform()),
              "initial_eval_reward": float(rng.uniform()),
              "mean_train_reward": float(rng.uniform()),
              "eval_precision": "fp4",
              "mean_k3_kl": None if arm == "ptq" else float(10 ** rng.uniform(-6, -2)),
              "wall_seconds": float(rng.uniform(10, 100)),
              "curve_train": [steps, rng.uniform(size=10).tolist()],
              "curve_eval": [[0, 5, 10], rng.uniform(size=3).tolist()],
            },
          )
        )
  return cells


def test_interval_by_hand():
  rng = np.random.default_rng(41)
  x = rng.uniform(size=3)
  mean = sum(x) / 3
  sd = math.sqrt(sum((v - mean) ** 2 for v in x) / 2)
  iv = compare.interval(x)
  assert iv.n == 3
  assert iv.mean == pytest.approx(mean)
  assert iv.hi - iv.mean == pytest.approx(T_975_DF2 * sd / math.sqrt(3))
  assert iv.mean - iv.lo == pytest.approx(T_975_DF2 * sd / math.sqrt(3))
  one = compare.interval([0.25])
  assert one.mean == 0.25 and math.isnan(one.lo) and math.isnan(one.hi)
  assert compare.interval([]).n == 0


def test_paired_differences_by_hand():
  rng = np.random.default_rng(42)
  cells = _cells(rng)
  value = {(c.arm, c.seed): c.summary["final_eval_reward"] for c in cells}
  for arm, base in (("trace", "bf16"), ("trace", "fp4-qat"), ("fp4-qat", "bf16")):
    diffs = [value[(arm, s)] - value[(base, s)] for s in range(3)]
    iv = compare.paired_difference(cells, "arith", arm, base)
    assert iv.mean == pytest.approx(np.mean(diffs))
    assert iv.hi - iv.mean == pytest.approx(T_975_DF2 * np.std(diffs, ddof=1) / math.sqrt(3))
  # A seed the baseline lacks is left out of the pairing.
  partial = [c for c in cells if not (c.arm == "bf16" and c.seed == 2)]
  iv = compare.paired_difference(partial, "arith", "trace", "bf16")
  assert iv.n == 2
  assert iv.mean == pytest.approx(
    np.mean([value[("trace", s)] - value[("bf16", s)] for s in (0, 1)])
  )


def test_table_rows_and_markdown():
  rng = np.random.default_rng(43)
  cells = _cells(rng, tasks=("arith", "search"))
  rows = compare.table_rows(cells)
  assert [(r.task, r.arm) for r in rows][:4] == [
    ("arith", "bf16"),
    ("arith", "fp4-qat"),
    ("arith", "trace"),
    ("arith", "ptq"),
  ]
  row = next(r for r in rows if r.task == "search" and r.arm == "trace")
  k3 = [c.summary["mean_k3_kl"] for c in cells if c.task == "search" and c.arm == "trace"]
  assert row.k3 == pytest.approx(math.exp(np.mean(np.log(k3))))
  assert row.vs_bf16.n == 3 and row.seeds == 3
  assert next(r for r in rows if r.arm == "ptq").k3 is None
  mine = [c.summary for c in cells if c.task == "search" and c.arm == "trace"]
  gains = [s["final_eval_reward"] - s["initial_eval_reward"] for s in mine]
  assert row.gain.n == 3 and row.gain.mean == pytest.approx(np.mean(gains))
  table = compare.markdown(cells)
  assert table.count("\n") == 1 + len(rows)
  assert "vs bf16 (paired)" in table and "gain (final - initial)" in table and "[" in table


def test_run_cells_resumes_and_refuses_other_settings(tmp_path):
  rng = np.random.default_rng(44)
  calls = []

  def runner(task, seed, arm):
    calls.append((task, seed, arm))
    return {"final_eval_reward": float(rng.uniform()), "arm": arm}

  plan = [("arith", s, a) for s in (0, 1) for a in ("bf16", "trace")]
  config_of = lambda task, seed, arm: {"steps": 5, "arm": arm, "seed": seed}
  first = compare.run_cells(str(tmp_path), plan, config_of, runner, progress=False)
  assert calls == plan
  assert os.path.exists(compare.cell_dir(str(tmp_path), "arith", 1, "trace") + "/summary.json")
  # A killed run: one cell's summary is gone; the rerun runs that cell only.
  os.remove(compare.cell_dir(str(tmp_path), "arith", 0, "trace") + "/summary.json")
  calls.clear()
  second = compare.run_cells(str(tmp_path), plan, config_of, runner, progress=False)
  assert calls == [("arith", 0, "trace")]
  kept = [c for c in second if c.arm == "bf16"]
  assert [c.summary for c in kept] == [c.summary for c in first if c.arm == "bf16"]
  # A field added later, at its default, keeps finished cells; another value does not.
  calls.clear()
  grown = lambda task, seed, arm, new=0: {"steps": 5, "arm": arm, "seed": seed, "new": new}
  compare.run_cells(str(tmp_path), plan, grown, runner, progress=False, defaults={"new": 0})
  assert calls == []
  with pytest.raises(ValueError, match=r"another config \(fields \['new'\]\)"):
    compare.run_cells(
      str(tmp_path),
      plan,
      lambda t, s, a: grown(t, s, a, new=1),
      runner,
      progress=False,
      defaults={"new": 0},
    )
  with pytest.raises(ValueError, match="another config"):
    compare.run_cells(
      str(tmp_path), plan, lambda t, s, a: {"steps": 6, "arm": a, "seed": s}, runner, progress=False
    )


def test_write_results(tmp_path):
  rng = np.random.default_rng(45)
  cells = _cells(rng)
  compare.write_results(str(tmp_path), cells, {"name": "synthetic"}, "synthetic")
  with open(tmp_path / "results.json") as f:
    results = json.load(f)
  assert len(results["cells"]) == len(cells)
  assert {tuple(sorted(c)) for c in results["cells"]} == {("arm", "seed", "summary", "task")}
  for name in ("table.md", "reward_curves.png", "final_reward.png", "k3.png"):
    assert (tmp_path / name).stat().st_size > 0
  loaded = compare.load_results(str(tmp_path))
  assert loaded.settings == {"name": "synthetic"} and loaded.cells == cells
  assert [r.to_json() for r in loaded.rows] == results["rows"]  # (3 seeds: finite bounds)
  assert results["rows"][0]["final"].keys() == {"mean", "lo", "hi", "n"}


def test_ablation_pairs_the_variant_with_its_arm_by_hand():
  rng = np.random.default_rng(46)
  cells = _cells(rng, arms=("bf16", "trace"), seeds=(0, 1, 2, 3))
  variant = _cells(rng, arms=("trace",), seeds=(0, 1, 3))  # seed 2 missing: left out
  merged = compare.with_variant(cells, variant, "trace", "trace, bf16 KV")
  assert len(merged) == len(cells) + 3 and cells == merged[: len(cells)]
  mine = {c.seed: c.summary for c in cells if c.arm == "trace"}
  theirs = {c.seed: c.summary for c in variant}
  for key, f in (
    ("final", lambda s: s["final_eval_reward"]),
    ("gain", lambda s: s["final_eval_reward"] - s["initial_eval_reward"]),
  ):
    diffs = [f(theirs[s]) - f(mine[s]) for s in (0, 1, 3)]
    half = T_975_DF2 * np.std(diffs, ddof=1) / math.sqrt(3)
    want = f"{np.mean(diffs):+.3f} [{np.mean(diffs) - half:+.3f}, {np.mean(diffs) + half:+.3f}]"
    assert want in compare.ablation_markdown(merged, "trace", "trace, bf16 KV"), key
  iv = compare.paired_difference(merged, "arith", "trace, bf16 KV", "trace")
  assert iv.n == 3 and iv.mean == pytest.approx(
    np.mean([theirs[s]["final_eval_reward"] - mine[s]["final_eval_reward"] for s in (0, 1, 3)])
  )
  k3 = [theirs[s]["mean_k3_kl"] for s in (0, 1, 3)]
  assert f"{math.exp(np.mean(np.log(k3))):.2e}" in compare.ablation_markdown(
    merged, "trace", "trace, bf16 KV"
  )
  with pytest.raises(ValueError, match="arm='fp4-qat' has no cells"):
    compare.with_variant(cells, variant, "fp4-qat", "x")
  with pytest.raises(ValueError, match="variant='bf16' is already an arm"):
    compare.with_variant(cells, variant, "trace", "bf16")
