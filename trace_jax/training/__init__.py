"""The training path: QAT forward (nearest or rollout-guided rounding), log-probs, SFT."""

from trace_jax.training.forward import (
  check_guidance,
  token_entropy,
  token_logprobs,
  training_forward,
)
from trace_jax.training.sft import sft_batch, sft_loss, train_sft
