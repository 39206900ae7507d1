"""The arms across rollout skew on the main job's setting, resumable cell by cell.

  python experiments/skew_study.py        # bf16, fp4-qat, trace, trace-full x skews x seeds 0-2
  python experiments/skew_study.py --seeds=3,4 --skews=0.25 --correction_variant=

For each point (a rollout skew, and a rollout correction): `experiments/compare_arms.py
--name=s<skew>[_<correction>] --rollout_skew=<skew> [--rollout_correction=<correction>]` on
the main job's task (results in <results>/<name>/, runs in <workdir>/<name>/), so a killed
study resumes where it stopped. Skew 0 is today's engine: on the main job's setting its cells
are read from the arms comparison (--unskewed_results, the chain sweep) where it has them; the
missing ones (all of them with --setting) run as <results>/s0.0/. --correction_variant=tis
adds the largest skew with that correction on every arm: bf16, fp4-qat, trace and trace-full
run without a rollout correction by default, so "correction off" is their own cells and the
variant asks the other way round whether a correction (TIS) recovers what the skew costs an
unguided arm. --setting=key=value,... passes flags to every compare_arms.py run (e.g. a tiny
smoke: preset=tiny,steps=2,sft_steps=4). Each run starts from its seed's warm start: the first
point's from --warmstarts_from (compare_arms' flag of that name) when one is there, the others'
from the first point's runs; warm starts are keyed by their settings, so one made for anything
else is rebuilt, never reused.

Then <results>/: results.json (`settings`, `cells` with their `rollout_skew` and
`correction`, `rows`), table.md (per arm and point: gain with its 95% interval, paired
differences against skew 0 and against fp4-qat, train reward, k3) and gain_vs_skew.png,
k3_vs_skew.png, trace_vs_fp4qat.png. Run it alone on the machine: the cells' wall times are
reported.
"""

import os
import subprocess
import sys

import matplotlib
from absl import app, flags

