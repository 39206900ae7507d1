"""Export the last checkpoint of an RL run (`experiments/rl.py --workdir=...`).

What is exported is what the run used: its FP4 format, FP4 scope and activations come from
the RLConfig saved in the checkpoint (`export_settings`); a setting given here must agree
with it, or the export is refused naming both values.

The run is only read, never written: its policy is restored from the latest checkpoint into
an abstract model (no Trainer: no warm start made, no metrics rewritten, no lock taken), and
the checkpoint directory is opened read-only. A run still in progress can be exported (its
checkpoints appear whole or not at all, and each is verified against its checksums): the
export takes its latest finished checkpoint and says that the run is still going.
"""

from __future__ import annotations

import contextlib
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.export import calibration
from trace_jax.export.compressed_tensors import (
  check_out_dir,
  export_compressed_tensors,
  source_files,
  tensor_listing,
)
from trace_jax.model.sharding import make_mesh, param_shardings
from trace_jax.rl import data, episodes
from trace_jax.run import policy_source
from trace_jax.run.checkpoint import Checkpoints
from trace_jax.rl.config import RLConfig
from trace_jax.rollout.engine import RolloutEngine
from trace_jax.tasks.registry import get_task
from trace_jax.utils import lock
from trace_jax.utils.io import check_writable_folder

log = logging.getLogger(__name__)

# RLConfig.fp4.activations (how the run's linear inputs ran) -> ExportConfig.activations
# (compressed-tensors' input scheme), for a run of format `fmt`; None: no such scheme here.
ACTIVATIONS_OF_RUN = {"fp4": lambda fmt: fmt, "fp8": lambda fmt: None}


def config_from_meta(saved: dict) -> RLConfig:
  """The RLConfig a checkpoint's metadata was written from (nested, or saved flat)."""
  return RLConfig.from_dict(saved)


def export_settings(
  config: RLConfig,
  *,
  fmt: str | None = None,
  activations: str | None = None,
  fp4_sites: str | None = None,
) -> tuple[str, str, str]:
  """(fmt, activations, fp4_sites) of the export: the run's, where a setting is None.

  Activations map explicitly: the run's "fp4" (W4A4) exports as W4A4 in its format; "none"
  (weight-only, W4A16: the rollout's weight bytes, activations in bf16) may be asked for on
  any run. The run's "fp8" (W4A8: MXFP8 E4M3 linear inputs) has no compressed-tensors scheme
  here, so such a run exports only weight-only, and only when asked.

  Raises:
    ValueError: a setting contradicts the run (naming both values), or the run's
      activations cannot be exported.
  """
  for name, given, run in (
    ("fmt", fmt, config.fp4.fmt),
    ("fp4_sites", fp4_sites, config.fp4.sites),
  ):
    if given is not None and given != run:
      raise ValueError(
        f"--{name}={given} contradicts the run's {name}={run!r} (its rollouts and QAT ran "
        f"in {name}={run!r}); leave --{name} unset: the export follows the run"
      )
  run_acts = ACTIVATIONS_OF_RUN[config.fp4.activations](config.fp4.fmt)
  if activations is None:
    if run_acts is None:
      raise ValueError(
        f"the run's activations={config.fp4.activations!r} (W4A8: linear inputs in MXFP8 "
        f"E4M3) has no compressed-tensors export here; --activations=none exports its "
        f"{config.fp4.fmt} weights weight-only (W4A16)"
      )
    activations = run_acts
  elif activations not in ("none", run_acts):
    allowed = "none" if run_acts is None else f"{run_acts} (as the run) or none (weight-only)"
    raise ValueError(
      f"--activations={activations} contradicts the run's activations="
      f"{config.fp4.activations!r} with fmt={config.fp4.fmt!r}; use {allowed}"
    )
  return config.fp4.fmt, activations, config.fp4.sites


def open_checkpoints(workdir: str) -> Checkpoints:
  """The run's checkpoints, opened read-only; a ValueError if there are none."""
  folder = os.path.abspath(workdir)
  if not os.path.isdir(folder):
    what = "is not a folder" if os.path.exists(folder) else "does not exist"
    raise ValueError(
      f"workdir={workdir!r} {what} ({folder}); give the --workdir of an experiments/rl.py run"
    )
  checkpoints = os.path.join(folder, "checkpoints")
  if not os.path.isdir(checkpoints):
    raise ValueError(
      f"workdir={workdir!r} holds no checkpoint (run experiments/rl.py with "
      f"--checkpoint_every > 0 first)"
    )
  opened = Checkpoints(checkpoints, read_only=True)
  if opened.latest_step() is None:
    raise ValueError(f"workdir={workdir!r} holds no checkpoint (run experiments/rl.py first)")
  return opened


