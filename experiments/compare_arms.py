"""Every arm on every (task, seed), resumable, with intervals across seeds.

  python experiments/compare_arms.py --seeds=0,1,2 --tasks=arith,coding       # the comparison
  python experiments/compare_arms.py --seeds=0,1,2 --tasks=arith --stress   # stress
  python experiments/compare_arms.py --name=smoke --seeds=0 --tasks=arith,coding --preset=tiny \
      --steps=3 --sft_steps=10 --eval_size=16 --eval_every=3                  # a quick smoke
  python experiments/compare_arms.py --name=long --tasks=chain --arms=bf16,fp4-qat,trace,trace-full \
      --fp4_sites=experts+kv --task_options=terms=8 --max_new_tokens=64 --sft_steps=400 \
      --sft_target=0.6 --steps=60 --workdir=runs/arms                         # the long setting
  python experiments/compare_arms.py --results=experiments/results/arms/long --name=kv_bf16 \
      --arms=trace --kv_precision=bf16 --warmstarts_from=runs/arms/long ...  # + its KV ablation
  python experiments/compare_arms.py --results=experiments/results/arms/skew --name=s0.0625 \
      --tasks=chain_flawed --arms=bf16,fp4-qat,trace,trace-full --rollout_skew=0.0625  # a skewed engine

Arms: bf16, fp4-rollout, fp4-qat, trace, trace-full (trained), then ptq and ptq-46 (the bf16
run's final policy quantized to FP4 after training, with the standard and the "4over6"
block-scale rule, evaluated greedily in FP4 on the same problems). Within a (task, seed) all
arms start from one SFT warm start (made by the bf16 run, copied) and see the same problems
and sampling keys, so differences on the same seed are paired.

Runs go to <workdir>/<name>/<task>/seed<seed>/<arm> (checkpoints: a killed cell resumes);
--warmstarts_from=<workdir>/<other name> starts each seed from another comparison's warm start
(its <task>/seed<seed>/bf16/warmstart; warm starts are keyed by their settings, so one made for
anything else is rebuilt, never reused);
results (small files, meant to be committed) to experiments/results/arms/<name>/: per-cell
cells/<task>/seed<seed>/<arm>/summary.json, results.json (`cells`: arm, task, seed,
summary), table.md (mean and 95% interval per arm, paired differences against bf16 and
fp4-qat, k3, time per cell) and reward_curves.png, final_reward.png, k3.png. A finished cell
(its summary.json, same settings) is not rerun, nor is a run that finished in its run directory
with the cell's config (its summary.json: an `experiments/rl.py` run copied there is read).

--stress: where mismatch is known to bite: twice the steps, learning rate x4 and no rollout
correction on any arm (fp4-rollout loses its TIS); results under <name> "stress".
"""

import functools
import os
import time

import jax
import matplotlib
from absl import app, flags, logging

