"""The main job: RL of a small MoE policy from FP4 rollouts, with TRACE guidance by default.

  python experiments/rl.py                                   # small, arith, arm trace, ~7 min on 2 cores
  python experiments/rl.py --arm=fp4-qat --seed=1 --steps=30
  python experiments/rl.py --arm=trace --fp4_sites=experts+kv --fmt=mxfp4 --steps=30
  python experiments/rl.py --task=search --max_new_tokens=6  # multi-turn
  python experiments/rl.py --workdir=runs/x                  # resumes if runs/x holds a checkpoint

Arms: bf16, fp4-rollout (FP4 rollout, bf16 training + TIS), fp4-qat (FP4 QAT, nearest),
trace (guided QAT: compact, deeper half, routing replay), trace-full, ptq (bf16 training,
evaluated in FP4). Writes <workdir>/metrics.jsonl, summary.json, reward.png, mismatch.png
and prints a final table. A warm start (SFT on solver demonstrations) is made in the workdir
first unless one is there.
"""

import contextlib
import os
import sys
import time

from absl import app, flags, logging

from trace_jax.rl import report
from trace_jax.rl.checkpoint import CheckpointError
from trace_jax.rl.config import ARMS, RLConfig
from trace_jax.rl.grpo import LossConfig
from trace_jax.rl.trainer import Trainer, read_metrics
from trace_jax.utils import distributed

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default runs/<arm>-<task>-<time>).")
_ARM = flags.DEFINE_string("arm", "trace", f"One of {sorted(ARMS)}.")
_TASK = flags.DEFINE_string("task", "arith", "Task: arith, coding, search, or rg:<name>.")
_TASK_OPTIONS = flags.DEFINE_list("task_options", [], "key=value options of the task (ints parsed).")
_D = RLConfig()
_PRESET = flags.DEFINE_string("preset", _D.preset, "Model preset.")
_STEPS = flags.DEFINE_integer("steps", _D.steps, "RL steps.")
_SEED = flags.DEFINE_integer("seed", _D.seed, "Seed of everything random.")
_PROMPTS = flags.DEFINE_integer("prompts_per_step", _D.prompts_per_step, "Problems per step.")
_GROUP = flags.DEFINE_integer("group_size", _D.group_size, "Samples per problem.")
_NEW = flags.DEFINE_integer("max_new_tokens", _D.max_new_tokens, "Max tokens per turn.")
_TEMP = flags.DEFINE_float("temperature", _D.temperature, "Sampling temperature.")
_LR = flags.DEFINE_float("learning_rate", _D.learning_rate, "Adam learning rate.")
_MINIBATCHES = flags.DEFINE_integer("minibatches", 2, "Updates per step.")
_CLIP_LOW = flags.DEFINE_float("clip_low", 0.2, "Ratio clip below: 1 - clip_low.")
_CLIP_HIGH = flags.DEFINE_float("clip_high", 0.28, "Ratio clip above: 1 + clip_high.")
_AGG = flags.DEFINE_enum("aggregation", "token", ["token", "sequence"], "Loss aggregation.")
_STD = flags.DEFINE_bool("std_norm", True, "Divide advantages by the group std.")
_KL = flags.DEFINE_float("kl_coef", 0.0, "KL-to-reference weight.")
_CORR = flags.DEFINE_enum("rollout_correction", "auto", ["auto", "tis", "mask", "none"],
                          "Correction on pi_old / pi_rollout (auto: TIS for fp4-rollout).")
_TIS = flags.DEFINE_float("tis_threshold", 2.0, "TIS truncation / masking threshold.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", _D.eval_every, "Greedy evaluation period (steps).")
_EVAL_SIZE = flags.DEFINE_integer("eval_size", _D.eval_size, "Evaluation problems.")
_SFT = flags.DEFINE_integer("sft_steps", _D.sft_steps, "Warm-start SFT steps (when the workdir has none).")
_CKPT = flags.DEFINE_integer("checkpoint_every", _D.checkpoint_every,
                             "Checkpoint period in steps (and at the last step); 0 = never.")
_MESH = flags.DEFINE_list("mesh", ["1", "1", "1"], "data,expert,model device counts.")
_DTYPE = flags.DEFINE_enum("compute_dtype", "bfloat16", ["bfloat16", "float32"], "Activations.")
_FP4_SITES = flags.DEFINE_string("fp4_sites", _D.fp4_sites,
                                 "FP4 scope: all, or experts+kv (the method's: routed experts and KV cache).")
