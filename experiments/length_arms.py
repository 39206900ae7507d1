"""Guidance's payoff against answer length: the arms and the shipped corrections at two or
more chain lengths, paired seed by seed, resumable cell by cell (`studies.length`).

  python experiments/length_arms.py                                   # the study (days alone)
  python experiments/length_arms.py --terms=4 --seeds=0 --correction_seeds=0  # one seed, one length
  python experiments/length_arms.py --preset=tiny --terms=2,3 --seeds=0 --correction_seeds=0 \
      --steps=2 --sft_steps=2 --eval_size=8 --eval_every=2 --workdir=/tmp/la \
      --results=/tmp/la_results                                       # a quick smoke

The task is the main job's, `chain_flawed`, at each --terms (4: the main job's own length);
each length's answer budget is its longest of 32 demonstrations plus 16 tokens. Variants:
bf16, fp4-qat, fp4-qat-r3, trace and trace-full on --seeds; fp4-qat+tis and fp4-qat+geo_mask
(fp4-qat with verl's token TIS or geometric sequence mask) on --correction_seeds. Every
variant of a (length, seed) starts from that seed's one warm start. Steps default to twice the
main job's.

Runs go to <workdir>/<length>/seed<seed>/<variant> (checkpoints: a killed cell resumes);
results (small, meant to be committed cell by cell) to --results: cells/<length>/seed<seed>/
<variant>/summary.json (with the collapse precursors' curves), results.json (`settings`,
`cells`, `rows`, `differences`: each paired gain difference per length with its interval and
fp4-qat's sequence-level mismatch, `collapses`, and `extrapolation`: the mismatch map's
(--map_results) growth per answer token and with depth, carried to the paper's lengths),
table.md and the comparison's plots. The
cells run seed by seed: a study cut short still pairs every seed it finished. Run it alone:
the wall times are in the table.
"""

import functools
import json
import os

import jax
import matplotlib
from absl import app, flags, logging

from trace_jax.model.transformer import Transformer  # noqa: F401  (the policy class)
from trace_jax.rl.config import RLConfig
from trace_jax.run import warmstart
from trace_jax.studies import compare, length
from trace_jax.studies.mismatch_map import answer_budget
from trace_jax.tasks.registry import get_task
from trace_jax.tasks.tokenizer import CharTokenizer

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_D = RLConfig()
TASK = "chain_flawed"
_TERMS = flags.DEFINE_list("terms", ["4", "8"], "Chain lengths (terms; 4: the main job's).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2", "3", "4"], "Seeds of every variant.")
_CORRECTION_SEEDS = flags.DEFINE_list(
  "correction_seeds", ["0", "1", "2"], "Seeds of fp4-qat+tis and fp4-qat+geo_mask."
)
_VARIANTS = flags.DEFINE_list("variants", list(length.VARIANTS), "Variants (arm[+correction]).")
_STEPS = flags.DEFINE_integer("steps", 2 * _D.schedule.steps, "RL steps (2x the main job's).")
_PRESET = flags.DEFINE_string("preset", _D.source.preset, "Model preset.")
_SFT = flags.DEFINE_integer("sft_steps", None, "Warm-start steps (default RLConfig's).")
_EVAL_SIZE = flags.DEFINE_integer("eval_size", None, "Eval problems (default RLConfig's).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", None, "Eval period (default RLConfig's).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/length_arms", "Root of the run directories.")
_MAP = flags.DEFINE_string(
  "map_results",
  os.path.join(_ROOT, "experiments", "results", "mismatch_map", "results.json"),
  "The mismatch map's results.json, for the extrapolation to long answers ('': none).",
)
_RESULTS = flags.DEFINE_string(
  "results",
  os.path.join(_ROOT, "experiments", "results", "arms", "length"),
  "Results directory.",
)


