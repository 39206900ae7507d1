"""trace_jax: RL for Mixture-of-Experts language models with FP4 rollouts (TRACE), in JAX."""

from trace_jax import fp4
