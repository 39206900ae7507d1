"""The files of one RL run's workdir, and what may go wrong with them.

  <workdir>/checkpoints/    orbax checkpoints: policy, optimizer, reference, step (`Checkpoints`)
  <workdir>/metrics.jsonl   one line per step (and the step-0 evaluation), appended and fsynced
  <workdir>/warmstart/      the SFT warm start, made once and reused (`run.warmstart`)
  <workdir>/summary.json    the run's summary (`run.report`)
  <workdir>/run.lock        held by the run in progress (`utils.lock`: one run per workdir)
  <workdir>/run.json        the run's config, recorded when it starts (`RUN_RECORD`)
  <workdir>/tensorboard/    metrics.jsonl's scalars and the config as TensorBoard events,
                            rewritten from metrics.jsonl on every start (`run.tensorboard`)
  <workdir>/wandb.json      with --wandb: the W&B run it logs to and the last step logged
                            there (`run.wandb_log`)

Everything is checked before any work, on every start: the workdir lies neither in the HF
checkpoint the run starts from nor in another run's checkpoints/, warmstart/ or tensorboard/
(`check_workdir_place`), and is writable; the config recorded in run.json, and the one in
each readable checkpoint, is this run's (else a ValueError naming the fields that differ, so
a second run never takes over a finished one's files, with or without checkpoints); `steps`
may change only where the learning-rate schedule does not depend on it
(lr_decay="constant"), and never below the step the run there reached (nor to it again once
its summary.json reports it: a start would rewrite its records for fewer steps;
`experiments/eval.py` evaluates a run); `checkpoints` is a directory;
metrics.jsonl reads and every line's step is an integer. A workdir that holds a run's files
but no record of its config (written before run.json existed, or by something else) is
refused unless a checkpoint there holds the config. A resume uses the newest checkpoint that
restores and verifies, and cuts metrics.jsonl back to the steps that checkpoint holds, so
every step's line appears exactly once (in metrics.jsonl and in the TensorBoard events).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import weakref

import jax
from flax import nnx

from trace_jax.rl.config import RLConfig
from trace_jax.rl.step import RLState, step_key
from trace_jax.run import report, tensorboard, wandb_log, warmstart
from trace_jax.run.checkpoint import CheckpointError, Checkpoints
from trace_jax.training.optim import LayerStacked
from trace_jax.utils import append_jsonl, read_jsonl, write_atomic
from trace_jax.utils.distributed import is_main_process
from trace_jax.utils.lock import lock_run_workdir

log = logging.getLogger(__name__)

RUN_RECORD = "run.json"
# Files of a run: a workdir holding any of them without a record of its config is refused.
RUN_FILES = ("metrics.jsonl", "summary.json")
# The folders a run manages inside its workdir: no other run's workdir may lie in them.
RUN_FOLDERS = ("checkpoints", warmstart.WARMSTART_DIR, tensorboard.DIRECTORY)


def check_workdir(workdir: str) -> str:
  """An absolute, writable workdir (created), or a ValueError before any work."""
  path = os.path.abspath(workdir)
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write_test.{os.getpid()}")  # one per process (multi-host)
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"workdir {workdir!r} is not writable: {e}") from e
  return path


def check_workdir_place(workdir: str, hf_checkpoint: str = "") -> None:
  """A ValueError, before anything is written, for a workdir whose files would land among
  another's: equal to or inside the `hf_checkpoint` directory the run starts from, or inside
  one of another run's own folders (`RUN_FOLDERS`: its checkpoints, warm start, TensorBoard
  events; that run prunes or rewrites them). Paths compare after resolving symbolic links."""
  path = os.path.realpath(workdir)
  if hf_checkpoint:
    source = os.path.realpath(hf_checkpoint)
    if path == source or path.startswith(source + os.sep):
      where = "is" if path == source else "lies inside"
      raise ValueError(
        f"workdir {workdir!r} ({path}) {where} the hf_checkpoint directory "
        f"{hf_checkpoint!r} ({source}); a run writes its checkpoints, metrics and "
        "run.json into its workdir: use a --workdir outside the checkpoint"
      )
  inner = path
  while os.path.dirname(inner) != inner:
    run = os.path.dirname(inner)
    folder = os.path.basename(inner)
    if folder in RUN_FOLDERS and any(
      os.path.exists(os.path.join(run, name)) for name in (RUN_RECORD,) + RUN_FILES
    ):
      where = "is" if inner == path else "lies inside"
      raise ValueError(
        f"workdir {workdir!r} ({path}) {where} {inner}, the {folder}/ "
        f"folder of the run in {run}; that run manages the folder's contents: use a "
        "--workdir outside it"
      )
    inner = run


def on_devices(config: RLConfig, workdir: str) -> RLConfig:
  """`config` with RLConfig.mesh's -1 axis resolved on this job's devices
  (`RLConfig.on_devices`): the devices left, or, resuming a run, the mesh its run.json
  records where the spec allows it and the devices hold it (a run keeps its mesh: one
  started on 4 devices, or with the old default 1,1,1, resumes on 8 as it ran). An
  unreadable record is left to `RunDir`, which refuses it."""
  if -1 not in config.mesh:
    return config
  recorded = None
  try:
    with open(os.path.join(os.path.abspath(workdir), RUN_RECORD), "rb") as f:
      saved = RLConfig.flat_dict(json.loads(f.read())["config"])
    recorded = tuple(int(m) for m in saved["mesh"])
  except (OSError, ValueError, KeyError, TypeError):
    pass
  resolved = config.on_devices(jax.device_count(), recorded)
  if recorded is not None and resolved.mesh == recorded:
    try:
      fresh = config.on_devices(jax.device_count()).mesh
    except ValueError:
      fresh = None  # the devices left would not take this run afresh
    if fresh != recorded:
      log.warning(
        "%s: resuming on the mesh %s its %s records (RLConfig.mesh=%s would be %s on this "
        "job's devices)",
        workdir,
        recorded,
        RUN_RECORD,
        config.mesh,
        fresh,
      )
  return resolved


def read_metrics(workdir: str) -> list[dict]:
  """The metrics lines of a run (a torn last line, from an interrupted append, dropped)."""
  return read_jsonl(os.path.join(os.path.abspath(workdir), "metrics.jsonl"))


_LAYOUTS = {
  "by_layer_stack": "by layer stack (scan_layers)",
  "per_layer": "per layer (no scan_layers)",
}


def _optimizer_layout(state: RLState) -> str:
  """How `state`'s optimizer holds its moments (`training.optim`)."""
  return "by_layer_stack" if isinstance(state.opt.tx, LayerStacked) else "per_layer"


