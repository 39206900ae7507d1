"""Where the model quantizes, and in which scope: `QuantConfig` (what is quantized),
`CallOptions` (how one call runs) and `Recording` (what a call records).

How one forward quantizes a site is `quantizer.py` (`SiteQuantizer`).

Quantization sites (DESIGN.md section 2), per layer, each declared once in `sites.py`
and quantized by the module named:
  attn_in     input of the q/k/v projections                 per token      (attention.py)
              (Gated DeltaNet layers: of in_proj_qkv and in_proj_z)
  attn_out    input of the output projection (out_proj)      per token      (attention.py)
  k, v        cache entries, after RoPE (k)                  per (token, KV head)
              (full-attention layers only: linear layers keep a recurrent state)
  moe_in      input of the experts' gate/up projections      per token, once (moe.py)
  moe_mid     input of each routed expert's down projection  per (token, expert)
  shared_mid  input of the shared expert's down projection   per token
  mlp_in, mlp_mid   the same two for a dense feed-forward layer
Weights of every linear layer are quantized per matrix (per expert for stacked experts);
each declares its group, shared-scale siblings and input site where it is made
(`parameters.param`). Router, norms, embeddings, LM head and the attention softmax stay in
high precision.
All arithmetic is `trace_jax.fp4`'s; nothing here rounds by itself.

Which of them run in FP4 is a named scope, `QuantConfig(sites=...)`:
  "all"          every site above and every linear weight;
  "experts+kv"   the TRACE method's own scope: the routed experts' weights and activations
                 (moe_in, moe_mid) and the KV cache (k, v) in FP4; attention projections,
                 the shared expert, dense MLP layers (and, in hybrid models, linear-attention
                 layers) in high precision. The routed experts hold most of an MoE model's
                 weight bytes and the KV cache most of a long decode's, so this scope keeps
                 most of FP4's memory and bandwidth gain while leaving the layers every token
                 passes through (attention, shared expert) unrounded.
A tuple of activation-site names (the older form) quantizes exactly those activation sites
and, with `weights=True`, every linear weight.

Adding a site touches two places: its `Site(...)` declaration in `sites.py` (its name,
which layers have it, the named scopes that include it, whether it is a cache entry or a
routed-expert site, which dimension a sharded forward splits over "model"; listed in
`sites.SITES`) and the module's `sow_site(..., site=THAT_SITE)` call (the linear weights it
feeds name it as their `input_site` where they are made). `sites.ACTIVATION_SITES`,
`SCOPE_SITES`, `KV_SITES`, `layer_sites` (hence the guidance checks), the guidance buffers,
their shardings and byte accounting (an abstract forward) and an export's input scales all
derive from those.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Union

import jax.numpy as jnp

from trace_jax import fp4, kernels as kernels_lib
from trace_jax.guidance import GUIDANCE_MODES
from trace_jax.model import parameters
from trace_jax.model.parameters import WEIGHT_GROUPS
from trace_jax.utils import flags
from trace_jax.utils.flags import knob
from trace_jax.model.sites import (
  ACTIVATION_SITES,
  KV_SITES,
  SCOPE_SITES,
  SITE_SCOPES,
  SITES,
  site_spec,
)


PRECISIONS = ("bf16", "fp4")  # a model's, a rollout's, a deployment's: unquantized or FP4
# The groups of linear weights (`parameters.WEIGHT_GROUPS`, declared on each weight); a
# scope quantizes whole groups.
SCOPE_WEIGHT_GROUPS = {"all": WEIGHT_GROUPS, "experts+kv": ("experts",)}
GUIDED_LAYER_NAMES = ("last_half", "all", "none")
# Activation formats: "fp4" (W4A4, in `fmt`) or "fp8" (W4A8: the linear layers' inputs in
# MXFP8 E4M3, `fp4.fake_quant_fp8`; the KV cache stays FP4 in `fmt`). FP8 sites round to
# nearest without guidance: full-code guidance would cost 8 bits per element, the FP8
# activation itself, and an FP8 flip moves a value by at most 1/8 relative (E2M1: 1/2).
ACTIVATION_FORMATS = ("fp4", "fp8")
# The KV cache's (and the K/V sites') precision in scope, FP4 first (the default)
KV_PRECISIONS = PRECISIONS[::-1]
GuidedLayers = Union[str, int, Sequence[int]]


def resolve_layers(
  guided_layers: GuidedLayers, num_layers: int, *, field: str = "guided_layers"
) -> tuple[int, ...]:
  """ "last_half" (the deeper half), "all", "none", a count from the top, or explicit ids.

  The deeper half of n layers is the top ceil(n / 2): an odd middle layer is guided, and a
  model with any layer guides at least one (floor(1 / 2) = 0 would guide nothing)."""
  if isinstance(guided_layers, str):
    if guided_layers == "last_half":
      return tuple(range(num_layers // 2, num_layers))
    if guided_layers == "all":
      return tuple(range(num_layers))
    if guided_layers == "none":
      return ()
    raise ValueError(
      f"{field}={guided_layers!r} is not allowed; use one of "
      f"{GUIDED_LAYER_NAMES}, a count, or a list of layer ids"
    )
  if isinstance(guided_layers, bool):
    raise ValueError(f"{field}={guided_layers!r} is not allowed; use a name, a count or a list")
  if isinstance(guided_layers, int):
    if not 0 <= guided_layers <= num_layers:
      raise ValueError(
        f"{field}={guided_layers} must lie in [0, {num_layers}] (a count of layers from the top)"
      )
    return tuple(range(num_layers - guided_layers, num_layers))
  layers = tuple(int(i) for i in guided_layers)
  bad = [i for i in layers if not 0 <= i < num_layers]
  if bad:
    raise ValueError(f"{field} holds layer ids {bad} outside [0, {num_layers})")
  return tuple(sorted(set(layers)))


def _check_layers_spec(guided_layers: GuidedLayers) -> None:
  """Validation that does not need the layer count."""
  if isinstance(guided_layers, str):
    resolve_layers(guided_layers, 1)
  elif isinstance(guided_layers, bool):
    resolve_layers(guided_layers, 1)
  elif isinstance(guided_layers, int):
    if guided_layers < 0:
      raise ValueError(f"guided_layers={guided_layers} must be >= 0")
  elif not all(isinstance(i, int) and i >= 0 for i in guided_layers):
    raise ValueError(f"guided_layers={guided_layers!r} must hold non-negative layer ids")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recording:
  """What a forward records of its quantization sites (static: part of the jit key).

  The records come out already in the form TRACE guidance stores (`Guidance.sites`), so the
  rollout writes them into its buffers as they are and nothing is unpacked or repacked.
  """

  form: str = (
    "none"  # the records' form: "none", "compact" (fp4.CompactGuidance) or "full" (QArray)
  )
  layers: tuple[int, ...] | None = None  # recorded layers; None: every layer
  inputs: bool = False  # also keep each recorded site's input, float32, as quantized
  sparse: fp4.SparseSpec = fp4.SparseSpec()  # form "sparse": margins and buffer capacity

  def __post_init__(self):
    if self.form not in GUIDANCE_MODES:
      raise ValueError(f"Recording.form={self.form!r} is not allowed; use one of {GUIDANCE_MODES}")
    if self.layers is not None:
      object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))

  @property
  def enabled(self) -> bool:
    return self.form != "none" or self.inputs

  def covers(self, layer: int) -> bool:
    return self.enabled and (self.layers is None or layer in self.layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
  """What is quantized, the one scheme type: whether anything is (`precision`), the FP4
  format, the scope of sites, the linear inputs' format, the KV cache, and the rounding at
  the guided layers. `precision="bf16"` (or passing None) turns quantization off. How one
  call runs (kernels, what it records, its compute dtype) is `CallOptions`, beside it.

  A run holds one (`RLConfig.fp4`, `RolloutConfig.fp4`, the planner's and the studies'):
  its format, scope, activations and KV cache are flags; precision, weights, rounding and
  guided layers are each path's, derived from the arm (`Arm.train_scheme`,
  `RolloutConfig.quant`), and stay at their defaults in a run's own."""

  precision: str = knob("fp4", "fp4 or bf16 (no quantization).", flat="fp4_precision", flag=False)
  fmt: str = knob("nvfp4", "FP4 format: nvfp4 or mxfp4.")
  weights: bool = knob(
    True, "Quantize every linear weight in scope.", flat="fp4_weights", flag=False
  )
  sites: Union[str, tuple[str, ...]] = knob(
    "all",
    "FP4 scope: all, or experts+kv (the method's: routed experts and KV cache).",
    flat="fp4_sites",
  )  # or a tuple of activation-site names: those sites (weights per `weights`)
  rounding: str = knob(
    "nearest",
    "At guided layers: nearest, guided (needs guidance) or stochastic.",
    flat="fp4_rounding",
    flag=False,
  )
  guided_layers: GuidedLayers = knob(
    "last_half",
    "The layers `rounding` applies to (elsewhere nearest).",
    flat="fp4_guided_layers",
    flag=False,
  )
  activations: str = knob(
    "fp4",
    "fp4 (W4A4) or fp8 (W4A8: linear inputs in MXFP8 E4M3 on both paths, KV cache in "
    "FP4; FP8 sites take nearest rounding, no guidance).",
  )
  kv: str = knob(
    "fp4",
    "KV cache precision: fp4 (as the scope says) or bf16 (an ablation: the K/V sites and the "
    "cache unquantized, everything else as the scope says).",
    flat="kv_precision",
  )

  def __post_init__(self):
    for field, allowed in (
      ("precision", PRECISIONS),
      ("fmt", tuple(sorted(fp4.FORMATS))),
      ("rounding", fp4.ROUNDING_MODES),
      ("activations", ACTIVATION_FORMATS),
      ("kv", KV_PRECISIONS),
    ):
      value = getattr(self, field)
      if value not in allowed:
        raise ValueError(f"{_named(field, value)} is not allowed; use one of {allowed}")
    if not isinstance(self.weights, bool):
      raise ValueError(f"QuantConfig.weights={self.weights!r} must be True or False")
    if isinstance(self.sites, str):
      if self.sites not in SITE_SCOPES:
        raise ValueError(
          f"{_named('sites', self.sites)} is not allowed; use one of "
          f"{SITE_SCOPES} or a tuple of sites from {ACTIVATION_SITES}"
        )
    else:
      object.__setattr__(self, "sites", tuple(self.sites))
      unknown = [s for s in self.sites if s not in ACTIVATION_SITES]
      if unknown:
        raise ValueError(
          f"QuantConfig.sites has unknown sites {unknown}; allowed: "
          f"{ACTIVATION_SITES}, or a scope from {SITE_SCOPES}"
        )
    if not isinstance(self.guided_layers, (str, int)):
      object.__setattr__(self, "guided_layers", tuple(self.guided_layers))
    _check_layers_spec(self.guided_layers)

  @property
  def enabled(self) -> bool:
    return self.precision == "fp4"

  @property
  def activation_sites(self) -> tuple[str, ...]:
    """The activation sites this config's scope quantizes (whether or not enabled); the
    K/V sites only with `kv` "fp4"."""
    sites = SCOPE_SITES[self.sites] if isinstance(self.sites, str) else self.sites
    if self.kv == "bf16":
      sites = tuple(s for s in sites if s not in KV_SITES)
    return sites

  @property
  def weight_groups(self) -> tuple[str, ...]:
    """The groups of linear weights quantized (see `WEIGHT_GROUPS`), () when off."""
    if not self.enabled or not self.weights:
      return ()
    return SCOPE_WEIGHT_GROUPS[self.sites] if isinstance(self.sites, str) else WEIGHT_GROUPS

  def quantizes(self, site: str) -> bool:
    """Whether activation site `site` runs in FP4."""
    return self.enabled and site in self.activation_sites

  def in_fp8(self, site: str) -> bool:
    """Whether activation site `site` runs in FP8 (W4A8's linear inputs), not FP4."""
    return self.quantizes(site) and self.activations == "fp8" and not site_spec(site).cache

  def quantizes_weights(self, group: str) -> bool:
    """Whether the linear weights of `group` (one of `WEIGHT_GROUPS`) run in FP4."""
    if group not in WEIGHT_GROUPS:
      raise ValueError(f"weight group {group!r} is not one of {WEIGHT_GROUPS}")
    return group in self.weight_groups

  def guided_layer_ids(self, num_layers: int) -> tuple[int, ...]:
    return resolve_layers(self.guided_layers, num_layers)

  def replace(self, **changes) -> "QuantConfig":
    return dataclasses.replace(self, **changes)