def check_step(checkpoints: Checkpoints, workdir: str, step) -> None:
  """A ValueError unless `step` is one of the checkpoints' steps (naming those there)."""
  steps = sorted(checkpoints.all_steps())
  if isinstance(step, bool) or not isinstance(step, int) or step not in steps:
    raise ValueError(
      f"step={step!r}: workdir {workdir!r} holds the checkpoints of steps {steps}; use one "
      "of them (default: the latest)"
    )


class SavedRun:
  """A run's config and one checkpoint's policy (the latest by default), read without
  writing anything.

  Attributes:
    config: the RLConfig of the checkpoint.
    source: the run's tokenizer, architecture and stop tokens (`policy_source.load`).
    policy: the Transformer restored from the checkpoint.
    step: the checkpoint's step: `step` if given, else the latest that restores.
  """

  def __init__(self, workdir: str, step: int | None = None):
    self.workdir = os.path.abspath(workdir)
    self.checkpoints = open_checkpoints(workdir)
    latest = step is None  # else that step, or an error: no older one in its place
    if latest:
      step = self.checkpoints.latest_step()
    else:
      check_step(self.checkpoints, workdir, step)
    self.config = config_from_meta(self.checkpoints.read_meta(step)["config"])
    self.task = get_task(self.config.task, **dict(self.config.task_options))
    self.source = policy_source.load(self.config, self.task, weights=False)
    self.mesh = _mesh(self.config)
    graphdef, state = nnx.split(self.source.policy)
    if self.mesh is not None:  # restored straight into the run's shardings
      state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        state,
        param_shardings(self.source.policy, self.mesh),
      )
    if latest:  # verified, policy only
      self.step, restored, _ = self.checkpoints.restore_latest({"policy": state})
    else:
      self.step, restored = step, self.checkpoints.restore(step, {"policy": state})
    self.policy = nnx.merge(graphdef, restored["policy"])

  def rollout_tokens(self, seed: int, count: int):
    """Sequences (prompt + sampled response) of `count` of the run's problems, from an FP4
    rollout engine with the run's own settings (format, scope, activations, sampling)."""
    base = episodes.rollout_configs(self.config, self.task, self.source)[0]
    engine = RolloutEngine(
      self.policy, base.replace(precision="fp4", guidance="none"), mesh=self.mesh
    )
    items = self.task.sample(seed, count)
    prompts = [data.prompt_ids(self.source.tokenizer, item) for item in items]
    rollout = engine.generate(prompts, jax.random.key(seed))
    return np.asarray(rollout.tokens), np.asarray(rollout.mask), np.asarray(rollout.positions)


def _mesh(config: RLConfig):
  """The run's device mesh where this machine has its devices (a large policy then restores
  sharded, as it trained), else None: one device."""
  if np.prod(config.mesh) == 1 or jax.device_count() < np.prod(config.mesh):
    return None
  return make_mesh(*config.mesh)


def _check_out_dir(out_dir: str, workdir: str) -> None:
  """The export folder is replaced whole: it must not hold the run, nor anything but an
  earlier export (`compressed_tensors.check_out_dir`)."""
  out, run = os.path.realpath(out_dir), os.path.realpath(workdir)
  if run == out or run.startswith(out + os.sep):
    raise ValueError(
      f"out={out_dir!r} holds the run's workdir {workdir!r}; the export replaces its folder "
      f"whole: use a folder of its own, e.g. {os.path.join(workdir, 'export')}"
    )
  check_out_dir(out_dir)


