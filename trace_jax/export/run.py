"""Export the last checkpoint of an RL run (`experiments/rl.py --workdir=...`)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.export import calibration
from trace_jax.export.compressed_tensors import export_compressed_tensors, tensor_listing
from trace_jax.model.quant import QuantConfig
from trace_jax.rl.checkpoint import Checkpoints
from trace_jax.rl.config import RLConfig
from trace_jax.rl.grpo import LossConfig
from trace_jax.rl.trainer import Trainer
from trace_jax.utils.io import write_json


def config_from_meta(saved: dict) -> RLConfig:
  """The RLConfig a checkpoint's metadata was written from."""
  fields = dict(saved)
  # (configs saved before RLConfig.correction became the one knob hold "tis" here)
  fields["loss"] = LossConfig(**{**fields["loss"], "rollout_correction": "none"})
  fields["task_options"] = tuple(tuple(kv) for kv in fields.get("task_options", ()))
  fields["mesh"] = tuple(fields.get("mesh", (1, 1, 1)))
  return RLConfig(**fields)


def load_run(workdir: str) -> Trainer:
  """A Trainer restored from the latest checkpoint of `workdir` (no training is run)."""
  checkpoints = Checkpoints(os.path.join(os.path.abspath(workdir), "checkpoints"))
  latest = checkpoints.latest_step()
  if latest is None:
    raise ValueError(f"workdir={workdir!r} holds no checkpoint (run experiments/rl.py first)")
  config = config_from_meta(checkpoints.read_meta(latest)["config"])
  return Trainer(config, workdir, progress=False)


def _rollout_tokens(trainer: Trainer, seed: int, count: int):
  """Sequences (prompt + sampled response) from the run's own FP4 rollout engine."""
  items = trainer.task.sample(seed, count)
  rollout = trainer.engine.generate(trainer._prompt_ids(items), jax.random.key(seed))
  return np.asarray(rollout.tokens), np.asarray(rollout.mask), np.asarray(rollout.positions)


def export_run(
  workdir: str,
  out_dir: str,
  *,
  hf_checkpoint: str | None = None,
  fmt: str = "nvfp4",
  activations: str = "none",
  calibration_prompts: int = 64,
  seed: int = 12345,
) -> dict:
  """Export the run's policy as a compressed-tensors checkpoint; returns a summary.

  The FP4 scope is the run's rollout QuantConfig (its format replaced by `fmt`). For NVFP4
  W4A4, input global scales are calibrated on `calibration_prompts` rollouts of the run's
  task, and their distance from per-token quantization is measured on as many held-out ones.
  """
  trainer = load_run(workdir)
  quant = trainer.engine.config.quant
  quant = QuantConfig(fmt=fmt) if quant is None else quant.replace(fmt=fmt)
  dtype = jnp.dtype(trainer.config.compute_dtype)
  scales, distance = None, None
  if activations == "nvfp4":
    tokens, mask, positions = _rollout_tokens(trainer, seed, calibration_prompts)
    scales = calibration.calibrate_input_scales(
      trainer.policy, quant, tokens, mask, positions=positions, dtype=dtype
    )
    tokens, mask, positions = _rollout_tokens(trainer, seed + 1, calibration_prompts)
    distance = calibration.input_scale_distance(
      trainer.policy, quant, scales, tokens, mask, positions=positions, dtype=dtype
    )
  summary = export_compressed_tensors(
    trainer.policy,
    out_dir,
    source=hf_checkpoint or trainer.config.hf_checkpoint or None,
    fmt=fmt,
    activations=activations,
    quant=quant,
    input_scales=scales,
  )
  summary.update(step=trainer.step, arm=trainer.config.arm, preset=trainer.config.preset)
  if distance is not None:
    summary["input_scale_distance"] = distance
  write_json(os.path.join(out_dir, "export_summary.json"), summary)
  return summary


def format_listing(out_dir: str) -> str:
  """The checkpoint's tensors as a markdown table."""
  lines = ["| tensor | dtype | shape |", "| --- | --- | --- |"]
  lines += [f"| {n} | {d} | {list(s)} |" for n, d, s in tensor_listing(out_dir)]
  return "\n".join(lines)


def describe(summary: dict) -> str:
  qc = summary["quantization_config"]
  return json.dumps(
    {k: summary[k] for k in ("out_dir", "files", "tensors", "bytes", "step")}
    | {"format": qc["format"], "ignore": len(qc["ignore"])},
    indent=1,
  )
