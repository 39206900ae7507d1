"""The RL run's optimizer: global-norm clipping, then Adam on a warmup-and-decay schedule
counted in optimizer updates."""

from __future__ import annotations

import functools
import math

import optax

from trace_jax.rl.config import LR_DECAYS, RLConfig
from trace_jax.training.optim import by_layer_stacks


def optimizer(
  learning_rate: float,
  warmup_updates: int = 0,
  decay: str = "constant",
  total_updates: int = 0,
  max_grad_norm: float = 1.0,
  by_layer: bool = False,
):
  """One transformation per schedule, so runs of one config share compiled steps.
  (`_optimizer`, cached by its arguments given in one way.)

  The gradient is clipped to global norm `max_grad_norm` before Adam.

  A linear warmup from lr / 10 over the first `warmup_updates` optimizer updates: Adam's
  first updates are sign-like (every parameter moves by ~lr whatever its gradient's size),
  which on a noisy RL gradient undoes part of the warm start. Then the learning rate stays
  (`decay="constant"`) or falls to lr / 10 at update `total_updates` ("cosine", "linear"):
  the last updates move the policy less, so its final evaluation is less one update's noise.
  A decay needs updates after the warmup (`total_updates > warmup_updates`); with
  `total_updates=0` (a run of no updates) there is nothing to decay and nothing is refused.

  by_layer: clip and Adam run over the parameters stacked by layer (`training.optim`), as a
  model under `scan_layers` is trained: its update compiles them once per parameter of a
  layer, not once per layer (the same arithmetic per element; the clip's global norm sums
  by stack, which can move its last bit).
  """
  return _optimizer(
    learning_rate, warmup_updates, decay, total_updates, max_grad_norm, bool(by_layer)
  )


@functools.lru_cache(maxsize=None)
def _optimizer(learning_rate, warmup_updates, decay, total_updates, max_grad_norm, by_layer):
  if decay not in LR_DECAYS:
    raise ValueError(f"lr_decay={decay!r} is not allowed; use one of {LR_DECAYS}")
  if not (
    isinstance(max_grad_norm, (int, float)) and math.isfinite(max_grad_norm) and max_grad_norm > 0
  ):
    raise ValueError(f"max_grad_norm={max_grad_norm!r} must be a finite number > 0")
  if decay != "constant" and 0 < total_updates <= warmup_updates:
    raise ValueError(
      f"lr_decay={decay!r} falls after the warmup, but total_updates={total_updates} <= "
      f"warmup_updates={warmup_updates} leaves no update to decay; use fewer warmup updates, "
      "more updates, or lr_decay='constant'"
    )
  floor = learning_rate / 10
  schedule = learning_rate
  if decay != "constant" and total_updates > warmup_updates:
    span = total_updates - warmup_updates
    if decay == "cosine":
      schedule = optax.cosine_decay_schedule(learning_rate, span, alpha=0.1)
    else:
      schedule = optax.linear_schedule(learning_rate, floor, span)
    if warmup_updates > 0:
      warm = optax.linear_schedule(floor, learning_rate, warmup_updates)
      schedule = optax.join_schedules([warm, schedule], [warmup_updates])
  elif warmup_updates > 0:
    schedule = optax.linear_schedule(floor, learning_rate, warmup_updates)
  tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(schedule))
  return by_layer_stacks(tx) if by_layer else tx


def run_optimizer(config: RLConfig, by_layer: bool):
  """`optimizer` as a run of `config` trains: its schedule counted in optimizer updates
  (minibatches x epochs per RL step), over layer stacks where the policy scans its layers."""
  schedule = config.schedule
  per_step = schedule.minibatches * schedule.epochs  # optimizer updates per RL step
  return optimizer(
    schedule.learning_rate,
    schedule.lr_warmup_steps * per_step,
    schedule.lr_decay,
    schedule.steps * per_step,
    schedule.max_grad_norm,
    by_layer=by_layer,
  )