class RunDir:
  """One run's workdir (see the module docstring), for the run of `config`.

  The workdir is locked from the first line on (`utils.lock`: a second run on it is refused
  before anything is written) until `close()`, garbage collection or the process's exit."""

  def __init__(self, workdir: str, config: RLConfig, *, reopen: bool = False):
    """reopen: open a finished run to read its final policy (a post-training evaluation):
    the run may have reached `config`'s steps, and its run.json is left as it is."""
    self._events, self._close_events = None, None  # the TensorBoard log, opened on `restore`
    self._wandb, self._close_wandb = None, None  # the W&B run (--wandb), opened with it
    check_workdir_place(workdir, config.source.hf_checkpoint)  # before the lock writes
    self._unlock = weakref.finalize(self, _release, lock_run_workdir(workdir))
    try:
      self.config = config
      self.path = check_workdir(workdir)
      checkpoints = os.path.join(self.path, "checkpoints")
      if os.path.lexists(checkpoints) and not os.path.isdir(checkpoints):
        raise ValueError(
          f"{checkpoints} is not a directory; a run keeps its checkpoints there (move it "
          "away, or use another --workdir)"
        )
      events = os.path.join(self.path, tensorboard.DIRECTORY)
      if config.evaluation.tensorboard and is_main_process():
        tensorboard.check_available()
        if os.path.islink(events) or (os.path.lexists(events) and not os.path.isdir(events)):
          raise ValueError(
            f"{events} is not a directory (a file or a symbolic link); a run rewrites its "
            "TensorBoard events there whole on every start (move it away, use another "
            "--workdir, or run with --tensorboard=false)"
          )
      if config.evaluation.wandb and is_main_process():
        wandb_log.check_available()
        wandb_log.read_state(self.path)  # a damaged record: refused before any work
      self.metrics_path = os.path.join(self.path, "metrics.jsonl")
      records = []
      if os.path.exists(self.metrics_path):  # a damaged log fails here, before any work
        records = read_jsonl(self.metrics_path)
        _check_steps(self.metrics_path, records)
      if not reopen:
        self._refuse_going_back(checkpoints, records)
      recorded = self._check_record()
      self.checkpoints = Checkpoints(checkpoints)
      self._check_saved_config(recorded)
      if is_main_process() and not reopen:
        write_atomic(
          os.path.join(self.path, RUN_RECORD),
          json.dumps({"config": config.to_dict()}, indent=1) + "\n",
        )
    except BaseException:
      self.close()
      raise

  def close(self) -> None:
    """Write the TensorBoard events still queued and release the workdir's lock (idempotent)."""
    try:
      for close in (self._close_events, self._close_wandb):
        if close is not None:
          close()
    finally:
      self._unlock()

  def _refuse_other(self, saved: dict, where: str) -> None:
    """A ValueError if the config `saved` (from `where`) is not this run's."""
    differing = self.config.differences(saved)  # ignores steps and RESUMABLE_FIELDS
    if differing:
      raise ValueError(
        f"{self.path} holds {where} of a different config; fields that "
        f"differ: {differing} (use another --workdir)"
      )
    saved_steps = RLConfig.flat_dict(saved).get("steps")
    steps, decay = self.config.schedule.steps, self.config.schedule.lr_decay
    if saved_steps is not None and saved_steps != steps and decay != "constant":
      raise ValueError(
        f"{self.path} holds {where} of a run of steps={saved_steps}, and its lr_decay="
        f"{decay!r} schedule is built from steps; resume it with --steps={saved_steps}, "
        "or use another --workdir. A run that can be extended later starts with "
        "--lr_decay=constant (with --lr_warmup_steps if wanted): its learning rate does "
        "not depend on --steps"
      )

  def _refuse_going_back(self, checkpoints: str, records: list[dict]) -> None:
    """A ValueError, before anything is written, when the run here already went as far as
    this one would: `steps` below the step it reached (its newest checkpoint, or its last
    metrics line), or equal to it once its summary.json reports that step. Starting would
    rewrite its run.json and summary.json for fewer steps (or none) and train nothing."""
    saved = [int(n) for n in _listdir(checkpoints) if n.isdigit()]
    reached = max(saved + [r["step"] for r in records], default=None)
    steps = self.config.schedule.steps
    if reached is None or steps > reached:
      return
    if steps == reached and _summary_steps(self.path) != reached:
      return  # it trained its steps, but its report was not written (or is of fewer)
    evaluate = f"python experiments/eval.py --workdir={shlex.quote(self.path)}"
    if steps < reached:
      why = f"already reached step {reached}, past steps={steps}"
    else:
      why = f"already finished its steps={steps} (summary.json): nothing is left to run"
    raise ValueError(
      f"{self.path}: the run there {why}, and starting it again would rewrite its records; "
      f"evaluate it with `{evaluate}`, go on with --steps above {reached}, or use another "
      "--workdir"
    )

  def _check_record(self) -> bool:
    """Refuse a start whose config is not the one run.json records; whether there is one."""
    path = os.path.join(self.path, RUN_RECORD)
    if not os.path.exists(path):
      return False
    try:
      with open(path, "rb") as f:
        record = json.loads(f.read())
      saved = record["config"]
      if not isinstance(saved, dict):
        raise TypeError(f"its config is a {type(saved).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(
        f"{path} does not read as this workdir's run record ({type(e).__name__}: {e}); "
        "nothing of the run there can be checked (use another --workdir)"
      ) from e
    self._refuse_other(saved, f"a run record ({RUN_RECORD})")
    return True

  def _check_saved_config(self, recorded: bool) -> None:
    """Refuse a resume with another config (from the newest readable checkpoint meta); with
    no run.json and no readable checkpoint meta, refuse a workdir holding a run's files, or
    say that nothing could be compared."""
    steps = self.checkpoints.all_steps()
    for step in steps:
      try:
        saved = self.checkpoints.read_meta(step)["config"]
      except Exception:  # noqa: BLE001 - a damaged checkpoint: restore skips it and says so
        continue
      self._refuse_other(saved, f"a checkpoint (step {step})")
      return
    if recorded:
      return
    found = [name for name in RUN_FILES if os.path.exists(os.path.join(self.path, name))]
    if found:
      raise ValueError(
        f"{self.path} holds {', '.join(found)} of a run whose config is recorded nowhere "
        f"(no {RUN_RECORD}, no readable checkpoint); starting here would overwrite them "
        "(use another --workdir)"
      )
    if steps:
      log.warning(
        "%s: no checkpoint's metadata reads (steps %s) and there is no %s: nothing could be "
        "compared with this run's config; the resume goes on unchecked",
        self.path,
        sorted(steps),
        RUN_RECORD,
      )

  def warm_start(
    self, policy, task, tokenizer, *, greedy=None, mesh=None, progress: bool = True
  ) -> dict:
    """Restore <workdir>/warmstart into `policy`, or make it (`warmstart.load_or_train`;
    `greedy`, the run's greedy RolloutConfig, plays its level checks)."""
    config = self.config
    return warmstart.load_or_train(
      policy,
      self.path,
      task,
      tokenizer,
      steps=config.source.sft_steps,
      batch=config.source.sft_batch,
      seed=config.seed,
      learning_rate=config.source.sft_learning_rate,
      target=config.source.sft_target,
      greedy=greedy,
      source=warmstart.source_settings(
        model=config.source.hf_checkpoint or config.source.preset,
        task_options=config.task_options,
        prompt_format=config.source.prompt_format,
        system_prompt=config.source.system_prompt,
        observation_role=config.source.observation_role,
        chat_template_options=config.source.chat_template_options,
      ),
      progress=progress,
      mesh=mesh,
    )

  @staticmethod
  def _arrays(state: RLState, extra: dict | None = None) -> dict:
    arrays = {"policy": nnx.state(state.policy), "opt": nnx.state(state.opt)}
    if state.reference is not None:
      arrays["reference"] = nnx.state(state.reference)
    return {**arrays, **(extra or {})}

  def restore(self, state: RLState, extra: dict | None = None) -> RLState:
    """`state` with the newest usable checkpoint restored into it (as it is if none), and
    metrics.jsonl cut back to the steps it holds. `extra`: more nnx.States saved beside the
    state ({name: state}, restored in place; an asynchronous run's older weight versions)."""
    try:
      found = self.checkpoints.restore_latest(self._arrays(state, extra))
    except CheckpointError as e:
      hint = self._layout_hint(state)
      if hint is None:
        raise
      raise CheckpointError(f"{e} {hint}") from e
    if found is not None:
      _, restored, meta = found
      nnx.update(state.policy, restored["policy"])
      nnx.update(state.opt, restored["opt"])
      if state.reference is not None:
        nnx.update(state.reference, restored["reference"])
      step = int(meta["step"])
      state = state.replace(step=step, version=int(meta.get("version", step)))
    self._truncate_metrics(state.step)
    return state

  def _layout_hint(self, state: RLState) -> str | None:
    """Why the newest checkpoint cannot restore into `state` when its optimizer's state is
    laid out otherwise (saved by layer stack under scan_layers, or per layer without);
    None when the layouts agree or its metadata does not read."""
    steps = self.checkpoints.all_steps()
    try:
      meta = self.checkpoints.read_meta(steps[0]) if steps else None
    except Exception:  # noqa: BLE001 - damaged metadata: nothing to compare
      return None
    if meta is None:
      return None
    saved, wanted = meta.get("optimizer_layout", "per_layer"), _optimizer_layout(state)
    if saved == wanted:
      return None
    return (
      f"Its optimizer state is stored {_LAYOUTS[saved]}, this run's {_LAYOUTS[wanted]}: resume "
      f"with --scan_layers={str(saved == 'by_layer_stack').lower()}, as it was saved."
    )

  def save(self, state: RLState, extra: dict | None = None) -> None:
    """Checkpoint `state` (and `extra`, as `restore` takes it) at its step."""
    meta = {
      "step": state.step,
      "config": self.config.to_dict(),
      "seed_key": [int(x) for x in jax.random.key_data(step_key(self.config.seed, state.step))],
      "version": state.version,
      "optimizer_layout": _optimizer_layout(state),
    }
    self.checkpoints.save(state.step, self._arrays(state, extra), meta)

  def last_good(self) -> str:
    """Which checkpoint a rerun after a failure of the current step resumes from."""
    saved = self.checkpoints.latest_step()
    if saved is None:
      return "no checkpoint was saved before it"
    return (
      f"the latest checkpoint, step {saved} in {self.checkpoints.directory}, is the last "
      f"good one and a rerun resumes from it"
    )

  def _truncate_metrics(self, step: int) -> None:
    """Keep only the metrics lines of the steps the resumed checkpoint holds (none when
    starting from step 0: the run logs the step-0 evaluation again); a torn last line goes.
    The TensorBoard events are then rewritten from the lines kept."""
    if not is_main_process():
      return
    kept = []
    if os.path.exists(self.metrics_path):
      kept = [r for r in read_jsonl(self.metrics_path) if step > 0 and r.get("step", 0) <= step]
      write_atomic(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
    self._open_events(kept)

  def _open_events(self, records: list[dict]) -> None:
    """The TensorBoard log (`run.tensorboard`), rewritten from `records`, and the W&B run
    (`run.wandb_log`), given the lines of `records` it lacks (once; main process, each with
    its flag only)."""
    evaluation = self.config.evaluation
    if self._events is None and evaluation.tensorboard:
      self._events = tensorboard.EventLog(self.path, records, self.config.to_dict())
      # queued events are written at close, garbage collection or the process's exit
      self._close_events = weakref.finalize(self, self._events.close)
    if self._wandb is None and evaluation.wandb:
      self._wandb = wandb_log.WandbLog(
        self.path, records, self.config.to_dict(), project=evaluation.wandb_project
      )
      self._close_wandb = weakref.finalize(self, self._wandb.close)

  def log(self, metrics: dict) -> None:
    """Append one line to metrics.jsonl (and queue it for the TensorBoard events, log it to
    the W&B run)."""
    if is_main_process():  # multi-host: one metrics file, written once
      evaluation = self.config.evaluation
      if (self._events is None and evaluation.tensorboard) or (
        self._wandb is None and evaluation.wandb
      ):  # without a `restore`
        exists = os.path.exists(self.metrics_path)
        self._open_events(read_jsonl(self.metrics_path) if exists else [])
      append_jsonl(self.metrics_path, metrics)
      for sink in (self._events, self._wandb):
        if sink is not None:
          sink.log(metrics)

  def read_metrics(self) -> list[dict]:
    return read_metrics(self.path)

  def write_summary(self, summary: dict) -> None:
    report.write_summary(self.path, summary)


def _check_steps(path: str, records: list[dict]) -> None:
  """A ValueError naming the line of metrics.jsonl whose record has no integer step."""
  for number, record in enumerate(records, 1):
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise ValueError(
        f"{path}: record {number} has step={step!r}; every line of a run's metrics is a "
        "JSON object with an integer step >= 0 (move the file away, or use another --workdir)"
      )


def _summary_steps(workdir: str):
  """The steps the run's summary.json reports; None if there is none that reads."""
  try:
    with open(os.path.join(workdir, "summary.json"), "rb") as f:
      summary = json.loads(f.read())
  except (OSError, ValueError):
    return None
  return summary.get("steps") if isinstance(summary, dict) else None


def _listdir(path: str) -> list[str]:
  """The names in directory `path`; none if it is not one."""
  return os.listdir(path) if os.path.isdir(path) else []


def _release(lock) -> None:
  if lock is not None:
    lock.release()
