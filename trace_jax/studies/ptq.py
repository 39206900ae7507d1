"""Post-training quantization baselines: a trained policy quantized to FP4 afterwards.

`ptq` is the rollout path's own weight quantization applied to the bf16 arm's final policy
(its FP4 evaluation). `ptq-46` packs the same policy's linear weights with the "4over6"
block-scale rule (fp4.quantize: per block, amax -> 6 or amax -> 4, whichever reconstructs
the block better) and evaluates it through the same FP4 engine (activations and KV cache
quantized as in every FP4 rollout): the engine passes packed weights through as they are.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from trace_jax import fp4
from trace_jax.model.quant import QuantConfig, scale_groups
from trace_jax.model.quantizer import quantize_weight_group
from trace_jax.rl import episodes as episodes_lib


def packed_policy(policy, quant: QuantConfig, *, scale_rule: str):
  """A copy of `policy` whose FP4 linear weights (in `quant`'s scope) are packed QArrays made
  with `scale_rule`; siblings share one global scale as on the rollout path."""
  if scale_rule not in fp4.SCALE_RULES:
    raise ValueError(f"scale_rule={scale_rule!r} is not allowed; use one of {fp4.SCALE_RULES}")
  graphdef, state = nnx.split(policy)
  flat = list(nnx.to_flat_state(state))
  by_path = dict(flat)
  packed = {}
  for group in scale_groups(flat, quant):
    qs = quantize_weight_group(
      [by_path[path].get_value() for path in group], quant.fmt, scale_rule=scale_rule
    )
    packed.update(zip(group, qs))
  out = [
    (path, variable.replace(packed[tuple(path)]) if tuple(path) in packed else variable)
    for path, variable in flat
  ]
  return nnx.merge(graphdef, nnx.from_flat_state(out))


def ptq_eval_reward(trainer, scale_rule: str) -> float:
  """Greedy FP4 reward of `trainer`'s current policy packed with `scale_rule`, on the
  trainer's own evaluation problems (the same engine settings as its FP4 evaluation)."""
  engine_cls = type(trainer.eval_engines["fp4"])
  config = trainer.eval_engines["fp4"].config
  policy = packed_policy(trainer.policy, config.quant, scale_rule=scale_rule)
  engine = engine_cls(policy, config, mesh=trainer.mesh)
  played = episodes_lib.play(
    engine, trainer.task, trainer.tokenizer, trainer.eval_items, jax.random.key(0)
  )
  return float(np.mean(played.rewards))