from trace_jax.model.skew import check_amount
from trace_jax.rl.arms import ARMS
from trace_jax.rl.config import RLConfig
from trace_jax.rl.grpo import CORRECTIONS
from trace_jax.studies import compare, skew
from trace_jax.utils import flags as config_flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
_MORE_SEEDS = flags.DEFINE_list(
  "more_seeds",
  ["3", "4"],
  "Seeds added at each point where trace's or trace-full's paired difference against fp4-qat "
  "on --seeds does not exclude 0 (so lies within one interval width of excluding it); empty: "
  "none.",
)
_SKEWS = flags.DEFINE_list(
  "skews",
  [repr(s) for s in sorted(skew.SKEWS, reverse=True)] + ["0.0"],
  "Rollout skews, run in this order (0: today's engine).",
)
_ARMS = flags.DEFINE_list("arms", list(skew.STUDY_ARMS), "Trained arms.")
_VARIANT = flags.DEFINE_string(
  "correction_variant",
  "tis",
  f"A rollout correction ({', '.join(CORRECTIONS)}) to run at the largest skew on every arm "
  "as well; empty: none.",
)
_SETTING = flags.DEFINE_list(
  "setting",
  [],
  "key=value flags for compare_arms.py at every point (e.g. preset=tiny,steps=3); default: "
  "the main job's setting. The skew-0 cells read from --unskewed_results must share it.",
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/arms_skew", "Root of this study's run directories.")
_WARMSTARTS = flags.DEFINE_string(
  "warmstarts_from", "runs/arms/chain", "compare_arms runs whose warm starts to copy (if there)."
)
_UNSKEWED = flags.DEFINE_string(
  "unskewed_results",
  os.path.join(_ROOT, "experiments", "results", "arms", "chain"),
  "An arms comparison on the same setting whose cells serve as skew 0.",
)
_RESULTS = flags.DEFINE_string(
  "results", os.path.join(_ROOT, "experiments", "results", "arms", "skew"), "Results root."
)


def _parse() -> tuple[list[int], list[int], list[skew.Point], list[str]]:
  """Seeds, added seeds, points (in run order) and arms, or a UsageError naming the bad
  value."""
  try:
    seeds = [int(s) for s in _SEEDS.value]
    more = [int(s) for s in _MORE_SEEDS.value]
  except ValueError as e:
    raise app.UsageError(f"--seeds and --more_seeds take integers: {e}") from e
  if set(seeds) & set(more):
    raise app.UsageError(
      f"--more_seeds={','.join(_MORE_SEEDS.value)} repeats seeds of --seeds={','.join(_SEEDS.value)}"
    )
  try:
    skews = [float(s) for s in _SKEWS.value]
    for s in skews:
      check_amount(s, "--skews")
  except ValueError as e:
    raise app.UsageError(f"--skews={','.join(_SKEWS.value)}: {e}") from e
  if not skews or len(set(skews)) != len(skews):
    raise app.UsageError(f"--skews={','.join(_SKEWS.value)} must name distinct skews")
  trained = [a for a, spec in ARMS.items() if not spec.post_training]
  bad = sorted(set(_ARMS.value) - set(trained))
  if bad:
    raise app.UsageError(f"--arms: {bad} are not trained arms; trained arms: {trained}")
  if _VARIANT.value and _VARIANT.value not in CORRECTIONS:
    raise app.UsageError(
      f"--correction_variant={_VARIANT.value!r}; allowed: {list(CORRECTIONS)} or empty"
    )
  try:
    config_flags.parse_pairs("setting", _SETTING.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  reserved = {"rollout_skew", "rollout_correction", "name", "seeds", "arms", "tasks"}
  clash = sorted(reserved & {pair.split("=", 1)[0] for pair in _SETTING.value})
  if clash:
    raise app.UsageError(f"--setting: {clash} are set by the study itself; use its own flags")
  points = [skew.Point(skew.DEFAULT_CORRECTION, s) for s in skews]
  if _VARIANT.value and max(skews) > 0:
    points.append(skew.Point(_VARIANT.value, max(skews)))
  return seeds, more, points, [a for a in trained if a in _ARMS.value]


def _name(point: skew.Point) -> str:
  suffix = "" if point.correction == skew.DEFAULT_CORRECTION else f"_{point.correction}"
  return f"s{point.skew!r}{suffix}"


def _read(results_dir: str, task: str, seed: int, arm: str) -> compare.Cell | None:
  summary = compare.read_summary(results_dir, task, seed, arm)
  return None if summary is None else compare.Cell(arm=arm, task=task, seed=seed, summary=summary)


def _compare_arms(point, seeds, arms, work_root, results_root, warmstarts) -> None:
  command = [
    sys.executable,
    os.path.join(_ROOT, "experiments", "compare_arms.py"),
    f"--name={_name(point)}",
    f"--tasks={RLConfig().task}",
    f"--seeds={','.join(map(str, seeds))}",
    f"--arms={','.join(arms)}",
    f"--workdir={work_root}",
    f"--results={results_root}",
    f"--warmstarts_from={warmstarts}",
  ] + [f"--{pair}" for pair in _SETTING.value]
  if point.skew:
    command.append(f"--rollout_skew={point.skew!r}")
  if point.correction != skew.DEFAULT_CORRECTION:
    command.append(f"--rollout_correction={point.correction}")
  subprocess.run(command, check=True)


def main(argv):
  matplotlib.use("Agg")  # files, not windows: the script chooses the backend
  del argv
  seeds, more, points, arms = _parse()
  task = RLConfig().task
  work_root = os.path.abspath(_WORKDIR.value)
  results_root = os.path.abspath(_RESULTS.value)
  unskewed = os.path.abspath(_UNSKEWED.value)
  warmstarts = os.path.abspath(_WARMSTARTS.value)
  base = skew.Point(skew.DEFAULT_CORRECTION, 0.0)
  cells_by_point = {}
  for point in points:
    own = os.path.join(results_root, _name(point))
    point_seeds, ran = list(seeds), False
    while True:
      cells = {
        (s, a): _read(unskewed, task, s, a) if point == base and not _SETTING.value else None
        for s in point_seeds
        for a in arms
      }  # skew 0: the comparison's cells, on the setting it ran
      if any(cell is None for cell in cells.values()):  # compare_arms keeps finished cells
        _compare_arms(point, point_seeds, arms, work_root, results_root, warmstarts)
        ran = True
      cells_by_point[point] = [
        cells[(s, a)] or _read(own, task, s, a) for s in point_seeds for a in arms
      ]
      open_arms = skew.undecided(cells_by_point[point])
      if point_seeds != seeds or not more or not open_arms:
        break
      print(f"{point.label}: {', '.join(open_arms)} - fp4-qat does not exclude 0; seeds {more} too")
      point_seeds = seeds + more
    if ran:
      warmstarts = os.path.join(work_root, _name(point))  # the next points start there
  settings = {
    "task": task,
    "seeds": seeds,
    "skews": sorted({p.skew for p in points}),
    "correction_variant": _VARIANT.value,
    "arms": arms,
    "setting": _SETTING.value,
  }
  title = f"the arms across rollout skew on {task}: {len(arms)} arms x {len(seeds)} seeds"
  try:
    skew.write_results(results_root, cells_by_point, settings, title)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  print()
  print(skew.markdown(cells_by_point))
  print(
    f"\nwrote {results_root}/results.json, table.md, gain_vs_skew.png, k3_vs_skew.png, "
    "trace_vs_fp4qat.png"
  )


if __name__ == "__main__":
  app.run(main)