def _named(field: str, value) -> str:
  """`QuantConfig.<field>=<value>`, and the flat name (a run's flag) where it differs."""
  flat = flags.flat_name(QuantConfig.__dataclass_fields__[field])
  also = "" if flat == field else f" ({flat}={value!r})"
  return f"QuantConfig.{field}={value!r}{also}"


# The scheme's fields each path sets for itself, never a run's scheme (`check_run_scheme`).
PATH_FIELDS = ("precision", "weights", "rounding", "guided_layers")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(QuantConfig)}


def check_run_scheme(scheme, where: str) -> None:
  """A ValueError unless `scheme` (held in field `where`) is a QuantConfig whose
  `PATH_FIELDS` are at their defaults: a run's own scheme states only the format, the
  scope, the activations and the KV cache, and each path derives the rest."""
  if not isinstance(scheme, QuantConfig):
    raise ValueError(f"{where}={scheme!r} is not allowed; use a QuantConfig")
  for field in PATH_FIELDS:
    value, default = getattr(scheme, field), _DEFAULTS[field]
    if value != default:
      raise ValueError(
        f"{where}.{field}={value!r} is not allowed; a run's scheme leaves it at {default!r}: "
        "each path sets its own (the arm its training path's, the rollout config its own)"
      )


ROUTER_DTYPES = ("float32", "compute")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallOptions:
  """How one model call runs, beside the QuantConfig of what it quantizes (static: part of
  the jit key): the FP4 kernels, what it records of its sites, its activations' dtype,
  whether it needs the logits of every slot or of the last only."""

  kernels: str = "xla"  # "xla" or "pallas": whether packed FP4 weights and the FP4 cache go
  #   through `trace_jax.kernels` (forward only: the rollout); a run's "auto" is resolved
  #   where it is set up (`kernels.resolve`, outside jit), never inside a model call
  recording: Recording = Recording()  # what the call records of its sites (ModelOutput.sites)
  compute_dtype: str | None = None  # activations' dtype; None: the model's (ModelConfig.dtype)
  last_logits: bool = False  # the LM head at each row's last slot only: logits [B, 1, V]
  moe_blocks: int = 1  # the routed experts' rows sorted and multiplied within this many
  #   equal blocks of whole sequences (a rollout on a mesh: one per "data" shard, so each
  #   shard dispatches its own tokens); 1: one sort over the whole batch
  router_dtype: str = "float32"  # the MoE router's logits: "float32" (both paths, as the
  #   method runs it) or "compute" (the activations' dtype: an engine whose router runs in
  #   bf16 while the trainer's runs in float32, a real engine difference)

  def __post_init__(self):
    if not isinstance(self.last_logits, bool):
      raise ValueError(f"CallOptions.last_logits must be a bool, got {self.last_logits!r}")
    if isinstance(self.moe_blocks, bool) or not isinstance(self.moe_blocks, int):
      raise ValueError(f"CallOptions.moe_blocks must be an int >= 1, got {self.moe_blocks!r}")
    if self.moe_blocks < 1:
      raise ValueError(f"CallOptions.moe_blocks must be an int >= 1, got {self.moe_blocks}")
    kernels_lib.check_mode(self.kernels, "CallOptions.kernels", kernels_lib.IMPLEMENTATIONS)
    if self.router_dtype not in ROUTER_DTYPES:
      raise ValueError(
        f"CallOptions.router_dtype={self.router_dtype!r} is not allowed; use one of {ROUTER_DTYPES}"
      )
    if not isinstance(self.recording, Recording):
      raise ValueError(
        f"CallOptions.recording must be a Recording, got {type(self.recording).__name__}"
      )
    if self.compute_dtype is not None:
      try:
        name = jnp.dtype(self.compute_dtype).name
      except TypeError as e:
        raise ValueError(f"CallOptions.compute_dtype={self.compute_dtype!r} is not a dtype") from e
      object.__setattr__(self, "compute_dtype", name)

  def replace(self, **changes) -> "CallOptions":
    return dataclasses.replace(self, **changes)