def _ints(flag) -> list[int]:
  try:
    values = [int(v) for v in flag.value]
  except ValueError as e:
    raise app.UsageError(f"--{flag.name}={flag.value!r} must be integers") from e
  if not values:
    raise app.UsageError(f"--{flag.name} is empty")
  return values


def _overrides() -> dict:
  values = {
    "steps": _STEPS.value,
    "preset": _PRESET.value,
    "sft_steps": _SFT.value,
    "eval_size": _EVAL_SIZE.value,
    "eval_every": _EVAL_EVERY.value,
  }
  return {k: v for k, v in values.items() if v is not None}


def _map_points() -> list[dict] | None:
  """The mismatch map's points (None with --map_results=''), checked before any work."""
  path = _MAP.value
  if not path:
    return None
  try:
    with open(path) as f:
      points = json.load(f)["points"]
  except (OSError, ValueError, KeyError) as e:
    raise app.UsageError(
      f"--map_results={path!r} must be the mismatch map's results.json (with 'points'): {e}"
    ) from e
  if not points:
    raise app.UsageError(f"--map_results={path!r} holds no points")
  return points


@functools.cache
def _budget(terms: int) -> int:
  return answer_budget(get_task(TASK, terms=terms), CharTokenizer(), 0)


def rl_config(task_label: str, seed: int, variant: str, overrides: dict) -> RLConfig:
  """The RLConfig of one cell."""
  arm, correction = length.VARIANTS[variant]
  terms = length.terms_of(task_label)
  return RLConfig.from_flat(
    arm=arm,
    task=TASK,
    task_options=(("terms", terms),),
    max_new_tokens=_budget(terms),
    seed=seed,
    correction=correction or "auto",
    **overrides,
  )


def main(argv):
  matplotlib.use("Agg")  # files, not windows: the script chooses the backend
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax and JAX log every save at INFO
  terms, seeds, correction_seeds = _ints(_TERMS), _ints(_SEEDS), _ints(_CORRECTION_SEEDS)
  overrides = _overrides()
  map_points = _map_points()
  try:
    variants = length.check_variants(_VARIANTS.value)
    plan = length.plan(terms, seeds, correction_seeds, variants)
    for task_label, seed, variant in plan:  # every config is valid before any work
      rl_config(task_label, seed, variant, overrides)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  results_dir = os.path.abspath(_RESULTS.value)
  work_root = os.path.abspath(_WORKDIR.value)
  workdir = lambda task_label, seed, variant: os.path.join(  # noqa: E731
    work_root, task_label, f"seed{seed}", variant
  )

  def config_of(task_label, seed, variant):
    return {"arm": variant, **rl_config(task_label, seed, variant, overrides).to_dict()}

  def runner(task_label, seed, variant):
    # the seed's one start policy: the warm start of the first of its cells that made one
    made = [os.path.join(workdir(task_label, seed, v), warmstart.WARMSTART_DIR) for v in variants]
    config = rl_config(task_label, seed, variant, overrides)
    return compare.train_cell(config, workdir(task_label, seed, variant), made)

  cells = compare.run_cells(
    results_dir,
    plan,
    config_of,
    runner,
    defaults=_D.to_dict(),
    normalize=functools.partial(RLConfig.flat_dict, devices=jax.device_count()),
  )
  title = (
    f"length: {len(variants)} variants at terms {terms}, seeds {seeds} "
    f"(corrections: {correction_seeds}), {overrides['preset']}, {overrides['steps']} steps"
  )
  settings = {
    "task": TASK,
    "terms": terms,
    "max_new_tokens": {str(t): _budget(t) for t in terms},
    "seeds": seeds,
    "correction_seeds": correction_seeds,
    "variants": variants,
    "overrides": overrides,
  }
  length.write_results(results_dir, cells, settings, title, map_points)
  print()
  print(length.markdown(cells, map_points))
  print(f"\nwrote {results_dir}/results.json, table.md and plots")


if __name__ == "__main__":
  app.run(main)