def export_run(
  workdir: str,
  out_dir: str,
  *,
  hf_checkpoint: str | None = None,
  fmt: str | None = None,
  activations: str | None = None,
  fp4_sites: str | None = None,
  calibration_prompts: int = 64,
  seed: int = 12345,
) -> dict:
  """Export the run's policy as a compressed-tensors checkpoint; returns a summary.

  Format, FP4 scope and activations are the run's (`export_settings`; None = the run's).
  For NVFP4 W4A4, input global scales are calibrated on `calibration_prompts` rollouts of
  the run's task, and their distance from per-token quantization is measured on as many
  held-out ones. `out_dir` is written whole or not at all (an earlier export there is
  replaced, none of its files left); nothing in `workdir` is written.

  Raises:
    ValueError: before the policy is loaded or calibrated, for an `out_dir` that may not
      be replaced (`compressed_tensors.check_out_dir`, or one holding the run) or cannot
      be written (a file made and removed beside it, `io.check_writable_folder`), a
      `calibration_prompts` below 1, or a `workdir` that does not exist; and for any
      setting `export_settings` refuses.
    OSError: reading the run or the source, or writing the export, failed: its message
      says which, why and the file.
  """
  if isinstance(calibration_prompts, bool) or not isinstance(calibration_prompts, int):
    raise ValueError(
      f"calibration_prompts={calibration_prompts!r} is not a whole number; use one >= 1"
    )
  if calibration_prompts < 1:
    raise ValueError(
      f"calibration_prompts={calibration_prompts} is not allowed: use a whole number >= 1 "
      "(the rollouts that calibrate the NVFP4 W4A4 input scales, and as many again that "
      "measure them)"
    )
  _check_out_dir(out_dir, workdir)
  # the export is staged beside out_dir and renamed into place: writable before any work
  check_writable_folder(os.path.dirname(os.path.abspath(out_dir)), f"out_dir={out_dir!r}")
  busy = lock.current_holder(workdir)
  with _naming(f"reading the run in {workdir}"):
    run = SavedRun(workdir)
  if busy is not None:
    log.warning(
      "workdir %s is in use by %s (a run in progress): exporting its latest finished "
      "checkpoint, step %d",
      run.workdir,
      lock.describe(busy or None),
      run.step,
    )
  fmt, activations, sites = export_settings(
    run.config, fmt=fmt, activations=activations, fp4_sites=fp4_sites
  )
  source = hf_checkpoint or run.config.source.hf_checkpoint or None
  check_out_dir(out_dir, source)  # the source is known now: checked before calibrating
  if source is not None:
    with _naming(f"reading the source checkpoint {source}"):
      source_files(source)  # every file it gives resolves inside it
  quant = run.config.fp4  # the run's scheme: its rollouts' format, scope, activations, KV
  dtype = jnp.dtype(run.config.compute_dtype)
  scales, distance = None, None
  if activations == "nvfp4":
    tokens, mask, positions = run.rollout_tokens(seed, calibration_prompts)
    scales = calibration.calibrate_input_scales(
      run.policy, quant, tokens, mask, positions=positions, dtype=dtype
    )
    tokens, mask, positions = run.rollout_tokens(seed + 1, calibration_prompts)
    distance = calibration.input_scale_distance(
      run.policy, quant, scales, tokens, mask, positions=positions, dtype=dtype
    )
  extra = dict(
    step=run.step,
    arm=run.config.arm,
    preset=run.config.source.preset,
    fmt=fmt,
    activations=activations,
    fp4_sites=sites,
    workdir=run.workdir,
  )
  if distance is not None:
    extra["input_scale_distance"] = distance
  with _naming(f"writing the export to {out_dir}"):
    return export_compressed_tensors(
      run.policy,
      out_dir,
      source=source,
      fmt=fmt,
      activations=activations,
      quant=quant,
      input_scales=scales,
      summary_extra=extra,
    )


@contextlib.contextmanager
def _naming(action: str):
  """An OSError inside says what failed in one line: `action`, the reason and the file (its
  errno kept)."""
  try:
    yield
  except OSError as e:
    where = f" ({e.filename})" if e.filename else ""
    raise OSError(e.errno, f"{action} failed: {e.strerror or e}{where}") from e


def format_listing(out_dir: str) -> str:
  """The checkpoint's tensors as a markdown table."""
  lines = ["| tensor | dtype | shape |", "| --- | --- | --- |"]
  lines += [f"| {n} | {d} | {list(s)} |" for n, d, s in tensor_listing(out_dir)]
  return "\n".join(lines)


def describe(summary: dict, *, verbose: bool = False) -> str:
  """What experiments/export.py prints: one line (what was exported from where, its scheme,
  tensors, bytes and files, and for NVFP4 W4A4 how far the calibrated static input scales
  are from per-token ones), after the per-tensor listing with `verbose`."""
  qc = summary["quantization_config"]
  scheme = (
    "W4A16 (weight-only)"
    if summary.get("activations") in (None, "none")
    else f"W4A4 ({summary['activations']} activations)"
  )
  files = summary["files"]
  line = (
    f"exported step {summary.get('step')} of {summary.get('workdir')} to {summary['out_dir']}: "
    f"{qc['format']}, {scheme}, fp4_sites={summary.get('fp4_sites')}; {summary['tensors']} "
    f"tensors ({len(qc['ignore'])} modules kept in bf16), {_size(summary['bytes'])} in "
    f"{len(files)} file{'s' if len(files) > 1 else ''}"
  )
  distance = summary.get("input_scale_distance")
  if distance:
    line += "; static input scales vs per-token: " + ", ".join(
      f"{key} {value:.3g}" for key, value in distance.items()
    )
  return f"{format_listing(summary['out_dir'])}\n{line}" if verbose else line


def _size(count: int) -> str:
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if count >= scale:
      return f"{count / scale:.1f} {unit}"
  return f"{count} bytes"
