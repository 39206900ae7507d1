"""ModelConfig.remat: the same loss and gradients as the unrolled model, fewer kept residuals."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax.model.quant import QuantConfig
from trace_jax.plan import _dependent_residual_bytes


def _loss(model, tokens, quant):
  aux = model(tokens[:, :-1], quant=quant)
  logp = jax.nn.log_softmax(aux.logits)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)) + 0.01 * aux.lb_loss


@pytest.mark.parametrize("preset", ["tiny", pytest.param("qwen3_5_tiny", marks=pytest.mark.slow)])
def test_remat_matches_unrolled(preset):
  quant = QuantConfig()  # FP4 QAT: the straight-through quantizers run under remat too
  tokens = jax.random.randint(jax.random.key(1), (2, 13), 0, 128)
  results = []
  for remat in (False, True):
    model = M.Transformer(M.get_preset(preset, remat=remat), rngs=nnx.Rngs(0))
    loss, grads = jax.jit(lambda m, t: nnx.value_and_grad(_loss)(m, t, quant))(model, tokens)
    results.append((loss, nnx.to_pure_dict(grads)))
  (loss, grads), (remat_loss, remat_grads) = results
  assert float(jnp.abs(loss)) > 0 and np.isfinite(float(loss))
  chex.assert_trees_all_close(remat_loss, loss, rtol=1e-6)
  chex.assert_trees_all_close(
    remat_grads, grads, rtol=1e-4, atol=1e-6
  )  # recompute: fused differently


def test_remat_keeps_fewer_activations():
  quant = QuantConfig()
  tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)

  def kept(remat):
    model = nnx.eval_shape(lambda: M.Transformer(M.tiny(remat=remat), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    fn = lambda s, t: _loss(nnx.merge(graphdef, s), t, quant)
    return _dependent_residual_bytes(fn, (state, tokens), {1})

  assert kept(True) < kept(False) / 2
