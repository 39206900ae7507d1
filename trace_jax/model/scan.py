"""Which layers of a forward run under one `jax.lax.scan` (ModelConfig.scan_layers).

A scan compiles its body once however many layers it covers, so the program holds one copy
of a layer (or of a repeating group of layers) instead of one per layer. Layers are alike
when everything that shapes their program is the same: their kind (attention or Gated
DeltaNet, MoE or dense feed-forward), whether this forward guides or records them, and the
shapes of their guidance. `layer_groups` cuts the stack into runs of a repeating pattern of
alike layers (a period of 1 for a plain MoE stack, the 3 + 1 pattern of Qwen3.5's hybrid
layers) and leaves every layer that starts no repeat, such as dense-first layers, unrolled.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

MAX_PERIOD = 8  # the longest repeating pattern looked for


@dataclasses.dataclass(frozen=True)
class LayerGroup:
  """Layers [start, start + period * repeats): `repeats` copies of a `period`-layer
  pattern. repeats == 1 (and period == 1): one layer, unrolled."""

  start: int
  period: int
  repeats: int

  @property
  def scanned(self) -> bool:
    return self.repeats > 1

  def layers(self, template: int) -> tuple[int, ...]:
    """The layers the pattern's `template`-th layer stands for, one per repeat."""
    return tuple(self.start + r * self.period + template for r in range(self.repeats))


def layer_groups(signatures: Sequence[Hashable], max_period: int = MAX_PERIOD) -> list[LayerGroup]:
  """Cut layers with these per-layer signatures into scanned runs and single layers.

  From each layer on, the pattern (of at most `max_period` layers) whose repeats cover the
  most layers wins (the shorter pattern on a tie); a layer no pattern of two or more
  repeats starts at stays a single, unrolled layer.
  """
  sigs = list(signatures)
  n, i, out = len(sigs), 0, []
  while i < n:
    best = LayerGroup(i, 1, 1)
    for period in range(1, max_period + 1):
      pattern = sigs[i : i + period]
      if len(pattern) < period:
        break
      repeats = 1
      while sigs[i + repeats * period : i + (repeats + 1) * period] == pattern:
        repeats += 1
      if repeats > 1 and period * repeats > best.period * best.repeats:
        best = LayerGroup(i, period, repeats)
    out.append(best)
    i += best.period * best.repeats
  return out
