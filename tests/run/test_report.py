"""What a study reads of a run that finished before (`report.finished_summary`)."""

import json

import numpy as np

from trace_jax.rl.config import RLConfig
from trace_jax.run import report


def test_a_finished_run_is_read_only_for_its_own_config(tmp_path):
  """A run directory's summary.json is the run's result only if it finished the config's steps
  with no field differing: no file, another seed or arm, or more steps each give None; a field
  a resume may change (remat) does not count."""
  rng = np.random.default_rng()
  seed = int(rng.integers(1 << 20))
  config = RLConfig.from_flat(seed=seed, steps=int(rng.integers(2, 50)))
  assert report.finished_summary(str(tmp_path), config) is None  # no summary.json
  wall = float(rng.uniform(1, 1000))
  summary = {"steps": config.schedule.steps, "wall_seconds": wall, "config": config.to_dict()}
  (tmp_path / "summary.json").write_text(json.dumps(summary))
  assert report.finished_summary(str(tmp_path), config)["wall_seconds"] == wall
  assert report.finished_summary(str(tmp_path), config.replace(remat=True)) is not None
  assert report.finished_summary(str(tmp_path), config.replace(seed=seed + 1)) is None
  assert report.finished_summary(str(tmp_path), config.replace(arm="bf16")) is None
  longer = config.replace(steps=config.schedule.steps + 1)  # the run stopped short of it
  assert report.finished_summary(str(tmp_path), longer) is None
