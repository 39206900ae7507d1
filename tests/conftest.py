"""Shared test setup: float32 matmuls at full precision so reference comparisons are exact."""

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def policy():
  """A freshly initialised tiny MoE policy (seed 0), one per test module that asks for it
  (a module may override it with its own preset)."""
  from flax import nnx  # noqa: PLC0415 - keeps collection of unrelated tests light
  from trace_jax import model as M  # noqa: PLC0415
  return M.Transformer(M.tiny(), rngs=nnx.Rngs(0))
