"""studies.mismatch_map: the map's points, and the
script end to end on one tiny point (slow: `pytest -m slow tests/studies/test_mismatch_map.py`)."""

import json
import os
import subprocess
import sys

import pytest

from trace_jax.studies import mismatch_map as study

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "mismatch_map.py")


def test_the_map_is_every_length_and_depth_on_three_engines():
  points = study.default_points()
  assert len(points) == 18 and len({p.key for p in points}) == 18
  assert {(p.terms, p.layers) for p in points} == {
    (4, 4),
    (8, 4),
    (16, 4),
    (32, 4),
    (8, 8),
    (8, 16),
  }
  engines = {(p.rollout_skew, p.router_dtype) for p in points}
  assert engines == {(0.0, "float32"), (2.0**-4, "float32"), (0.0, "compute")}


def test_a_bad_point_is_refused_by_field():
  with pytest.raises(ValueError, match="MapPoint.router_dtype='bf16' is not allowed"):
    study.MapPoint(terms=4, layers=2, router_dtype="bf16")
  with pytest.raises(ValueError, match="MapPoint.terms=1"):
    study.MapPoint(terms=1, layers=2)


@pytest.mark.slow
def test_one_tiny_point_end_to_end_and_resumed(tmp_path):
  args = ["--preset=tiny", "--sft_steps=3", "--rollouts=3", "--terms=4", "--layers=2"]
  args += [f"--out={tmp_path}"]
  run = lambda *extra: subprocess.run(  # noqa: E731
    [sys.executable, SCRIPT, *args, *extra], capture_output=True, text=True, timeout=900
  )
  result = run("--rollout_skew=0.0625")
  assert result.returncode == 0, result.stderr[-3000:]
  saved = json.loads((tmp_path / "results.json").read_text())
  (point,) = saved["points"]
  assert (point["terms"], point["layers"], point["rollout_skew"]) == (4, 2, 0.0625)
  assert point["router_dtype"] == "float32" and point["answer_tokens"] > 0
  assert set(point["paths"]) == set(study.PATHS)
  for name, metrics in point["paths"].items():
    assert set(study.METRICS) <= set(metrics)
    assert len(metrics["router_flip_rate"]) == 2 and len(metrics["code_disagreement"]) == 2
    assert all(0.0 <= x <= 1.0 for x in metrics["router_flip_rate"])
  # The first MoE layer's router reads the same input with or without replay: the replaying
  # path's would-be flips there are fp4-qat's flips.
  flips = {name: point["paths"][name]["router_flip_rate"][0] for name in ("fp4-qat", "fp4-qat-r3")}
  assert flips["fp4-qat-r3"] == pytest.approx(flips["fp4-qat"], abs=0.02)
  for name in ("table.md", "length.png", "depth.png"):
    assert (tmp_path / name).exists()
  refused = run("--sft_steps=4")
  assert refused.returncode == 1 and "sft_steps" in refused.stderr
