"""Supervised fine-tuning on demonstrations (the warm start before RL)."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from trace_jax.model.quant import QuantConfig
from trace_jax.model.transformer import Transformer
from trace_jax.training.forward import token_logprobs


def sft_batch(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], length: int, pad_id: int):
  """Right-padded tokens [B, length], a loss mask on the completion tokens and a validity
  mask (bool, both [B, length]).

  Args:
    pairs: (prompt ids, completion ids) per example; the loss is on the completion.
  """
  tokens = np.full((len(pairs), length), pad_id, np.int32)
  loss_mask = np.zeros((len(pairs), length), bool)
  valid = np.zeros((len(pairs), length), bool)
  for i, (prompt, completion) in enumerate(pairs):
    seq = list(prompt) + list(completion)
    if len(seq) > length:
      raise ValueError(f"example {i} has {len(seq)} tokens; the batch length is {length}")
    tokens[i, : len(seq)] = seq
    loss_mask[i, len(prompt) : len(seq)] = True
    valid[i, : len(seq)] = True
  return jnp.asarray(tokens), jnp.asarray(loss_mask), jnp.asarray(valid)


def sft_loss(model: Transformer, tokens, loss_mask, valid, quant: QuantConfig | None = None):
  """Mean negative log-likelihood of the masked tokens, plus the load-balancing loss."""
  out = model(tokens, mask=valid, quant=quant)
  logp = token_logprobs(out.logits, tokens)
  weights = loss_mask.astype(jnp.float32)
  nll = -jnp.sum(logp * weights) / jnp.maximum(jnp.sum(weights), 1.0)
  return nll + model.cfg.router_aux_loss_coef * out.lb_loss, nll


@functools.lru_cache(maxsize=None)
def _optimizer(learning_rate: float, steps: int, warmup: int):
  """One transformation per schedule: optimizers built from the same one share compiled steps
  (the transformation is part of the jitted step's static structure)."""
  warmup = min(warmup, steps // 2)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, learning_rate, warmup, max(steps, warmup + 1), learning_rate * 0.1
  )
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))


@functools.partial(nnx.jit, static_argnames="quant")
def _sft_step(model, opt, tokens, loss_mask, valid, *, quant):
  (_, nll), grads = nnx.value_and_grad(
    lambda m: sft_loss(m, tokens, loss_mask, valid, quant), has_aux=True
  )(model)
  opt.update(model, grads)
  return nll


def train_sft(
  model: Transformer,
  batches: Callable[[int], tuple],
  *,
  steps: int,
  learning_rate: float = 3e-3,
  quant: QuantConfig | None = None,
  progress: bool = True,
  warmup: int = 20,
  stop: Callable[[int], bool] | None = None,
) -> list[float]:
  """Train `model` in place on `batches(step) -> sft_batch(...)`; returns the NLLs.

  `stop(n)`, asked after each step with the n steps done, ends the training early when it
  returns True; the learning-rate schedule stays the one for `steps`."""
  if steps < 0:
    raise ValueError(f"steps={steps} must be >= 0")
  opt = nnx.Optimizer(model, _optimizer(learning_rate, steps, warmup), wrt=nnx.Param)
  losses = []
  # imported here: the training path's modules load where tqdm is not installed (the GPU
  # image the device checks run on)
  from tqdm.auto import tqdm  # noqa: PLC0415

  bar = tqdm(range(steps), desc="sft", disable=not progress, leave=False)
  for i in bar:
    nll = float(_sft_step(model, opt, *batches(i), quant=quant))
    if not np.isfinite(nll):
      raise FloatingPointError(f"SFT loss became {nll} at step {i}")
    losses.append(nll)
    bar.set_postfix(nll=f"{nll:.3f}")
    if stop is not None and stop(i + 1):
      break
  return losses
