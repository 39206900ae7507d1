"""RL, the algorithm: arms, one step as functions over `RLState`, weight sync, the GRPO loss,
mismatch metrics and the run's config. The driver (the loop, the workdir) is `trace_jax.run`."""

from trace_jax.rl.arms import ARMS, Arm, get_arm
from trace_jax.rl.config import RLConfig
from trace_jax.rl.grpo import LossConfig, grpo_loss
from trace_jax.rl.metrics import disagreement_metrics, fp4_disagreement, mismatch_metrics
from trace_jax.rl.step import RLState, StepSpec, collect, score, step_metrics, update
from trace_jax.rl.sync import WeightSync
