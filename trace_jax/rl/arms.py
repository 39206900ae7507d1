"""The arms (DESIGN.md section 4): one registry, trained and post-training.

An arm states how it rolls out (precision, the guidance it captures, the layers guidance
covers, routing replay), the training path it trains on ("bf16"; "qat": FP4 QAT with nearest
rounding; "guided": FP4 QAT rounded by the rollout's guidance), its default rollout
correction and the precision it is deployed (and headline-evaluated) in. A post-training arm
is derived from another arm's run: that run's final policy, packed to FP4 after training with
a block-scale rule and evaluated greedily in FP4. With the rollout's own rule ("standard")
that evaluation is the run's own FP4 evaluation, so an RL run of the arm is the run it
derives from; another rule ("4over6") is evaluated by `studies.compare`.

A new arm on an existing training path is one entry in `ARMS`.
"""

from __future__ import annotations

import dataclasses

from trace_jax import fp4
from trace_jax.guidance import GUIDANCE_MODES
from trace_jax.model.quant import PRECISIONS, GuidedLayers, QuantConfig
from trace_jax.rl.grpo import CORRECTIONS
from trace_jax.rollout.config import RolloutConfig

TRAIN_PATHS = ("bf16", "qat", "guided")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arm:
  """How one arm rolls out, trains, and is deployed (see the module docstring)."""

  name: str
  rollout_precision: str  # "bf16" or "fp4" (W4A4 + FP4 KV cache)
  train: str  # the training path: "bf16", "qat" or "guided"
  guidance: str = "none"  # what the rollout captures for training: none/compact/full/sparse
  guided_layers: GuidedLayers = "none"  # stated once: captured, and rounded by in training
  routing_replay: bool = False  # train with the rollout's experts
  correction: str = "none"  # default rollout correction: "tis", "mask" or "none"
  deploy: str = "fp4"  # precision the policy is deployed and headline-evaluated in
  compared: bool = True  # in the default comparison (experiments/compare_arms.py --arms)
  derived_from: str | None = None  # post-training: the arm whose run's final policy it packs
  scale_rule: str = "standard"  # post-training: the packing's block-scale rule (fp4.SCALE_RULES)

  def __post_init__(self):
    for field, allowed in (
      ("rollout_precision", PRECISIONS),
      ("train", TRAIN_PATHS),
      ("guidance", GUIDANCE_MODES),
      ("correction", CORRECTIONS),
      ("deploy", PRECISIONS),
      ("scale_rule", fp4.SCALE_RULES),
    ):
      if getattr(self, field) not in allowed:
        raise ValueError(
          f"Arm.{field}={getattr(self, field)!r} is not allowed; use one of {allowed}"
        )
    if not isinstance(self.guided_layers, (str, int)):
      object.__setattr__(self, "guided_layers", tuple(self.guided_layers))
    QuantConfig(guided_layers=self.guided_layers)  # validates the layer spec
    guided = self.guided_layers != "none"
    if self.train == "guided" and (self.guidance == "none" or not guided):
      raise ValueError(
        f"Arm {self.name!r}: train='guided' needs guidance ('compact', 'full' or 'sparse') "
        f"and guided layers; got guidance={self.guidance!r}, guided_layers={self.guided_layers!r}"
      )
    if self.train != "guided" and (self.guidance != "none" or guided):
      raise ValueError(
        f"Arm {self.name!r}: guidance={self.guidance!r} / guided_layers={self.guided_layers!r} "
        f"are only read by train='guided' (train={self.train!r})"
      )
    if self.guidance != "none" and self.rollout_precision != "fp4":
      raise ValueError(
        f"Arm {self.name!r}: guidance records FP4 rounding; it needs rollout_precision='fp4'"
      )
    if self.derived_from is None and self.scale_rule != "standard":
      raise ValueError(
        f"Arm {self.name!r}: scale_rule={self.scale_rule!r} packs a trained policy after "
        "training; it needs derived_from (the arm whose run it packs)"
      )

  @property
  def post_training(self) -> bool:
    return self.derived_from is not None

  def describe(self) -> str:
    """What the arm does, in a few words, from its fields (the flags' help lists the arms)."""
    if self.post_training:
      return (
        f"the {self.derived_from} run's policy packed to FP4 with {self.scale_rule} block "
        "scales after training, evaluated in FP4"
      )
    train = {"bf16": "bf16 training", "qat": "FP4 QAT, nearest", "guided": "guided FP4 QAT"}
    precision = {"fp4": "FP4", "bf16": "bf16"}[self.rollout_precision]
    parts = [f"{precision} rollout", train[self.train]]
    if self.train == "guided":
      parts[-1] += f" with {self.guidance} guidance on {self.guided_layers} layers"
    if self.routing_replay:
      parts.append("routing replay")
    if self.correction != "none":
      parts.append(f"{self.correction.upper()} correction")
    if self.deploy != "fp4":
      parts.append(f"deployed in {self.deploy}")
    return ", ".join(parts)

  @property
  def runnable(self) -> bool:
    """An RL run (experiments/rl.py) reports this arm: trained arms, and post-training arms
    whose evaluation is the run's own FP4 evaluation (the rollout's packing)."""
    return not self.post_training or self.scale_rule == "standard"

  @property
  def measured(self) -> bool:
    """Both paths run FP4: the rollout then captures (at least compact) guidance on every
    layer, so the paths' per-layer disagreement is measured each step; training reads only
    the arm's own guided layers of it."""
    return self.rollout_precision == "fp4" and self.train != "bf16"

  def train_scheme(self, scheme: QuantConfig) -> QuantConfig | None:
    """The training path's QuantConfig in a run's `scheme` (None: bf16, no quantization):
    the scheme as it is, rounded by guidance at this arm's guided layers on "guided"."""
    if self.train == "bf16":
      return None
    if self.train == "qat":
      return scheme
    return scheme.replace(rounding="guided", guided_layers=self.guided_layers)

  def rollout(self, base: RolloutConfig) -> RolloutConfig:
    """`base` with this arm's rollout settings: precision, capture and guided layers. Every
    arm records the rollout's experts: replay trains with them, and every arm's router flip
    rate is measured against them."""
    capture = "compact" if self.measured and self.guidance == "none" else self.guidance
    return base.replace(
      precision=self.rollout_precision,
      guidance=capture,
      guided_layers="all" if self.measured else self.guided_layers,
      record_routing=True,
    )


