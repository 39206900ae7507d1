"""Asynchronous RL across staleness on the main job's setting, resumable.

  python experiments/async_study.py          # fp4-qat, trace, trace-full x k = 0, 1, 3 x seeds 0-2
  python experiments/async_study.py --seeds=0 --staleness=0,3 --arms=trace
  python experiments/async_study.py --staleness=0,3 --lr_scales=1,0.5 --sync_results= \
      --results=experiments/results/async/chain_flawed      # the rate question, all run here

For each k > 0: `experiments/compare_arms.py --name=staleness<k> --max_staleness=<k>
--version_diag_every=<n>` on the main job's task (results in <results>/staleness<k>/, runs in
<workdir>/staleness<k>/), cell by cell, so a killed study resumes where it stopped. k = 0 is the
synchronous loop: on the main job's setting its cells are read from the arms comparison
(--sync_results, the chain sweep) where it has them; the missing ones (all of them with
--setting, or an empty --sync_results) run as <results>/staleness0/. --lr_scales runs every k
at each learning rate scale too (the run's rate times it: RLConfig's, or --setting's
learning_rate), as <results>/staleness<k>_lr<rate>/ (a scale of 1 is the plain name), each
paired against k = 0 at its own rate. --setting=key=value,... passes flags to every
compare_arms.py run (e.g. a tiny smoke: preset=tiny,steps=2,sft_steps=4). Each run starts from
its seed's warm start in --warmstarts_from (a directory of compare_arms runs:
<task>/seed<S>/<arm>/warmstart; compare_arms' flag of that name) when one is there, the later
points from the first's; warm starts are keyed by their settings, so one made for anything
else is rebuilt, never reused.

Then <results>/study/: results.json (`settings`, `cells` with their `staleness`, `rows`),
table.md (per arm and k: gain with its 95% interval, paired difference against k = 0, the
mean evaluation over the run and its paired difference, total / precision / version k3,
masked share, largest gap, followed share by gap; with several rates, what the smaller rate
removes of k's cost, `staleness.rate_effects`) and study.png.
Run it alone on the machine: the cells' wall times are reported.
"""

import os
import subprocess
import sys

import matplotlib
from absl import app, flags

