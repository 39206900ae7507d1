"""The rollout path: FP4 (or bf16) generation with a KV cache and TRACE guidance capture."""

from trace_jax.rollout.config import SamplingConfig, RolloutConfig
from trace_jax.rollout.engine import RolloutEngine, generate
from trace_jax.rollout.trajectories import (
  FINISH_LENGTH,
  FINISH_NAMES,
  FINISH_RUNNING,
  FINISH_STOP,
  Rollout,
)
from trace_jax.rollout.params import params_nbytes, quantize_params
from trace_jax.rollout.sampling import filter_logits, sample, sequence_keys