_FMT = flags.DEFINE_string("fmt", _D.fmt, "FP4 format: nvfp4 or mxfp4.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "Multi-host: HOST:PORT of process 0 (with --num_processes and "
                                   "--process_id; default: the cluster environment, if any).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's id.")
_REMAT = flags.DEFINE_bool("remat", _D.remat, "Recompute each block's activations in the "
                          "backward pass (see experiments/plan.py).")


def _options():
  out = []
  for kv in _TASK_OPTIONS.value:
    if "=" not in kv:
      raise app.UsageError(f"--task_options expects key=value, got {kv!r}")
    k, v = kv.split("=", 1)
    out.append((k, int(v) if v.lstrip("-").isdigit() else v))
  return tuple(out)


def main(argv):
  with _run_errors():
    _main(argv)


@contextlib.contextmanager
def _run_errors():
  """Faults of the run (damaged files, a full disk, divergence) end it with one line that
  says what failed and where (their messages name the path and what to do), exit status 1;
  only bad flags are usage errors (app.UsageError passes through)."""
  try:
    yield
  except (ValueError, OSError, FloatingPointError, CheckpointError) as e:
    print(f"rl.py: error: {e}", file=sys.stderr)
    sys.exit(1)


def _main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax and JAX log every save at INFO
  distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  try:
    config = RLConfig(
        arm=_ARM.value, task=_TASK.value, task_options=_options(), preset=_PRESET.value,
        seed=_SEED.value, steps=_STEPS.value, prompts_per_step=_PROMPTS.value,
        group_size=_GROUP.value, max_new_tokens=_NEW.value, temperature=_TEMP.value,
        learning_rate=_LR.value, minibatches=_MINIBATCHES.value,
        loss=LossConfig(clip_low=_CLIP_LOW.value, clip_high=_CLIP_HIGH.value,
                        aggregation=_AGG.value, std_norm=_STD.value, kl_coef=_KL.value,
                        tis_threshold=_TIS.value),
        correction=_CORR.value, eval_every=_EVAL_EVERY.value, eval_size=_EVAL_SIZE.value,
        sft_steps=_SFT.value, checkpoint_every=_CKPT.value,
        mesh=tuple(int(m) for m in _MESH.value), compute_dtype=_DTYPE.value,
        fp4_sites=_FP4_SITES.value, fmt=_FMT.value, remat=_REMAT.value)
  except (ValueError, ImportError) as e:  # bad flags, and only those, are usage errors
    raise app.UsageError(str(e)) from e
  workdir = _WORKDIR.value or os.path.join(
      "runs", f"{config.arm}-{config.task.replace(':', '_')}-{time.strftime('%Y%m%d-%H%M%S')}")
  start = time.time()
  trainer = Trainer(config, workdir)
  print(f"workdir {trainer.workdir}; warm start: {trainer.warmstart}")
  trainer.run()
  if not distributed.is_main_process():  # process 0 writes the summary and plots
    return
  metrics = read_metrics(trainer.workdir)
  summary = report.summarize(config, metrics, time.time() - start, trainer.warmstart)
  report.write_summary(trainer.workdir, summary)
  plots = report.plot(metrics, trainer.workdir, f"{config.arm} on {config.task} ({config.preset})")
  print()
  print(report.final_table(metrics))
  print(f"\n{config.arm} on {config.task}: greedy {summary['eval_precision']} eval reward "
        f"{summary['initial_eval_reward']} -> {summary['final_eval_reward']}, mean k3_kl "
        f"{summary['mean_k3_kl']:.3e}, guidance {summary['guidance_bytes_per_token']:.0f} B/token, "
        f"rollout {summary['rollout_seconds']:.0f} s, train {summary['train_seconds']:.0f} s, "
        f"wall {summary['wall_seconds']:.0f} s")
  print(f"wrote {os.path.join(trainer.workdir, 'summary.json')}, metrics.jsonl, "
        f"{', '.join(os.path.basename(p) for p in plots)}")
  print(f"export for vLLM: python experiments/export.py --workdir={trainer.workdir} --out={trainer.workdir}/export")


if __name__ == "__main__":
  app.run(main)
