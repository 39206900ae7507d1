"""RL: GRPO-family losses, the trainer loop, and training-inference mismatch metrics."""

from trace_jax.rl.metrics import (
  code_disagreement,
  disagreement_metrics,
  fp4_disagreement,
  guidance_agreement,
  mismatch_metrics,
)
