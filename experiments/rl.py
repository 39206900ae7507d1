"""The main job: RL of a small MoE policy from FP4 rollouts, with TRACE guidance by default.

  python experiments/rl.py                 # small, chain_flawed (held-out eval), arm trace, ~5 min on 2 cores
  python experiments/rl.py --arm=fp4-qat --seed=1 --steps=30
  python experiments/rl.py --arm=trace --fp4_sites=experts+kv --fmt=mxfp4 --steps=30
  python experiments/rl.py --arm=trace --fmt=mxfp4 --activations=fp8 --steps=30  # W4A8
  python experiments/rl.py --task=search --max_new_tokens=6  # multi-turn
  python experiments/rl.py --workdir=runs/x                  # resumes if runs/x holds a checkpoint
  python experiments/rl.py --hf_checkpoint=tests/fixtures/hf/qwen3_moe --steps=2  # a local HF model
  python experiments/rl.py --hf_checkpoint=DIR --system_prompt="Answer after #." \\
      --chat_template_options=enable_thinking=false

`--help` lists the run's flags by section (the arms and tasks under --arm and --task).
Writes <workdir>/metrics.jsonl, summary.json, reward.png, mismatch.png and prints a final
table. A warm start (SFT on solver demonstrations) is made in the workdir first unless one
is there (by default not for --hf_checkpoint: --sft_warm_start forces it).
A workdir is one run's at a time: a second rl.py on a workdir in use is refused (exit 1) with
one line naming the holder, before it writes anything (`trace_jax.utils.lock`).
With --hf_checkpoint the weights, tokenizer (tokenizer.json), special tokens and chat template
(tokenizer_config.json) and stop tokens (generation_config.json) all come from that directory,
and prompts are rendered with the model's own chat template (--prompt_format=raw for a base
model without one).
"""

import contextlib
import os
import shlex
import sys
import time

import matplotlib
from absl import app, flags, logging

from trace_jax.rl.config import RLConfig
from trace_jax.rl.pipeline import RolloutWorkerError
from trace_jax.run import policy_source, report
from trace_jax.run.checkpoint import CheckpointError
from trace_jax.run.remote_rollouts import LearnerError
from trace_jax.run.rundir import read_metrics
from trace_jax.run.trainer import Trainer
from trace_jax.tasks.dataset import DatasetError
from trace_jax.utils import distributed
from trace_jax.utils import flags as config_flags

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default runs/<arm>-<task>-<time>).")
# One flag per RLConfig field, by its flat name: the field's default and help.
_CONFIG = config_flags.define_flags(RLConfig)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address",
  None,
  "Multi-host: HOST:PORT of process 0 (with --num_processes and "
  "--process_id; default: the cluster environment, if any).",
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's id.")
HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort")


def help_text() -> str:
  """The module docstring and the run's flags by section (`utils.flags.grouped_help`)."""
  sections = config_flags.grouped_help(
    RLConfig,
    _CONFIG,
    extra={"run": [_WORKDIR], "scale-out": [_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID]},
  )
  return (
    f"{__doc__.strip()}\n\nFlags of the run, by section (--helpfull: every flag, also "
    f"JAX's and absl's):\n\n{sections}"
  )


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, but --help (-h, --helpshort) prints `help_text` and exits 0."""
  options = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
  if any(arg in HELP_FLAGS for arg in options):
    print(help_text())
    sys.exit(0)
  return app.parse_flags_with_usage(argv)


def main(argv):
  matplotlib.use("Agg")  # files, not windows: the script chooses the backend
  with _run_errors():
    _main(argv)


@contextlib.contextmanager
def _run_errors():
  """Faults of the run (damaged files, a full disk, divergence) end it with one line that
  says what failed and where (their messages name the path and what to do), exit status 1;
  only bad flags are usage errors (app.UsageError passes through)."""
  try:
    yield
  except (
    ValueError,
    OSError,
    FloatingPointError,
    CheckpointError,
    RolloutWorkerError,
    LearnerError,
  ) as e:
    print(f"rl.py: error: {e}", file=sys.stderr)
    sys.exit(1)


def _main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax and JAX log every save at INFO
  distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  try:
    config = config_flags.from_flags(RLConfig, _CONFIG)
    policy_source.preflight(config)  # the task's options, the checkpoint's files
  except DatasetError:  # the file's fault, not the flags': one line (_run_errors)
    raise
  except (ValueError, ImportError) as e:  # bad flags, and only those, are usage errors
    raise app.UsageError(str(e)) from e
  workdir = _WORKDIR.value or os.path.join(
    "runs", f"{config.arm}-{config.task.replace(':', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"
  )
  start, trainer = time.time(), None
  try:
    with Trainer(config, workdir) as trainer:  # the workdir is this run's until the end
      print(f"workdir {trainer.workdir}; {report.warmstart_line(trainer.warmstart)}")
      if distributed.is_main_process() and trainer.step > 0:
        print(f"resuming from step {trainer.step} (checkpoint {_checkpoint(trainer)})")
      trainer.run()
      if distributed.is_main_process():  # process 0 writes the summary and plots
        _report(config, trainer, start)
  except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (the workdir is released)
    print(interrupted_line(config, workdir, trainer), file=sys.stderr)
    sys.exit(130)


def _checkpoint(trainer: Trainer, step: int | None = None) -> str:
  return os.path.join(trainer.checkpoints.directory, str(trainer.step if step is None else step))


def _command(script: str, *args: str) -> str:
  """`python experiments/<script> ARGS`, shell-quoted (a path with a space stays one
  argument); the script's path as seen from here."""
  path = os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), script))
  if path.startswith(os.pardir):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
  return shlex.join(["python", path, *args])


