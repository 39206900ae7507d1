"""Which implementation runs: Pallas kernels on GPU, the XLA path elsewhere.

`kernels="auto"` (the rollout's default) picks Pallas where it compiles (a GPU backend
whose kernels pass `probe`) and the XLA dequantize-then-dot path otherwise; "pallas" forces
the kernels (on CPU they run in interpret mode: exact but slow, for tests) and "xla" forces
the XLA path. `resolve_with_reason` also says why "auto" chose XLA, so runs can record it.
"auto" is resolved once, eagerly, where a run is set up (the rollout engine); what reaches
a model call (`QuantConfig.kernels`) is the resolved implementation.
"""

from __future__ import annotations

import jax

from trace_jax.kernels.launch import on_gpu
from trace_jax.kernels.probe import probe_failure

KERNEL_MODES = ("auto", "pallas", "xla")
IMPLEMENTATIONS = ("pallas", "xla")  # what "auto" resolves to; what a model call runs


def check_mode(kernels: str, field: str = "kernels", allowed: tuple[str, ...] = KERNEL_MODES):
  if kernels not in allowed:
    raise ValueError(f"{field}={kernels!r} is not allowed; use one of {allowed}")
  return kernels


def resolve(kernels: str) -> str:
  """ "auto" | "pallas" | "xla" -> the implementation that runs: "pallas" or "xla".

  "auto" is Pallas on a GPU where the kernels compile (`probe`, once per process), else XLA.
  """
  return resolve_with_reason(kernels)[0]


def resolve_with_reason(kernels: str) -> tuple[str, str | None]:
  """`resolve`, plus why "auto" took the XLA path (None when it did not): runs record
  both, so a fallback on a GPU is never silent."""
  check_mode(kernels)
  if kernels != "auto":
    return kernels, None
  if not on_gpu():
    return "xla", f"auto: backend {jax.default_backend()} is not a GPU"
  failure = probe_failure()
  return ("xla", f"auto: probe failed: {failure}") if failure else ("pallas", None)