from trace_jax.model.transformer import Transformer  # noqa: F401  (the policy class)
from trace_jax.studies import compare, ptq
from trace_jax.run import warmstart
from trace_jax.rl.arms import ARMS
from trace_jax.rl.config import LR_DECAYS, RLConfig
from trace_jax.rl.grpo import CORRECTIONS
from trace_jax.run.trainer import Trainer
from trace_jax.utils import flags as config_flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_D = RLConfig()
_NAME = flags.DEFINE_string("name", None, "Results name (default: 'default', or 'stress').")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
_TASKS = flags.DEFINE_list("tasks", ["arith", "coding"], "Tasks.")
_ARMS = flags.DEFINE_list("arms", list(compare.ALL_ARMS), "Arms (ptq arms need bf16).")
_STRESS = flags.DEFINE_bool("stress", False, "Stress setting: 2x steps, LR x4, no correction.")
_STEPS = flags.DEFINE_integer("steps", None, "RL steps (default RLConfig's; x2 with --stress).")
_SFT = flags.DEFINE_integer("sft_steps", None, "Warm-start steps (default RLConfig's).")
_SFT_TARGET = flags.DEFINE_float(
  "sft_target", None, "Stop the warm start at this greedy FP4 train reward (default RLConfig's)."
)
_LR = flags.DEFINE_float("learning_rate", None, "Learning rate (default RLConfig's; x4 stress).")
_LR_DECAY = flags.DEFINE_enum(
  "lr_decay", None, list(LR_DECAYS), "Learning-rate decay (default RLConfig's)."
)
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling temperature (default RLConfig's).")
_EVAL_SIZE = flags.DEFINE_integer("eval_size", None, "Eval problems (default RLConfig's).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", None, "Eval period (default RLConfig's).")
_PROMPTS = flags.DEFINE_integer("prompts_per_step", None, "Problems per step.")
_GROUP = flags.DEFINE_integer("group_size", None, "Samples per problem.")
_MINIBATCHES = flags.DEFINE_integer("minibatches", None, "Updates per step (default RLConfig's).")
_PRESET = flags.DEFINE_string("preset", None, "Model preset (default RLConfig's).")
_FP4_SITES = flags.DEFINE_string("fp4_sites", None, "FP4 scope: all or experts+kv.")
_FMT = flags.DEFINE_string("fmt", None, "FP4 format: nvfp4 or mxfp4.")
_KV = flags.DEFINE_string("kv_precision", None, "KV cache precision: fp4 or bf16 (ablation).")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", None, "Max tokens per turn.")
_TASK_OPTIONS = flags.DEFINE_list(
  "task_options", None, "key=value options of every task (e.g. terms=8 for longer chains)."
)
_STALENESS = flags.DEFINE_integer(
  "max_staleness", None, "Asynchronous RL: rollouts up to k versions old (default 0: sync)."
)
_VERSION_DIAG = flags.DEFINE_integer(
  "version_diag_every", None, "Asynchronous RL: precision / version k3 split period."
)
_SKEW = flags.DEFINE_float(
  "rollout_skew",
  None,
  "A rollout engine that computes differently: each layer's output on the rollout path times "
  "1 + s * u (RLConfig.rollout_skew; default 0: none).",
)
_CORRECTION = flags.DEFINE_enum(
  "rollout_correction",
  None,
  ["auto", *CORRECTIONS],
  "Correction on pi_old / pi_rollout for every arm (RLConfig.correction; default auto: the arm's).",
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/arms", "Root of the run directories.")
_WARMSTARTS = flags.DEFINE_string(
  "warmstarts_from",
  None,
  "Another comparison's run directories (<workdir>/<name>) whose seeds' warm starts to start "
  "from, where this one has none (an ablation starts where its comparison did).",
)
_RESULTS = flags.DEFINE_string(
  "results",
  os.path.join(_ROOT, "experiments", "results", "arms"),
  "Root of the results directories.",
)

STRESS_LR_FACTOR = 4.0
STRESS_STEPS_FACTOR = 2


def _overrides() -> dict:
  values = {
    "steps": _STEPS.value,
    "sft_steps": _SFT.value,
    "sft_target": _SFT_TARGET.value,
    "learning_rate": _LR.value,
    "lr_decay": _LR_DECAY.value,
    "temperature": _TEMPERATURE.value,
    "eval_size": _EVAL_SIZE.value,
    "eval_every": _EVAL_EVERY.value,
    "prompts_per_step": _PROMPTS.value,
    "group_size": _GROUP.value,
    "minibatches": _MINIBATCHES.value,
    "preset": _PRESET.value,
    "fp4_sites": _FP4_SITES.value,
    "fmt": _FMT.value,
    "kv_precision": _KV.value,
    "max_new_tokens": _NEW_TOKENS.value,
    "task_options": (
      None
      if _TASK_OPTIONS.value is None
      else config_flags.parse_pairs("task_options", _TASK_OPTIONS.value)
    ),
    "max_staleness": _STALENESS.value,
    "version_diag_every": _VERSION_DIAG.value,
    "rollout_skew": _SKEW.value,
    "correction": _CORRECTION.value,
  }
  out = {k: v for k, v in values.items() if v is not None}
  if _STRESS.value:
    out["steps"] = out.get("steps", _D.schedule.steps * STRESS_STEPS_FACTOR)
    out["learning_rate"] = out.get("learning_rate", _D.schedule.learning_rate * STRESS_LR_FACTOR)
    out.setdefault("correction", "none")
  return out


def _rl_config(task: str, seed: int, arm: str, overrides: dict) -> RLConfig:
  return RLConfig.from_flat(arm=ARMS[arm].derived_from or arm, task=task, seed=seed, **overrides)


def main(argv):
  matplotlib.use("Agg")  # files, not windows: the script chooses the backend
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax and JAX log every save at INFO
  try:
    overrides = _overrides()
  except ValueError as e:  # a malformed --task_options
    raise app.UsageError(str(e)) from e
  name = _NAME.value or ("stress" if _STRESS.value else "default")
  seeds = [int(s) for s in _SEEDS.value]
  unknown = sorted(set(_ARMS.value) - set(ARMS))
  if unknown:
    raise app.UsageError(f"--arms: {unknown} are not arms; arms: {list(ARMS)}")
  arms = [a for a in ARMS if a in _ARMS.value]
  missing = sorted({ARMS[a].derived_from for a in arms} - set(arms) - {None})
  if missing:
    raise app.UsageError(f"--arms: ptq and ptq-46 quantize the {missing[0]} run's policy; add it")
  try:
    for task in _TASKS.value:  # every config is valid before any work
      for seed in seeds:
        _rl_config(task, seed, "bf16", overrides)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  results_dir = os.path.join(os.path.abspath(_RESULTS.value), name)
  work_root = os.path.join(os.path.abspath(_WORKDIR.value), name)
  workdir = lambda task, seed, arm, root=work_root: os.path.join(
    root, task.replace(":", "_"), f"seed{seed}", arm
  )

  def config_of(task, seed, arm):
    return {"arm": arm, **_rl_config(task, seed, arm, overrides).to_dict()}

  def run_trained(task, seed, arm):
    config = _rl_config(task, seed, arm, overrides)
    path = workdir(task, seed, arm)
    # One start policy per seed: the warm start of this seed's bf16 run, else of another arm
    # of it run before (a comparison without bf16), else --warmstarts_from's (keyed: one made
    # for other settings is rebuilt, never reused).
    roots = [work_root] + ([os.path.abspath(_WARMSTARTS.value)] if _WARMSTARTS.value else [])
    made = [
      os.path.join(workdir(task, seed, a, root), warmstart.WARMSTART_DIR)
      for root in roots
      for a in ("bf16", *(a for a in arms if a not in compare.DERIVED_ARMS))
    ]
    return compare.train_cell(config, path, made)

  def run_ptq(task, seed, arm):
    source = ARMS[arm].derived_from  # the trained arm whose final policy it packs
    bf16 = compare.finished_summary(
      results_dir,
      task,
      seed,
      source,
      config_of(task, seed, source),
      _D.to_dict(),
      RLConfig.flat_dict,
    )
    summary = dict(
      bf16,
      arm=arm,
      eval_precision="fp4",
      mean_k3_kl=None,
      mean_logp_abs_diff=None,
      curve_train=None,
      curve_mixed=None,
      curve_eval=bf16["curve_fp4"],
    )
    if ARMS[arm].scale_rule == "standard":  # the rollout's own packing: the run's FP4 evals
      summary.update(
        initial_eval_reward=bf16["initial_eval_reward_fp4"],
        final_eval_reward=bf16["final_eval_reward_fp4"],
      )
      return summary
    start = time.time()
    config = _rl_config(task, seed, source, overrides)
    # its final step (the run finished: reopened, not restarted)
    trainer = Trainer(config, workdir(task, seed, source), progress=False, reopen=True)
    final = ptq.ptq_eval_reward(trainer, ARMS[arm].scale_rule)
    trainer.rundir.warm_start(trainer.policy, trainer.task, trainer.tokenizer, progress=False)
    initial = ptq.ptq_eval_reward(trainer, ARMS[arm].scale_rule)
    summary.update(
      initial_eval_reward=initial,
      final_eval_reward=final,
      curve_eval=None,
      wall_seconds=bf16["wall_seconds"] + time.time() - start,
    )
    return summary

  def runner(task, seed, arm):
    return (run_ptq if arm in compare.DERIVED_ARMS else run_trained)(task, seed, arm)

  plan = [(task, seed, arm) for task in _TASKS.value for seed in seeds for arm in arms]
  cells = compare.run_cells(
    results_dir,
    plan,
    config_of,
    runner,
    defaults=_D.to_dict(),
    normalize=functools.partial(RLConfig.flat_dict, devices=jax.device_count()),
  )
  preset = overrides.get("preset", _D.source.preset)
  title = (
    f"{name}: {len(arms)} arms x {len(_TASKS.value)} tasks x {len(seeds)} seeds, "
    f"{preset}, {overrides.get('steps', _D.schedule.steps)} steps"
  )
  compare.write_results(
    results_dir,
    cells,
    {
      "name": name,
      "overrides": overrides,
      "seeds": seeds,
      "tasks": list(_TASKS.value),
      "arms": arms,
    },
    title,
  )
  print()
  print(compare.markdown(cells))
  print(
    f"\nwrote {results_dir}/results.json, table.md, reward_curves.png, final_reward.png, k3.png"
  )


if __name__ == "__main__":
  app.run(main)
