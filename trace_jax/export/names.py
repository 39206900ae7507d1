"""Hugging Face names and config.json of our parameters, for an export: the same per-family
tables `model.hf` reads with (`model.archs`), written in the other direction."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from trace_jax.model.archs import Target, get_arch
from trace_jax.model.config import ModelConfig
from trace_jax.model.hf import config_from_hf


def targets(cfg: ModelConfig, path: tuple) -> Iterator[Target]:
  """The HF tensors of one of our parameters (one per expert for stacked experts)."""
  return get_arch(cfg.arch).names.targets(path, cfg.num_experts)


def hf_array(value: np.ndarray, target: Target) -> np.ndarray:
  """Our array (or one field of a packed weight) in the HF layout of `target`."""
  if target.expert is not None:
    value = value[target.expert]
  if target.conv1d:
    return np.swapaxes(value, 0, 1)[:, None, :]
  return np.swapaxes(value, -1, -2) if target.linear else value


def hf_config(cfg: ModelConfig) -> dict:
  """A config.json for a policy without a source checkpoint (e.g. an RL run from a preset).

  Raises:
    ValueError: when the architecture cannot express the ModelConfig (e.g. a shared expert
      or a QK-norm kind the HF class does not have), naming the fields that differ.
  """
  hf = get_arch(cfg.arch).hf_config(cfg)
  back = config_from_hf(hf)
  # delta_chunk_size is how we compute the delta rule, not a property of the checkpoint.
  ignored = ("name", "dtype", "dispatch", "init_std", "delta_chunk_size") + (
    () if cfg.dense_layers else ("ffn_dim",)
  )
  fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ignored]
  differ = [f for f in fields if getattr(back, f) != getattr(cfg, f)]
  if differ:
    raise ValueError(
      f"the policy's ModelConfig cannot be written as a {cfg.arch} config.json: "
      f"fields {differ} would read back as "
      f"{[getattr(back, f) for f in differ]}, not {[getattr(cfg, f) for f in differ]}"
    )
  return hf
