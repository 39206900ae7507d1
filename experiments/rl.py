"""The main job: RL of a small MoE policy from FP4 rollouts, with TRACE guidance by default.

  python experiments/rl.py                 # small, chain (held-out eval), arm trace, <10 min on 2 cores
  python experiments/rl.py --arm=fp4-qat --seed=1 --steps=30
  python experiments/rl.py --arm=trace --fp4_sites=experts+kv --fmt=mxfp4 --steps=30
  python experiments/rl.py --arm=trace --fmt=mxfp4 --activations=fp8 --steps=30  # W4A8
  python experiments/rl.py --task=search --max_new_tokens=6  # multi-turn
  python experiments/rl.py --workdir=runs/x                  # resumes if runs/x holds a checkpoint
  python experiments/rl.py --hf_checkpoint=tests/fixtures/hf/qwen3_moe --steps=2  # a local HF model
  python experiments/rl.py --hf_checkpoint=DIR --system_prompt="Answer after #." \
      --chat_template_options=enable_thinking=false

Arms: bf16, fp4-rollout (FP4 rollout, bf16 training + TIS), fp4-qat (FP4 QAT, nearest),
trace (guided QAT: compact, deeper half, routing replay), trace-full, ptq (bf16 training,
evaluated in FP4). Writes <workdir>/metrics.jsonl, summary.json, reward.png, mismatch.png
and prints a final table. A warm start (SFT on solver demonstrations) is made in the workdir
first unless one is there (by default not for --hf_checkpoint: --sft_warm_start forces it).
A workdir is one run's at a time: a second rl.py on a workdir in use is refused (exit 1) with
one line naming the holder, before it writes anything (`trace_jax.utils.lock`).
With --hf_checkpoint the weights, tokenizer (tokenizer.json), special tokens and chat template
(tokenizer_config.json) and stop tokens (generation_config.json) all come from that directory,
and prompts are rendered with the model's own chat template (--prompt_format=raw for a base
model without one).
"""

import contextlib
import dataclasses
import math
import os
import sys
import time

from absl import app, flags, logging

