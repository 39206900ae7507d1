"""Post-training quantization baselines: the packed policy against the rollout's own packing."""

import numpy as np
from flax import nnx

from trace_jax import fp4
from trace_jax.model.config import get_preset
from trace_jax.model.quant import QuantConfig
from trace_jax.model.transformer import Transformer
from trace_jax.studies import ptq
from trace_jax.rollout.params import quantize_params


def _flat(state):
  return {tuple(path): v.get_value() for path, v in nnx.to_flat_state(state)}


def test_packed_policy_matches_the_rollout_packing_and_4over6_differs():
  seed = 19
  policy = Transformer(get_preset("tiny"), rngs=nnx.Rngs(seed))
  quant = QuantConfig()
  rollout = _flat(quantize_params(nnx.state(policy), quant))
  standard = _flat(nnx.state(ptq.packed_policy(policy, quant, scale_rule="standard")))
  four = _flat(nnx.state(ptq.packed_policy(policy, quant, scale_rule="4over6")))
  packed = [k for k, v in rollout.items() if isinstance(v, fp4.QArray)]
  assert packed and all(isinstance(standard[k], fp4.QArray) for k in packed)
  changed = 0
  for k in packed:  # the standard rule is the rollout's packing, bit for bit
    for field in ("packed", "scales", "global_scale"):
      np.testing.assert_array_equal(
        np.asarray(getattr(standard[k], field)), np.asarray(getattr(rollout[k], field))
      )
    np.testing.assert_array_equal(
      np.asarray(four[k].global_scale), np.asarray(rollout[k].global_scale)
    )
    changed += int(np.sum(np.asarray(four[k].scales) != np.asarray(rollout[k].scales)))
    # 4over6 never reconstructs a weight worse than the standard rule
    err4 = np.sum((np.asarray(fp4.dequantize(four[k])) - np.asarray(_master(policy, k))) ** 2)
    err6 = np.sum((np.asarray(fp4.dequantize(rollout[k])) - np.asarray(_master(policy, k))) ** 2)
    assert err4 <= err6 * (1 + 1e-6)
  assert changed > 0
  # The policy itself keeps its float master weights.
  assert not any(isinstance(v, fp4.QArray) for v in _flat(nnx.state(policy)).values())


def _master(policy, key):
  return _flat(nnx.state(policy))[key]
