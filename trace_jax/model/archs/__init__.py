"""Hugging Face model families: each one module with its two-way name table and config.json
mapping (`table.Arch`), found by `ModelConfig.arch`."""

from trace_jax.model.archs.table import (
  Arch,
  Checkpoint,
  NameTable,
  SliceSource,
  Target,
  detect_arch,
  get_arch,
)