from trace_jax.run import report
from trace_jax.run.checkpoint import CheckpointError
from trace_jax.rl.arms import RUNNABLE
from trace_jax.rl.config import REWARD_CONTROLS, RLConfig
from trace_jax.rl.grpo import AGGREGATIONS, CORRECTIONS
from trace_jax.run.rundir import read_metrics
from trace_jax.run.trainer import Trainer
from trace_jax.utils import distributed

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default runs/<arm>-<task>-<time>).")
_D = RLConfig()  # every flag's default is the config classes' own
_L = _D.loss
_ARM = flags.DEFINE_string("arm", _D.arm, f"One of {sorted(RUNNABLE)}.")
_TASK = flags.DEFINE_string("task", _D.task, "Task: arith, coding, search, or rg:<name>.")
_TASK_OPTIONS = flags.DEFINE_list(
  "task_options",
  [f"{k}={v}" for k, v in _D.task_options],
  "key=value options of the task (numbers parsed).",
)
_PRESET = flags.DEFINE_string("preset", _D.preset, "Model preset.")
_STEPS = flags.DEFINE_integer("steps", _D.steps, "RL steps.")
_SEED = flags.DEFINE_integer("seed", _D.seed, "Seed of everything random.")
_PROMPTS = flags.DEFINE_integer("prompts_per_step", _D.prompts_per_step, "Problems per step.")
_GROUP = flags.DEFINE_integer("group_size", _D.group_size, "Samples per problem.")
_NEW = flags.DEFINE_integer("max_new_tokens", _D.max_new_tokens, "Max tokens per turn.")
_TEMP = flags.DEFINE_float("temperature", _D.temperature, "Sampling temperature.")
_LR = flags.DEFINE_float("learning_rate", _D.learning_rate, "Adam learning rate.")
_MINIBATCHES = flags.DEFINE_integer("minibatches", _D.minibatches, "Updates per epoch.")
_EPOCHS = flags.DEFINE_integer("epochs", _D.epochs, "Passes over each rollout batch.")
_WARMUP = flags.DEFINE_integer(
  "lr_warmup_steps", _D.lr_warmup_steps, "RL steps of linear LR warmup from learning_rate / 10."
)
_CLIP_LOW = flags.DEFINE_float("clip_low", _L.clip_low, "Ratio clip below: 1 - clip_low.")
_CLIP_HIGH = flags.DEFINE_float("clip_high", _L.clip_high, "Ratio clip above: 1 + clip_high.")
_AGG = flags.DEFINE_enum("aggregation", _L.aggregation, list(AGGREGATIONS), "Loss aggregation.")
_STD = flags.DEFINE_bool("std_norm", _L.std_norm, "Divide advantages by the group std.")
_KL = flags.DEFINE_float("kl_coef", _L.kl_coef, "KL-to-reference weight.")
_CORR = flags.DEFINE_enum(
  "rollout_correction",
  _D.correction,
  ["auto", *CORRECTIONS],
  "Correction on pi_old / pi_rollout (auto: the arm's; TIS for fp4-rollout).",
)
_TIS = flags.DEFINE_float("tis_threshold", _L.tis_threshold, "TIS truncation / masking threshold.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", _D.eval_every, "Greedy evaluation period (steps).")
_EVAL_SIZE = flags.DEFINE_integer("eval_size", _D.eval_size, "Evaluation problems.")
_SFT = flags.DEFINE_integer(
  "sft_steps", _D.sft_steps, "Warm-start SFT steps (when the workdir has none)."
)
_CKPT = flags.DEFINE_integer(
  "checkpoint_every",
  _D.checkpoint_every,
  "Checkpoint period in steps (and at the last step); 0 = never.",
)
_MESH = flags.DEFINE_list("mesh", [str(m) for m in _D.mesh], "data,expert,model device counts.")
_DTYPE = flags.DEFINE_enum(
  "compute_dtype", _D.compute_dtype, ["bfloat16", "float32"], "Activations."
)
_FP4_SITES = flags.DEFINE_string(
  "fp4_sites",
  _D.fp4_sites,
  "FP4 scope: all, or experts+kv (the method's: routed experts and KV cache).",
)
_FMT = flags.DEFINE_string("fmt", _D.fmt, "FP4 format: nvfp4 or mxfp4.")
_SPARSE_DELTA = flags.DEFINE_float(
  "sparse_delta",
  _D.sparse_delta,
  "Arm trace-sparse: margin around an E2M1 midpoint (grid "
  "units) within which an element's bit is recorded.",
)
_ACTIVATIONS = flags.DEFINE_string(
  "activations", _D.activations, "fp4 (W4A4) or fp8 (W4A8: linear inputs in MXFP8 E4M3)."
)
_HF = flags.DEFINE_string(
  "hf_checkpoint",
  _D.hf_checkpoint,
  "Local HF checkpoint directory to start from (its weights, tokenizer, "
  "chat template, stop tokens) instead of --preset.",
)
_SFT_WARM = flags.DEFINE_bool(
  "sft_warm_start",
  _D.sft_warm_start,
  "SFT warm start on solver demonstrations (default: yes for a preset, no for --hf_checkpoint).",
)
_PROMPT_FORMAT = flags.DEFINE_enum(
  "prompt_format",
  _D.prompt_format,
  ["auto", "chat", "raw"],
  "Prompts: the checkpoint's chat template, or raw text (auto: chat with --hf_checkpoint).",
)
_SYSTEM = flags.DEFINE_string(
  "system_prompt", _D.system_prompt, "System turn of the chat template (needs --hf_checkpoint)."
)
_OBS_ROLE = flags.DEFINE_enum(
  "observation_role",
  _D.observation_role,
  ["user", "tool"],
  "Chat turn that carries multi-turn observations.",
)
_CHAT_OPTIONS = flags.DEFINE_list(
  "chat_template_options", [], "key=value chat template variables, e.g. enable_thinking=false."
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address",
  None,
  "Multi-host: HOST:PORT of process 0 (with --num_processes and "
  "--process_id; default: the cluster environment, if any).",
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's id.")
_REWARD_CONTROL = flags.DEFINE_enum(
  "reward_control",
  _D.reward_control,
  list(REWARD_CONTROLS),
  "shuffle: a placebo run, rewards permuted across the batch before the advantages (the "
  "optimizer's noise, no signal); compare it with the real run.",
)
_REMAT = flags.DEFINE_bool(
  "remat",
  _D.remat,
  "Recompute each block's activations in the backward pass (see experiments/plan.py).",
)


def _options(flag=_TASK_OPTIONS):
  """key=value pairs of a list flag; ints and floats (and, for chat options, true/false)
  parsed."""
  out = []
  for kv in flag.value:
    if "=" not in kv:
      raise app.UsageError(f"--{flag.name} expects key=value, got {kv!r}")
    k, v = kv.split("=", 1)
    out.append((k, _parse_value(v, bools=flag is _CHAT_OPTIONS)))
  return tuple(out)


def _parse_value(text: str, bools: bool):
  if text.lstrip("-").isdigit():
    return int(text)
  try:
    number = float(text)
  except ValueError:
    return {"true": True, "false": False}.get(text.lower(), text) if bools else text
  return number if math.isfinite(number) else text


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
      arm=_ARM.value,
      task=_TASK.value,
      task_options=_options(),
      preset=_PRESET.value,
      seed=_SEED.value,
      steps=_STEPS.value,
      prompts_per_step=_PROMPTS.value,
      group_size=_GROUP.value,
      max_new_tokens=_NEW.value,
      temperature=_TEMP.value,
      learning_rate=_LR.value,
      minibatches=_MINIBATCHES.value,
      epochs=_EPOCHS.value,
      lr_warmup_steps=_WARMUP.value,
      loss=dataclasses.replace(
        _L,
        clip_low=_CLIP_LOW.value,
        clip_high=_CLIP_HIGH.value,
        aggregation=_AGG.value,
        std_norm=_STD.value,
        kl_coef=_KL.value,
        tis_threshold=_TIS.value,
      ),
      correction=_CORR.value,
      eval_every=_EVAL_EVERY.value,
      eval_size=_EVAL_SIZE.value,
      sft_steps=_SFT.value,
      checkpoint_every=_CKPT.value,
      mesh=tuple(int(m) for m in _MESH.value),
      compute_dtype=_DTYPE.value,
      fp4_sites=_FP4_SITES.value,
      fmt=_FMT.value,
      activations=_ACTIVATIONS.value,
      sparse_delta=_SPARSE_DELTA.value,
      hf_checkpoint=_HF.value,
      sft_warm_start=_SFT_WARM.value,
      prompt_format=_PROMPT_FORMAT.value,
      system_prompt=_SYSTEM.value,
      observation_role=_OBS_ROLE.value,
      chat_template_options=_options(_CHAT_OPTIONS),
      remat=_REMAT.value,
      reward_control=_REWARD_CONTROL.value,
    )
  except (ValueError, ImportError) as e:  # bad flags, and only those, are usage errors
    raise app.UsageError(str(e)) from e
  workdir = _WORKDIR.value or os.path.join(
    "runs", f"{config.arm}-{config.task.replace(':', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"
  )
  start = time.time()
  with Trainer(config, workdir) as trainer:  # the workdir is this run's until the end
    print(f"workdir {trainer.workdir}; warm start: {trainer.warmstart}")
    trainer.run()
    if distributed.is_main_process():  # process 0 writes the summary and plots
      _report(config, trainer, start)