def weight_group(variable) -> str | None:
  """The `WEIGHT_GROUPS` entry of a parameter (an `nnx.Variable`), or None if FP4 never
  quantizes it: what its module declared (`parameters.param(quant_group=...)`)."""
  return parameters.quant_group(variable)


def is_quantized_weight(variable, quant: QuantConfig | None = None) -> bool:
  """Whether a parameter (an `nnx.Variable`) is a linear weight FP4 quantizes: under
  `quant`'s scope if given, else under any scope (every linear weight)."""
  group = weight_group(variable)
  if group is None:
    return False
  return True if quant is None else quant.quantizes_weights(group)


def scale_groups(flat: Sequence[tuple[tuple, Any]], quant: QuantConfig | None = None):
  """The linear weights of a flat NNX state (`nnx.to_flat_state`) that FP4 quantizes (under
  `quant`'s scope if given) and that are not packed yet, as global-scale groups: tuples of
  paths, the siblings of one module that declare the same `scale_group` together, ordered by
  their declared position ([q, k, v], [gate, up]); every other weight alone."""
  groups: dict[tuple, list[tuple[int, tuple]]] = {}
  for path, variable in flat:
    path = tuple(path)
    if not is_quantized_weight(variable, quant) or isinstance(variable.get_value(), fp4.QArray):
      continue
    shared = parameters.scale_group(variable)
    key = (path[:-1], shared[0]) if shared is not None else (path,)
    groups.setdefault(key, []).append((shared[1] if shared is not None else 0, path))
  return [tuple(path for _, path in sorted(members)) for members in groups.values()]


def layer_sites(cfg, quant: QuantConfig | None) -> dict[int, tuple[str, ...]]:
  """The activation sites each layer of a model (ModelConfig `cfg`) quantizes in FP4 (the
  ones guidance can cover; W4A8's FP8 sites are not among them), from the declarations."""
  if quant is None or not quant.enabled:
    return {layer: () for layer in range(cfg.num_layers)}
  return {
    layer: tuple(
      s.name
      for s in SITES
      if s.present(cfg, layer) and quant.quantizes(s.name) and not quant.in_fp8(s.name)
    )
    for layer in range(cfg.num_layers)
  }