def resume_command(workdir: str) -> str:
  """The command that continues this run: its workdir and the flags given to this one."""
  own = [_WORKDIR, _COORDINATOR, _NUM_PROCESSES, _PROCESS_ID, *_CONFIG.values()]
  given = [flags.FLAGS[h.name].serialize() for h in own if h.present and h is not _WORKDIR]
  return _command("rl.py", f"--workdir={workdir}", *given)


def interrupted_line(config: RLConfig, workdir: str, trainer: Trainer | None) -> str:
  """What an interrupted run reached and the command that resumes it, in one line: the
  run resumes from its newest checkpoint (metrics.jsonl is cut back to it on resume)."""
  steps = config.schedule.steps
  if trainer is None or not hasattr(trainer, "state"):
    return (
      f"rl.py: interrupted before the first RL step; to start it again: {resume_command(workdir)}"
    )
  saved = trainer.checkpoints.latest_step()
  after = (
    f"it resumes from the checkpoint of step {saved} ({_checkpoint(trainer, saved)})"
    if saved is not None
    else "no checkpoint was saved yet: it starts again from step 0 (the warm start is kept)"
  )
  return (
    f"rl.py: interrupted at step {trainer.step} of {steps}; {after}: "
    f"{resume_command(trainer.workdir)}"
  )


def _report(config: RLConfig, trainer: Trainer, start: float) -> None:
  """The summary, plots and final table of a finished run, and how to export it."""
  if not os.path.exists(trainer.metrics_path):  # --steps=0 --eval_every=0: a warm start only
    print(f"nothing run (0 RL steps, no evaluation); {report.warmstart_line(trainer.warmstart)}")
    return
  metrics = read_metrics(trainer.workdir)
  summary = report.summarize(config, metrics, time.time() - start, trainer.warmstart)
  report.write_summary(trainer.workdir, summary)
  model = (
    os.path.basename(config.source.hf_checkpoint)
    if config.source.hf_checkpoint
    else config.source.preset
  )
  plots = report.plot(metrics, trainer.workdir, f"{config.arm} on {config.task} ({model})")
  print()
  print(report.final_table(metrics))
  print(f"\n{config.arm} on {config.task}: {report.final_line(summary)}")
  print(
    f"wrote {os.path.join(trainer.workdir, 'summary.json')}, metrics.jsonl, "
    f"{', '.join(os.path.basename(p) for p in plots)}"
  )
  print(export_command(trainer))


def export_command(trainer: Trainer) -> str:
  """How to export this run: no format flags, the export reads them from the checkpoint."""
  if trainer.checkpoints.latest_step() is None:
    return "no checkpoint saved (--checkpoint_every=0): nothing to export"
  args = [f"--workdir={trainer.workdir}", f"--out={os.path.join(trainer.workdir, 'export')}"]
  if trainer.config.fp4.activations == "fp8":  # W4A8 has no compressed-tensors scheme here
    args.append("--activations=none")
  command = _command("export.py", *args)
  return (
    f"export for vLLM ({trainer.config.fp4.fmt}, fp4_sites={trainer.config.fp4.sites}): {command}"
  )


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
