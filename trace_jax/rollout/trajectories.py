"""A batch of trajectories as the rollout engine returns it (`Rollout`), and how each
sequence's last turn ended (FINISH_*)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.utils.distributed import host_array

FINISH_RUNNING, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = ("running", "stop", "length")


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=[
    "tokens",
    "positions",
    "prompt_mask",
    "response_mask",
    "env_mask",
    "logprobs",
    "sampling_logprobs",
    "finish",
    "guidance",
    "routing",
    "cache",
    "site_inputs",
  ],
  meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Rollout:
  """A batch of trajectories.

  Attributes:
    tokens: int32 [B, S]; slots that hold nothing have the pad id.
    positions: int32 [B, S] RoPE positions (the training path uses the same).
    prompt_mask, response_mask, env_mask: bool [B, S]: which slots hold prompt tokens,
      generated tokens (the stop token included) and environment observations.
    logprobs: float32 [B, S], log-probability of each generated token under
      softmax(logits / temperature), the full tempered distribution (0 elsewhere).
    sampling_logprobs: float32 [B, S], under the distribution actually sampled (after
      top-k / top-p; equal to `logprobs` without them; 0 for greedy).
    finish: int32 [B]: FINISH_STOP (emitted a stop token) or FINISH_LENGTH (hit
      max_new_tokens) for the last turn.
    guidance: the captured `Guidance` (or None when guidance="none" and no routing).
    routing: int8/int16 [num_moe_layers, B, S, k], the experts chosen at every slot.
    cache: the KV cache, to continue from.
    site_inputs: {(layer, site): activation [B, S, ...]} before quantization, float32 as
      the quantizer read it (its FP4 is the guidance, bit for bit), only when asked for
      (checks and studies).
  """

  tokens: jax.Array
  positions: jax.Array
  prompt_mask: jax.Array
  response_mask: jax.Array
  env_mask: jax.Array
  logprobs: jax.Array
  sampling_logprobs: jax.Array
  finish: jax.Array
  guidance: Any
  routing: Any
  cache: Any
  site_inputs: Any

  @property
  def mask(self) -> jax.Array:
    """Every slot that holds a real token."""
    return self.prompt_mask | self.response_mask | self.env_mask

  @property
  def lengths(self) -> jax.Array:
    """int32 [B]: real tokens per sequence."""
    return jnp.sum(self.mask, axis=-1, dtype=jnp.int32)

  @property
  def response_lengths(self) -> jax.Array:
    return jnp.sum(self.response_mask, axis=-1, dtype=jnp.int32)

  def finish_reasons(self) -> list[str]:
    return [FINISH_NAMES[int(f)] for f in host_array(self.finish)]

  def sequences(self) -> list[list[int]]:
    """Each sequence's real tokens, in order."""
    tokens, mask = host_array(self.tokens), host_array(self.mask)
    return [t[m].tolist() for t, m in zip(tokens, mask)]

  def responses(self) -> list[list[int]]:
    """Each sequence's generated tokens (all turns), in order."""
    tokens, mask = host_array(self.tokens), host_array(self.response_mask)
    return [t[m].tolist() for t, m in zip(tokens, mask)]

  def without_cache(self) -> "Rollout":
    return dataclasses.replace(self, cache=None)

  def trim(self, slots: int) -> "Rollout":
    """The first `slots` slots (all real tokens must lie there), without the cache."""
    per_slot = lambda a: None if a is None else a[:, :slots]
    return dataclasses.replace(
      self,
      cache=None,
      **{
        f: per_slot(getattr(self, f))
        for f in (
          "tokens",
          "positions",
          "prompt_mask",
          "response_mask",
          "env_mask",
          "logprobs",
          "sampling_logprobs",
        )
      },
      guidance=None if self.guidance is None else self.guidance.trim(slots),
      routing=None if self.routing is None else self.routing[:, :, :slots],
      site_inputs=None if self.site_inputs is None else jax.tree.map(per_slot, self.site_inputs),
    )

  @property
  def used_slots(self) -> int:
    """Slots written so far (the cache's write index)."""
    mask = host_array(self.mask)
    return int(np.nonzero(mask.any(axis=0))[0].max()) + 1 if mask.any() else 0

  def to_host(self) -> "Rollout":
    """The trajectories on the host, without the cache (which stays with the engine)."""
    return jax.device_get(self.without_cache())
