"""Evaluate a checkpoint alone: greedy pass@1, and pass@k / mean@k from sampled answers, in
FP4 and in bf16.

  python experiments/eval.py --workdir=runs/x                        # the latest checkpoint
  python experiments/eval.py --workdir=runs/x --samples=4            # + pass@1, 2, 4, mean@4
  python experiments/eval.py --workdir=runs/x --step=20 --samples=16 --k=1,8,16
  python experiments/eval.py --workdir=runs/x --task=dataset:data/test.jsonl --eval_size=200
  python experiments/eval.py --hf_checkpoint=tests/fixtures/hf/qwen3_moe --task=arith \
      --eval_size=8 --max_new_tokens=8 --samples=4 --precisions=bf16

A run's checkpoint is evaluated on the run's own evaluation problems (its task, eval seed
and eval_size: the greedy reward at a step is the one the run logged there), with its FP4
scheme, sampling temperature and max_new_tokens; --task, --task_options, --eval_size,
--max_new_tokens and --temperature change them. An HF checkpoint needs --task (the rest
are RLConfig's defaults, its prompts rendered with its own chat template).

pass@k is the unbiased estimator of Chen et al. (2021) from --samples=n answers per
problem, 1 - C(n - c, k) / C(n, k) with c of them solved (reward 1), for k = 1, 2, 4, ...
and n (or --k); mean@n is the mean reward of all n answers. Each figure is printed with
its standard error across problems (none for one problem).

Writes into its own folder (--out; default evals/<run>-step<N>-<task>-<time>, or
evals/<checkpoint>-<task>-<time>, beside the runs/ folder rl.py makes): results.json (every
figure, the settings and the config), results.md (the table printed) and problems.jsonl
(per precision and problem: the prompt, the target, the greedy answer and reward, each
sample's answer and reward, c and pass@k). The run's workdir is only read (no lock is taken:
a run in progress can be evaluated); --out may not lie inside it, nor inside the checkpoint.
Bad flags are refused in one line before any weight is read.
"""

import sys

from absl import app, flags, logging

from trace_jax.run.checkpoint import CheckpointError
from trace_jax.studies import evaluation
from trace_jax.utils import flags as config_flags

_WORKDIR = flags.DEFINE_string("workdir", None, "RL run directory (experiments/rl.py --workdir).")
_STEP = flags.DEFINE_integer("step", None, "The run's checkpoint step (default: the latest).")
_HF = flags.DEFINE_string(
  "hf_checkpoint", None, "A Hugging Face checkpoint directory instead of a run (needs --task)."
)
_TASK = flags.DEFINE_string(
  "task",
  None,
  "Task: arith, chain, chain_flawed, coding, search, rg:<name> or dataset:PATH "
  "(default: the run's).",
)
_TASK_OPTIONS = flags.DEFINE_list(
  "task_options", None, "key=value options of the task (default: the run's, with its task)."
)
_EVAL_SIZE = flags.DEFINE_integer(
  "eval_size", None, "Problems (a held-out split whole when this covers it; default: the run's)."
)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Max tokens per turn (default: the run's).")
_TEMPERATURE = flags.DEFINE_float(
  "temperature", None, "Sampling temperature of --samples (default: the run's)."
)
_SAMPLES = flags.DEFINE_integer(
  "samples", 0, "Sampled answers per problem (n) for pass@k and mean@n; 0: greedy only."
)
_K = flags.DEFINE_list("k", None, "pass@k's k, each in [1, --samples] (default: 1, 2, 4, ..., n).")
_PRECISIONS = flags.DEFINE_list(
  "precisions", list(evaluation.EvalSettings.precisions), "Rollout precisions: fp4, bf16 or both."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the samples' key.")
_OUT = flags.DEFINE_string(
  "out", None, "Output folder, new or empty (default: evals/<run>-step<N>-<task>-<time>)."
)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  try:
    overrides = {
      name: flag.value
      for name, flag in (
        ("task", _TASK),
        ("eval_size", _EVAL_SIZE),
        ("max_new_tokens", _MAX_NEW),
        ("temperature", _TEMPERATURE),
      )
      if flag.value is not None
    }
    if _TASK_OPTIONS.value is not None:
      overrides["task_options"] = config_flags.parse_pairs("task_options", _TASK_OPTIONS.value)
    settings = evaluation.EvalSettings(
      samples=_SAMPLES.value,
      ks=config_flags.parse_ints("k", _K.value or []),
      precisions=tuple(_PRECISIONS.value),
      seed=_SEED.value,
    )
    results = evaluation.evaluate(
      workdir=_WORKDIR.value,
      step=_STEP.value,
      hf_checkpoint=_HF.value,
      out=_OUT.value,
      settings=settings,
      overrides=overrides,
      progress=_PROGRESS.value,
    )
  except (ValueError, OSError, CheckpointError) as e:  # one line: what, where, what to do
    print(f"eval.py: error: {e}", file=sys.stderr)
    sys.exit(1)
  print(evaluation.describe(results))
  print(evaluation.table(results))
  out = results["out"]
  print(f"wrote {out}/{evaluation.RESULTS}, {evaluation.TABLE}, {evaluation.PROBLEMS}")


if __name__ == "__main__":
  app.run(main)
