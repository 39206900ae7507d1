"""Shared test setup: float32 matmuls at full precision so reference comparisons are exact."""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
