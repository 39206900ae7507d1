"""Rollout configuration: sampling, precision, guidance capture."""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

from trace_jax.fp4 import SparseSpec
from trace_jax.guidance import GUIDANCE_MODES
from trace_jax.kernels import KERNEL_MODES
from trace_jax.model.quant import (
  PRECISIONS,
  ROUTER_DTYPES,
  QuantConfig,
  _check_layers_spec,
  check_run_scheme,
)
from trace_jax.model.config import COMPUTE_DTYPES
from trace_jax.model.skew import check_amount


def _require(ok: bool, where: str, field: str, value, allowed: str) -> None:
  if not ok:
    raise ValueError(f"{where}.{field}={value!r} is not allowed; {allowed}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """How the next token is drawn.

  `Rollout.logprobs` are always the log-probabilities of the full tempered distribution
  softmax(logits / temperature) (temperature 1 when greedy): what the training path
  computes, so the RL importance ratio compares like with like. With top-k / top-p the
  token was drawn from the truncated, renormalised distribution; its log-probability under
  that one is `Rollout.sampling_logprobs`.
  """

  temperature: float = 1.0  # > 0; ignored when greedy
  top_k: int = 0  # keep the k most likely tokens; 0 = off
  top_p: float = 1.0  # keep the smallest set with probability >= top_p; 1 = off
  greedy: bool = False  # argmax instead of sampling
  max_new_tokens: int = 32  # per call (per turn in multi-turn)
  stop_tokens: tuple[int, ...] = ()  # a sequence ends after emitting one of these
  stop_check_every: int | None = None  # decode steps between checks of "all stopped?";
  #   None: 8 on a GPU (each check is a device-to-host sync), 1 elsewhere (a check is free
  #   there, and up to N - 1 steps after the last stop are wasted); a slot pool's refills
  #   (RolloutConfig.slots) every 8 anywhere (each also runs a prefill, an insert and a
  #   copy out). Results are identical.

  def __post_init__(self):
    where = "SamplingConfig"
    _require(
      self.temperature > 0,
      where,
      "temperature",
      self.temperature,
      "must be > 0 (use greedy=True for argmax)",
    )
    _require(
      isinstance(self.top_k, int) and self.top_k >= 0,
      where,
      "top_k",
      self.top_k,
      "must be an int >= 0",
    )
    _require(0 < self.top_p <= 1, where, "top_p", self.top_p, "must lie in (0, 1]")
    _require(
      isinstance(self.max_new_tokens, int) and self.max_new_tokens > 0,
      where,
      "max_new_tokens",
      self.max_new_tokens,
      "must be an int > 0",
    )
    _require(
      self.stop_check_every is None
      or (isinstance(self.stop_check_every, int) and self.stop_check_every >= 1),
      where,
      "stop_check_every",
      self.stop_check_every,
      "must be None (automatic) or an int >= 1",
    )
    object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """A rollout engine's precision, cache, sampling and guidance capture."""

  precision: str = "fp4"  # "fp4": W4A4 + FP4 KV cache; "bf16": unquantized (weights,
  #   activations and cache in compute_dtype)
  fp4: QuantConfig = QuantConfig()  # the run's scheme: format, scope, activations, KV cache
  compute_dtype: str = "bfloat16"  # activations; "float32" for exactness tests
  max_len: int = 256  # KV-cache slots: prompt + all turns' tokens
  sampling: SamplingConfig = SamplingConfig()
  guidance: str = "compact"  # "none", "compact", "full" or "sparse"
  guided_layers: Union[str, int, Sequence[int]] = "last_half"  # "all", "none", count, ids
  sparse: SparseSpec = SparseSpec()  # guidance "sparse": margins (delta) and the
  #   per-row buffer capacity
  record_routing: bool = True  # keep every MoE layer's experts (routing replay)
  pad_id: int = 0  # token written to slots that hold nothing
  prompt_bucket: int = 16  # pad prompt / observation chunks to a multiple (fewer recompiles)
  prefill_chunk: int = 128  # prompt slots per sequence the prefill feeds at once (a scan over
  #   chunks: its attention scores and expert tiles are a chunk's, not the prompt's); 0: the
  #   whole prompt in one forward
  kernels: str = "auto"  # "auto" (Pallas kernels on GPU, XLA elsewhere), "pallas" (on CPU:
  #   interpret mode, slow, for tests) or "xla" (dequantize, then XLA dots)
  skew: float = 0.0  # >= 0: every layer's output times 1 + skew * u, u in (-1, 1) hashed
  #   from (version, sequence, position, layer, element) (`model.skew`): an engine that
  #   computes differently from the trainer by a controlled amount; 0: exactly none
  slots: int | None = None  # decode slots (`rollout.pool`: a fixed pool refilled as
  #   sequences finish, a group's prompt prefilled once); None or 0: every sequence of a
  #   call at once (the static batch)
  router_dtype: str = "float32"  # the MoE router's logits: "float32" (as training computes
  #   them) or "compute" (in compute_dtype: an engine difference; `CallOptions.router_dtype`)

  def __post_init__(self):
    where = "RolloutConfig"
    _require(
      self.precision in PRECISIONS, where, "precision", self.precision, f"use one of {PRECISIONS}"
    )
    check_run_scheme(self.fp4, "RolloutConfig.fp4")
    _require(
      self.compute_dtype in COMPUTE_DTYPES,
      where,
      "compute_dtype",
      self.compute_dtype,
      f"use one of {COMPUTE_DTYPES}",
    )
    _require(self.max_len > 0, where, "max_len", self.max_len, "must be > 0")
    _require(
      self.guidance in GUIDANCE_MODES,
      where,
      "guidance",
      self.guidance,
      f"use one of {GUIDANCE_MODES}",
    )
    _require(
      self.precision == "fp4" or self.guidance == "none",
      where,
      "guidance",
      self.guidance,
      "a bf16 rollout has no FP4 rounding to record; use 'none'",
    )
    _require(
      isinstance(self.sparse, SparseSpec), where, "sparse", self.sparse, "use an fp4.SparseSpec"
    )
    _require(
      self.guidance != "sparse" or self.fp4.fmt == "nvfp4",
      where,
      "guidance",
      self.guidance,
      f"sparse guidance needs fmt='nvfp4' (E4M3 block scales); fmt={self.fp4.fmt!r}",
    )
    _require(self.prompt_bucket > 0, where, "prompt_bucket", self.prompt_bucket, "must be > 0")
    _require(
      isinstance(self.prefill_chunk, int) and self.prefill_chunk >= 0,
      where,
      "prefill_chunk",
      self.prefill_chunk,
      "must be an int >= 0 (0: the whole prompt at once)",
    )
    _require(
      self.kernels in KERNEL_MODES, where, "kernels", self.kernels, f"use one of {KERNEL_MODES}"
    )
    if not isinstance(self.guided_layers, (str, int)):
      object.__setattr__(self, "guided_layers", tuple(self.guided_layers))
    _check_layers_spec(self.guided_layers)
    check_amount(self.skew, f"{where}.skew")
    _require(
      self.slots is None
      or (isinstance(self.slots, int) and not isinstance(self.slots, bool) and self.slots >= 0),
      where,
      "slots",
      self.slots,
      "must be None or an int >= 0 (0 / None: every sequence at once)",
    )
    _require(
      self.router_dtype in ROUTER_DTYPES,
      where,
      "router_dtype",
      self.router_dtype,
      f"use one of {ROUTER_DTYPES}",
    )

  @property
  def quant(self) -> QuantConfig | None:
    """The model QuantConfig of this rollout: the run's scheme (rollouts round to nearest),
    None for a bf16 rollout."""
    return self.fp4 if self.precision == "fp4" else None

  def replace(self, **changes) -> "RolloutConfig":
    return dataclasses.replace(self, **changes)