def _report(config: RLConfig, trainer: Trainer, start: float) -> None:
  """The summary, plots and final table of a finished run, and how to export it."""
  if not os.path.exists(trainer.metrics_path):  # --steps=0 --eval_every=0: a warm start only
    print(f"nothing run (0 RL steps, no evaluation); warm start: {trainer.warmstart}")
    return
  metrics = read_metrics(trainer.workdir)
  summary = report.summarize(config, metrics, time.time() - start, trainer.warmstart)
  report.write_summary(trainer.workdir, summary)
  model = os.path.basename(config.hf_checkpoint) if config.hf_checkpoint else config.preset
  plots = report.plot(metrics, trainer.workdir, f"{config.arm} on {config.task} ({model})")
  print()
  print(report.final_table(metrics))
  print(
    f"\n{config.arm} on {config.task}: greedy {summary['eval_precision']} eval reward "
    f"{summary['initial_eval_reward']} -> {summary['final_eval_reward']}, mean k3_kl "
    f"{summary['mean_k3_kl']:.3e}, guidance {summary['guidance_bytes_per_token']:.0f} B/token, "
    f"rollout {summary['rollout_seconds']:.0f} s, train {summary['train_seconds']:.0f} s, "
    f"wall {summary['wall_seconds']:.0f} s"
  )
  print(
    f"wrote {os.path.join(trainer.workdir, 'summary.json')}, metrics.jsonl, "
    f"{', '.join(os.path.basename(p) for p in plots)}"
  )
  print(export_command(trainer))


def export_command(trainer: Trainer) -> str:
  """How to export this run: no format flags, the export reads them from the checkpoint."""
  if trainer.checkpoints.latest_step() is None:
    return "no checkpoint saved (--checkpoint_every=0): nothing to export"
  command = (
    f"python experiments/export.py --workdir={trainer.workdir} --out={trainer.workdir}/export"
  )
  if trainer.config.activations == "fp8":  # W4A8 has no compressed-tensors scheme here
    command += " --activations=none"
  return f"export for vLLM ({trainer.config.fmt}, fp4_sites={trainer.config.fp4_sites}): {command}"


if __name__ == "__main__":
  app.run(main)