ARMS = {
  arm.name: arm
  for arm in (
    Arm(name="bf16", rollout_precision="bf16", train="bf16", deploy="bf16"),
    Arm(name="fp4-rollout", rollout_precision="fp4", train="bf16", correction="tis"),
    Arm(name="fp4-qat", rollout_precision="fp4", train="qat"),
    # Routing replay alone (R3): the rollout's experts, nearest rounding, no guidance; tells
    # what replay removes from what guidance does.
    Arm(
      name="fp4-qat-r3",
      rollout_precision="fp4",
      train="qat",
      routing_replay=True,
      compared=False,
    ),
    Arm(
      name="trace",
      rollout_precision="fp4",
      train="guided",
      guidance="compact",
      guided_layers="last_half",
      routing_replay=True,
    ),
    Arm(
      name="trace-full",
      rollout_precision="fp4",
      train="guided",
      guidance="full",
      guided_layers="all",
      routing_replay=True,
    ),
    # Beyond the method: sparse guidance (only elements / scales near a rounding boundary)
    # is cheap enough to cover every layer, so upstream layers stop feeding noise downstream.
    Arm(
      name="trace-sparse",
      rollout_precision="fp4",
      train="guided",
      guidance="sparse",
      guided_layers="all",
      routing_replay=True,
      compared=False,
    ),
    # Post-training quantization: the bf16 run's policy packed to FP4, evaluated in FP4.
    Arm(name="ptq", rollout_precision="bf16", train="bf16", derived_from="bf16"),
    Arm(
      name="ptq-46",
      rollout_precision="bf16",
      train="bf16",
      derived_from="bf16",
      scale_rule="4over6",  # per block, amax -> 6 or -> 4, whichever reconstructs it better
    ),
  )
}
RUNNABLE = tuple(name for name, arm in ARMS.items() if arm.runnable)
COMPARED = tuple(name for name, arm in ARMS.items() if arm.compared)


def get_arm(name: str, *, runnable: bool = False) -> Arm:
  """The arm called `name`; with `runnable`, only an arm an RL run reports."""
  if runnable and name in ARMS and name not in RUNNABLE:
    raise ValueError(
      f"arm={name!r} packs the {ARMS[name].derived_from} run's policy with the "
      f"{ARMS[name].scale_rule!r} block-scale rule after training: experiments/compare_arms.py "
      f"evaluates it; RL runs: {sorted(RUNNABLE)}"
    )
  if name not in ARMS:
    raise ValueError(f"arm={name!r} is not known; arms: {sorted(RUNNABLE if runnable else ARMS)}")
  return ARMS[name]
