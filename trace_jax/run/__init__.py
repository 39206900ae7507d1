"""The driver of an RL run, on top of `trace_jax.rl`: the Trainer loop and the workdir's files
(checkpoints, metrics, warm start, the policy source, the report)."""