from trace_jax.rl.arms import ARMS
from trace_jax.rl.config import RLConfig
from trace_jax.studies import compare, staleness
from trace_jax.utils import flags as config_flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
_STALENESS = flags.DEFINE_list(
  "staleness", [str(k) for k in staleness.STALENESS], "Max staleness values (0: synchronous)."
)
_ARMS = flags.DEFINE_list("arms", list(staleness.STUDY_ARMS), "Trained arms.")
_LR_SCALES = flags.DEFINE_list(
  "lr_scales", ["1"], "Learning-rate scales: every k runs at the run's rate times each."
)
_DIAG = flags.DEFINE_integer(
  "version_diag_every", 20, "Steps between precision / version k3 diagnostics (k > 0)."
)
_SETTING = flags.DEFINE_list(
  "setting",
  [],
  "key=value flags for compare_arms.py at every k (e.g. preset=tiny,steps=3); default: the "
  "main job's setting. The k = 0 cells read from --sync_results must share it.",
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/async", "Root of this study's run directories.")
_WARMSTARTS = flags.DEFINE_string(
  "warmstarts_from", "runs/arms/chain", "compare_arms runs whose warm starts to copy (if there)."
)
_SYNC = flags.DEFINE_string(
  "sync_results",
  os.path.join(_ROOT, "experiments", "results", "arms", "chain"),
  "An arms comparison on the same setting whose cells serve as k = 0 (empty: run them here, "
  "e.g. on a machine whose warm starts differ from that comparison's).",
)
_RESULTS = flags.DEFINE_string(
  "results", os.path.join(_ROOT, "experiments", "results", "async"), "Results root."
)


def _parse() -> tuple[list[int], list[int], list[str], list[float]]:
  """Seeds, staleness values, arms and learning rates, or a UsageError naming the bad
  value."""
  try:
    seeds = [int(s) for s in _SEEDS.value]
    ks = sorted({int(k) for k in _STALENESS.value})
  except ValueError as e:
    raise app.UsageError(f"--seeds and --staleness take integers: {e}") from e
  if any(k < 0 for k in ks):
    raise app.UsageError(f"--staleness={ks}: each k must be >= 0")
  try:
    scales = [float(x) for x in _LR_SCALES.value]
  except ValueError as e:
    raise app.UsageError(f"--lr_scales takes numbers: {e}") from e
  if not scales or any(not (x > 0 and x < float("inf")) for x in scales):
    raise app.UsageError(f"--lr_scales={_LR_SCALES.value}: each scale must be a finite number > 0")
  trained = [a for a, spec in ARMS.items() if not spec.post_training]
  bad = sorted(set(_ARMS.value) - set(trained))
  if bad:
    raise app.UsageError(f"--arms: {bad} are not trained arms; trained arms: {trained}")
  try:
    config_flags.parse_pairs("setting", _SETTING.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  reserved = {"max_staleness", "version_diag_every", "name", "seeds", "arms", "tasks"}
  setting = dict(pair.split("=", 1) for pair in _SETTING.value)
  clash = sorted(reserved & set(setting))
  if clash:
    raise app.UsageError(f"--setting: {clash} are set by the study itself; use its own flags")
  if _DIAG.value < 1:
    raise app.UsageError(f"--version_diag_every={_DIAG.value} must be >= 1")
  base = float(setting.get("learning_rate", RLConfig().schedule.learning_rate))
  rates = list(dict.fromkeys(base * x for x in scales))
  return seeds, ks, [a for a in trained if a in _ARMS.value], rates


def _read(results_dir: str, task: str, seed: int, arm: str) -> compare.Cell | None:
  summary = compare.read_summary(results_dir, task, seed, arm)
  return None if summary is None else compare.Cell(arm=arm, task=task, seed=seed, summary=summary)


def _compare_arms(name: str, k: int, seeds, arms, work_root, results_root, warmstarts, rate=None):
  command = [
    sys.executable,
    os.path.join(_ROOT, "experiments", "compare_arms.py"),
    f"--name={name}",
    f"--tasks={RLConfig().task}",
    f"--seeds={','.join(map(str, seeds))}",
    f"--arms={','.join(arms)}",
    f"--workdir={work_root}",
    f"--results={results_root}",
    f"--warmstarts_from={warmstarts}",
  ] + [
    f"--{pair}" for pair in _SETTING.value if rate is None or not pair.startswith("learning_rate=")
  ]
  if rate is not None:
    command.append(f"--learning_rate={rate!r}")
  if k:
    command += [f"--max_staleness={k}", f"--version_diag_every={_DIAG.value}"]
  subprocess.run(command, check=True)


def main(argv):
  matplotlib.use("Agg")  # files, not windows: the script chooses the backend
  del argv
  seeds, ks, arms, rates = _parse()
  task = RLConfig().task
  work_root = os.path.abspath(_WORKDIR.value)
  results_root = os.path.abspath(_RESULTS.value)
  sync_results = os.path.abspath(_SYNC.value) if _SYNC.value else None
  cells_by_k = {k: [] for k in ks}
  warmstarts = os.path.abspath(_WARMSTARTS.value)
  for rate in rates:
    scaled = rate != rates[0]
    for k in ks:
      name = f"staleness{k}_lr{rate:g}" if scaled else f"staleness{k}"
      own = os.path.join(results_root, name)
      passed = rate if scaled else None
      if k == 0:  # the comparison's synchronous cells where it has them
        from_sync = {  # only on the main job's setting (and rate), which the comparison ran
          (s, a): None
          if (_SETTING.value or scaled or sync_results is None)
          else _read(sync_results, task, s, a)
          for s in seeds
          for a in arms
        }
        missing = sorted({s for (s, a), cell in from_sync.items() if cell is None})
        if missing:
          _compare_arms(name, 0, missing, arms, work_root, results_root, warmstarts, passed)
          warmstarts = os.path.join(work_root, name)  # the next points start there
        cells = [from_sync[(s, a)] or _read(own, task, s, a) for s in seeds for a in arms]
      else:
        _compare_arms(name, k, seeds, arms, work_root, results_root, warmstarts, passed)
        warmstarts = os.path.join(work_root, name)
        cells = [_read(own, task, s, a) for s in seeds for a in arms]
      cells_by_k[k] += cells
  settings = {
    "task": task,
    "seeds": seeds,
    "staleness": ks,
    "arms": arms,
    "setting": _SETTING.value,
    "learning_rates": rates,
  }
  settings["version_diag_every"] = _DIAG.value
  title = f"asynchronous RL on {task}: {len(arms)} arms x k = {ks} x {len(seeds)} seeds"
  if len(rates) > 1:
    title += f" x learning rates {', '.join(f'{r:.2g}' for r in rates)}"
  try:
    staleness.write_results(os.path.join(results_root, "study"), cells_by_k, settings, title)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  print()
  print(staleness.markdown(cells_by_k))
  effects = staleness.rate_markdown(cells_by_k)
  if effects:
    print(f"\nWhat the smaller learning rate removes of k's cost:\n{effects}")
  print(f"\nwrote {results_root}/study/results.json, table.md, study.png")


if __name__ == "__main__":
  app.run(main)
