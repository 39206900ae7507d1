"""The main job on several seeds, each against its matched placebo (resumable).

  python experiments/main_job.py                       # seeds 0, 1, 2: 6 runs, about 25 min
  python experiments/main_job.py --seeds=3 --workdir=runs/main_job

Per seed: `python experiments/rl.py --seed=S` as it is, in its own process (a fresh warm start:
its summary's wall time is the main job's), then the same run with `--reward_control=shuffle`
from that warm start. Runs go to <workdir>/seed<S>/{real,placebo}; a run that finished there
with the same config (an rl.py run made by hand with --workdir) is read, not rerun. Results
(small, meant to be committed) go to experiments/results/main_job/: cells/, results.json
(`cells`, `rows`), table.md (rise, best point, placebo, gap and wall time per seed, against the
target: +0.15, +0.15 over the placebo, <= 600 s) and curves.png. A finished cell is not rerun.
Run it alone on the machine: the wall times are part of the target.
"""

import functools
import json
import os
import shutil
import subprocess
import sys

import jax
import matplotlib
from absl import app, flags, logging

from trace_jax.rl.config import RLConfig
from trace_jax.run import report, warmstart
from trace_jax.run.rundir import read_metrics
from trace_jax.studies import compare, seeds as seeds_lib

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/main_job", "Root of the run directories.")
_RESULTS = flags.DEFINE_string(
  "results",
  os.path.join(_ROOT, "experiments", "results", "main_job"),
  "Results directory.",
)


def main(argv):
  matplotlib.use("Agg")  # files, not windows: the script chooses the backend
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax and JAX log every save at INFO
  try:
    seeds = [int(s) for s in _SEEDS.value]
  except ValueError as e:
    raise app.UsageError(f"--seeds={_SEEDS.value!r} must be integers") from e
  work_root = os.path.abspath(_WORKDIR.value)
  results_dir = os.path.abspath(_RESULTS.value)
  task = RLConfig().task

  def config(seed, cell):
    return RLConfig.from_flat(seed=seed, reward_control=seeds_lib.CONTROLS[cell])

  def run(task, seed, cell):
    """`python experiments/rl.py` in its own process, as a user runs it (its wall time
    includes every compilation and, for the real run, the warm start); a run that finished
    in its workdir before with this config is read instead."""
    path = os.path.join(work_root, f"seed{seed}", cell)
    expected = config(seed, cell)
    if report.finished_summary(path, expected) is None:
      start_policy = os.path.join(work_root, f"seed{seed}", "real", warmstart.WARMSTART_DIR)
      mine = os.path.join(path, warmstart.WARMSTART_DIR)
      if cell != "real" and os.path.exists(start_policy) and not os.path.exists(mine):
        shutil.copytree(start_policy, mine)  # the placebo starts where the real run did
      command = [
        sys.executable,
        os.path.join(_ROOT, "experiments", "rl.py"),
        f"--seed={seed}",
        f"--reward_control={seeds_lib.CONTROLS[cell]}",
        f"--workdir={path}",
      ]
      subprocess.run(command, check=True)
    with open(os.path.join(path, "summary.json")) as f:
      summary = json.load(f)
    summary["curve_eval"] = report.eval_curve(read_metrics(path), summary["eval_precision"])
    return summary

  plan = [(task, seed, cell) for seed in seeds for cell in seeds_lib.CONTROLS]
  cells = compare.run_cells(
    results_dir,
    plan,
    lambda task, seed, cell: config(seed, cell).to_dict(),
    run,
    defaults=RLConfig().to_dict(),
    normalize=functools.partial(RLConfig.flat_dict, devices=jax.device_count()),
  )
  title = f"the main job ({task}, {RLConfig().arm}) on {len(seeds)} seeds against its placebo"
  seeds_lib.write_results(results_dir, cells, {"seeds": seeds}, title)
  print()
  print(seeds_lib.markdown(cells))
  print(f"\nwrote {results_dir}/results.json, table.md, curves.png")


if __name__ == "__main__":
  app.run(main)
