"""Where the model quantizes, and how: `QuantConfig` and the per-forward `SiteQuantizer`.

Quantization sites (DESIGN.md section 2), per layer, each declared once
(`sites.declare_site`) beside the module call that quantizes it:
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

How a site runs (one seam for the rollout and the training path):
  1. the module calls `sites.sow_site(self, sq, x, layer=layer, site=SITE)` where the site
     is (`sites.sow_cache_entry` for a K/V cache entry);
  2. `SiteQuantizer.site` picks the rounding (nearest; guided by the rollout's record at
     guided layers) and calls the pure `quantize_site`, which materialises the site's input
     once (`site_input`) and quantizes it once, returning (values, record, fallback, input),
     the record already in the guidance's stored form (`Recording.form`: compact bits and
     scales, or full codes), the fused Pallas kernel's bits as it wrote them;
  3. the module sows the `SiteRecord` into the `nnx.Intermediate` collection, and
     `Transformer.__call__`, which runs its forward under `nnx.capture`, gathers them
     (`collect_site_records`) into `ModelOutput.sites` (and `fallbacks`, `site_inputs`),
     keyed (layer, site) by the module path.

Adding a site touches one place, the module that quantizes it: a `declare_site(...)` at
module level (its name, which layers have it, the named scopes that include it, whether it
is a cache entry or a routed-expert site, which dimension a sharded forward splits over
"model") and the `sow_site(..., site=THAT_SITE)` call (the linear weights it feeds name it
as their `input_site` where they are made). `ACTIVATION_SITES`, `SCOPE_SITES`, `KV_SITES`,
`layer_sites` (hence the guidance checks), the guidance buffers, their shardings and byte
accounting (an abstract forward) and an export's input scales all derive from those.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Mapping, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4, kernels as kernels_lib
from trace_jax.kernels import layout as kernel_layout
from trace_jax.model import layers, parameters
from trace_jax.model.parameters import WEIGHT_GROUPS
from trace_jax.utils.flags import knob
from trace_jax.model.sites import (
  SITE_SCOPES,
  SiteKey,
  SiteRecord,
  derived as _derived,
  registered_sites,
  site_spec,
)


def __getattr__(name: str):
  """ACTIVATION_SITES, SCOPE_SITES, KV_SITES and ROUTED_SITES, derived from the site
  declarations (`trace_jax.model.sites`)."""
  return _derived(name)


PRECISIONS = ("fp4", "bf16")
# The groups of linear weights (`parameters.WEIGHT_GROUPS`, declared on each weight); a
# scope quantizes whole groups.
SCOPE_WEIGHT_GROUPS = {"all": WEIGHT_GROUPS, "experts+kv": ("experts",)}
GUIDED_LAYER_NAMES = ("last_half", "all", "none")
# Activation formats: "fp4" (W4A4, in `fmt`) or "fp8" (W4A8: the linear layers' inputs in
# MXFP8 E4M3, `fp4.fake_quant_fp8`; the KV cache stays FP4 in `fmt`). FP8 sites round to
# nearest without guidance: full-code guidance would cost 8 bits per element, the FP8
# activation itself, and an FP8 flip moves a value by at most 1/8 relative (E2M1: 1/2).
ACTIVATION_FORMATS = ("fp4", "fp8")
KV_PRECISIONS = ("fp4", "bf16")  # the KV cache's (and the K/V sites') precision in scope
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


RECORD_FORMS = ("none",) + fp4.RECORD_FORMS + ("sparse",)


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
    if self.form not in RECORD_FORMS:
      raise ValueError(f"Recording.form={self.form!r} is not allowed; use one of {RECORD_FORMS}")
    if self.layers is not None:
      object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))

  @property
  def enabled(self) -> bool:
    return self.form != "none" or self.inputs

  def covers(self, layer: int) -> bool:
    return self.enabled and (self.layers is None or layer in self.layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP4Scheme:
  """A run's FP4 scheme, one value held by every config that needs it (RL run, rollout,
  studies, planner): the format, the scope of sites in FP4, and the format of the
  linear layers' inputs. `quant()` is the model's QuantConfig of it."""

  fmt: str = knob("nvfp4", "FP4 format: nvfp4 or mxfp4.")
  sites: str = knob(
    "all",
    "FP4 scope: all, or experts+kv (the method's: routed experts and KV cache).",
    flat="fp4_sites",
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
    for name, value, allowed in (
      ("fmt", self.fmt, sorted(fp4.FORMATS)),
      ("fp4_sites", self.sites, SITE_SCOPES),
      ("activations", self.activations, ACTIVATION_FORMATS),
      ("kv_precision", self.kv, KV_PRECISIONS),
    ):
      if value not in allowed:
        raise ValueError(f"{name}={value!r} (FP4Scheme) is not allowed; use one of {allowed}")

  def quant(self, **changes) -> "QuantConfig":
    return QuantConfig(
      fmt=self.fmt, sites=self.sites, activations=self.activations, kv=self.kv, **changes
    )

  def replace(self, **changes) -> "FP4Scheme":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
  """What a forward pass quantizes, and how it runs. `precision="bf16"` (or passing None)
  turns quantization off; the last three fields say how one call runs (kernels, what it
  records, its compute dtype), so a model call takes one config (`call_config`)."""

  precision: str = "fp4"  # "fp4" or "bf16" (no quantization)
  fmt: str = "nvfp4"  # "nvfp4" or "mxfp4"
  weights: bool = True  # quantize every linear weight
  sites: Union[str, tuple[str, ...]] = "all"  # FP4 scope: "all", "experts+kv", or a tuple
  #   of activation-site names (those sites; weights per `weights`)
  rounding: str = "nearest"  # at guided layers: "guided" (needs guidance); elsewhere nearest
  guided_layers: GuidedLayers = "last_half"  # which layers `rounding` applies to
  activations: str = "fp4"  # "fp4" (W4A4) or "fp8" (W4A8: linear inputs in MXFP8 E4M3,
  #   nearest rounding, no guidance; K/V stay FP4)
  kv: str = "fp4"  # "fp4": the K/V sites (and the cache) as `sites` says; "bf16": never FP4
  kernels: str = "xla"  # "xla", "pallas" or "auto" (Pallas on GPU): whether packed FP4
  #   weights and the FP4 cache go through `trace_jax.kernels` (forward only: the rollout)
  recording: Recording = Recording()  # what the call records of its sites (ModelOutput.sites)
  compute_dtype: str | None = None  # activations' dtype; None: the model's (ModelConfig.dtype)

  def __post_init__(self):
    if self.activations not in ACTIVATION_FORMATS:
      raise ValueError(
        f"QuantConfig.activations={self.activations!r} is not allowed; use one "
        f"of {ACTIVATION_FORMATS}"
      )
    if self.kv not in KV_PRECISIONS:
      raise ValueError(f"QuantConfig.kv={self.kv!r} is not allowed; use one of {KV_PRECISIONS}")
    if self.precision not in PRECISIONS:
      raise ValueError(
        f"QuantConfig.precision={self.precision!r} is not allowed; use one of {PRECISIONS}"
      )
    fp4.get_format(self.fmt)
    if self.rounding not in fp4.ROUNDING_MODES:
      raise ValueError(
        f"QuantConfig.rounding={self.rounding!r} is not allowed; use one of {fp4.ROUNDING_MODES}"
      )
    if isinstance(self.sites, str):
      if self.sites not in SITE_SCOPES:
        raise ValueError(
          f"QuantConfig.sites={self.sites!r} is not allowed; use one of "
          f"{SITE_SCOPES} or a tuple of sites from {_derived('ACTIVATION_SITES')}"
        )
    else:
      object.__setattr__(self, "sites", tuple(self.sites))
      known = _derived("ACTIVATION_SITES")
      unknown = [s for s in self.sites if s not in known]
      if unknown:
        raise ValueError(
          f"QuantConfig.sites has unknown sites {unknown}; allowed: "
          f"{known}, or a scope from {SITE_SCOPES}"
        )
    if not isinstance(self.guided_layers, (str, int)):
      object.__setattr__(self, "guided_layers", tuple(self.guided_layers))
    _check_layers_spec(self.guided_layers)
    kernels_lib.check_mode(self.kernels, "QuantConfig.kernels")
    if not isinstance(self.recording, Recording):
      raise ValueError(
        f"QuantConfig.recording must be a Recording, got {type(self.recording).__name__}"
      )
    if self.compute_dtype is not None:
      try:
        name = jnp.dtype(self.compute_dtype).name
      except TypeError as e:
        raise ValueError(f"QuantConfig.compute_dtype={self.compute_dtype!r} is not a dtype") from e
      object.__setattr__(self, "compute_dtype", name)

  @property
  def enabled(self) -> bool:
    return self.precision == "fp4"

  @property
  def activation_sites(self) -> tuple[str, ...]:
    """The activation sites this config's scope quantizes (whether or not enabled); the
    K/V sites only with `kv` "fp4"."""
    sites = _derived("SCOPE_SITES")[self.sites] if isinstance(self.sites, str) else self.sites
    if self.kv == "bf16":
      sites = tuple(s for s in sites if s not in _derived("KV_SITES"))
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


def call_config(quant: QuantConfig | None, **changes) -> QuantConfig:
  """`quant` (None: no quantization, `QuantConfig(precision="bf16")`) with fields changed,
  typically how one call runs: `kernels`, `recording`, `compute_dtype`."""
  return (QuantConfig(precision="bf16") if quant is None else quant).replace(**changes)


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
  sites = registered_sites()
  return {
    layer: tuple(
      s.name
      for s in sites
      if s.present(cfg, layer) and quant.quantizes(s.name) and not quant.in_fp8(s.name)
    )
    for layer in range(cfg.num_layers)
  }


def weight_layout(ndim: int) -> tuple[int, Any]:
  """(quantized axis, global_group) of a linear weight: [in, out] per matrix along `in`;
  stacked experts [E, in, out] along `in` with one global scale per expert."""
  if ndim == 2:
    return 0, "tensor"
  if ndim == 3:
    return 1, 0
  raise ValueError(f"a linear weight is [in, out] or [experts, in, out]; got {ndim} dims")


def quantize_weight(w: jax.Array, fmt: str, *, scale_rule: str = "standard") -> fp4.QArray:
  """The packed weight of the rollout path (made once per weight sync); `scale_rule`
  "4over6" is the post-training baseline's block-scale rule (fp4.quantize)."""
  axis, group = weight_layout(w.ndim)
  return fp4.quantize(w, fmt, axis=axis, global_group=group, scale_rule=scale_rule)


def _joint(ws: Sequence[jax.Array], quantize_fn):
  """Apply `quantize_fn` to the weights concatenated along their output axis, then split.

  Weights are quantized along `in` (blocks never cross columns), so the concatenation
  changes nothing but the global group: its amax is the largest of the siblings'.
  """
  widths = [w.shape[-1] for w in ws]
  shapes = {w.shape[:-1] for w in ws}
  if len(shapes) != 1:
    raise ValueError(
      f"weights sharing a global scale must agree on all but the output axis; "
      f"got shapes {[w.shape for w in ws]}"
    )
  joint = quantize_fn(jnp.concatenate(ws, axis=-1))
  bounds = np.cumsum(widths)[:-1].tolist()
  return joint, bounds


def quantize_weight_group(
  ws: Sequence[jax.Array], fmt: str, *, scale_rule: str = "standard"
) -> tuple[fp4.QArray, ...]:
  """Packed weights of siblings that share one global scale (per matrix, per expert).

  Each returned QArray holds its own copy of the shared global scale, so it dequantizes on
  its own exactly as the fused matrix does.
  """
  if len(ws) == 1:
    return (quantize_weight(ws[0], fmt, scale_rule=scale_rule),)
  q, bounds = _joint(ws, lambda w: quantize_weight(w, fmt, scale_rule=scale_rule))
  return tuple(
    fp4.QArray(packed=packed, scales=scales, global_scale=q.global_scale, fmt=q.fmt, axis=q.axis)
    for packed, scales in zip(
      jnp.split(q.packed, bounds, axis=-1), jnp.split(q.scales, bounds, axis=-1)
    )
  )


def fake_quant_weight_group(ws: Sequence[jax.Array], fmt: str) -> tuple[jax.Array, ...]:
  """The training path's weights of `quantize_weight_group`: the same values bit for bit
  (fake quantization of the concatenation), with a straight-through gradient."""

  def fake(w):
    axis, group = weight_layout(w.ndim)
    return fp4.fake_quant(w, fmt, axis=axis, global_group=group)

  if len(ws) == 1:
    return (fake(ws[0]),)
  values, bounds = _joint(ws, fake)
  return tuple(jnp.split(values, bounds, axis=-1))


@jax.custom_jvp
def _materialised(x: jax.Array) -> jax.Array:
  """x, made once in memory (`optimization_barrier`); its derivative is the identity, so
  the backward pass is the one without it."""
  return jax.lax.optimization_barrier(x)


@_materialised.defjvp
def _materialised_jvp(primals, tangents):
  return _materialised(primals[0]), tangents[0]


def site_input(x: jax.Array, *, kernel: bool) -> jax.Array:
  """The one value a site quantizes and records (`SiteRecord.input`), float32.

  Inside a fusion XLA may carry a bf16 activation in float32 (excess precision: it drops a
  round trip f32 -> bf16 -> f32) for one use and round it for another, so two reads of
  the same bf16 `x` can differ. Every site therefore reads one materialised value: the XLA
  quantizer's own first step, `x.astype(float32)`, with whatever precision XLA carries
  into it, as the quantizer read it before this barrier existed (the values the model
  computes with are unchanged); the Pallas kernel's operand, `x` itself in its dtype,
  which the kernel reads from memory anyway. The same barrier runs in every capture mode,
  recording or not, so what a rollout samples never depends on what it records.

  Args:
    x: the activation, any float dtype.
    kernel: the site quantizes with the fused Pallas kernel (nearest rounding, kernels on).
  Returns:
    float32, x's shape: exactly what the quantizer reads (`fp4.quantize` of it gives the
    site's record bit for bit).
  """
  if kernel:
    return _materialised(x).astype(jnp.float32)  # exact: the kernel reads x's dtype
  return _materialised(x.astype(jnp.float32))


def _kernel(kernels: str, rounding: Mapping[str, Any]) -> bool:
  """Whether a site quantizes with the fused Pallas kernel (nearest rounding only)."""
  return kernels == "pallas" and not rounding


def quantize_site(
  x: jax.Array,
  fmt: str,
  *,
  rounding: Mapping[str, Any],
  form: str,
  kernels: str,
  sparse: fp4.SparseSpec | None = None,
) -> tuple[jax.Array, Any, jax.Array | None, jax.Array]:
  """One activation site, per token (row): quantize once, return (values, record,
  fallback, input).

  A pure function. `rounding`: {} (nearest) or the rounding kwargs of `fp4.quantize`
  (stochastic with its key, guided with its guidance); `form`: "none", "compact" or "full"
  (the record's guidance form, None when "none"). The fused Pallas kernel (nearest
  rounding, `kernels="pallas"`) emits the compact guidance bits itself; the XLA path takes
  values and record from one pass of `fp4.fake_quant_record`. "sparse" (`sparse`: its
  `fp4.SparseSpec`) flags the boundary elements and scales from the input and the full
  record (`fp4.sparse_guidance`). Values, record and flags all come from one materialised
  input (`site_input`, returned as `input`), the same in every form.
  """
  kernel = _kernel(kernels, rounding)
  xq = site_input(x, kernel=kernel)
  fell_back = None
  if kernel:
    q, bits = kernels_lib.quantize(xq.astype(x.dtype), fmt)  # exact: xq holds x's values
    values = fp4.dequantize(q, x.dtype)
    record = q if form in ("full", "sparse") else None
    if form == "compact":
      record = fp4.CompactGuidance(
        global_scale=q.global_scale, scales=q.scales, mantissa_bits=bits, fmt=q.fmt, axis=q.axis
      )
  elif form == "none":
    values, record = fp4.fake_quant(xq, fmt, global_group="row", **rounding), None
  else:
    values, record, fell_back = fp4.fake_quant_record(
      xq, fmt, form="compact" if form == "compact" else "full", global_group="row", **rounding
    )
    fell_back = fell_back if rounding.get("rounding") == "guided" else None
  if form == "sparse":
    record = fp4.sparse_guidance(xq, record, sparse or fp4.SparseSpec())
  return values.astype(x.dtype), record, fell_back, xq


def cache_entry(
  x: jax.Array,
  fmt: str,
  *,
  rounding: Mapping[str, Any],
  form: str,
  kernels: str,
  sparse: fp4.SparseSpec | None = None,
) -> tuple[fp4.QArray, Any, jax.Array]:
  """A K or V cache site: (the packed entry the cache stores, its record in `form`, the
  materialised input both come from, as `quantize_site`)."""
  kernel = _kernel(kernels, rounding)
  xq = site_input(x, kernel=kernel)
  if kernel:
    q, bits = kernels_lib.quantize(xq.astype(x.dtype), fmt)
  else:
    q, bits = fp4.quantize(xq, fmt, global_group="row", **rounding), None
  record = None
  if form == "full":
    record = q
  elif form == "compact":
    record = (
      fp4.compact_guidance(q)
      if bits is None
      else fp4.CompactGuidance(
        global_scale=q.global_scale, scales=q.scales, mantissa_bits=bits, fmt=q.fmt, axis=q.axis
      )
    )
  elif form == "sparse":
    record = fp4.sparse_guidance(xq, q, sparse or fp4.SparseSpec())
  return q, record, xq


class SiteQuantizer:
  """How one forward pass quantizes: config, guidance, rounding, kernels (immutable).

  Created inside the forward; it collects nothing: `site` returns each site's record,
  which the module sows (`sow_site`) and the forward captures the Flax way.

  Args:
    quant: the QuantConfig (its `kernels` and `recording` say how this call runs), or None
      for no quantization.
    num_layers: the model's layer count (to resolve guided layers).
    dtype: compute dtype of the returned activations and weights.
    guidance: (layer, site) -> `fp4.QArray` (full), `fp4.CompactGuidance` or
      `fp4.SparseGuidance`, required for
      every quantized site of a guided layer when quant.rounding == "guided".
    key: PRNG key for quant.rounding == "stochastic".
  """

  def __init__(
    self,
    quant: QuantConfig | None,
    num_layers: int,
    dtype,
    *,
    guidance: Mapping[SiteKey, Any] | None = None,
    key: jax.Array | None = None,
  ):
    self.recording = self.recording_of(quant)
    self.kernels = kernels_lib.resolve(quant.kernels if quant is not None else "xla")
    self.quant = quant if quant is not None and quant.enabled else None
    self.dtype = dtype
    self.guidance = dict(guidance or {})
    self.key = key
    self.guided = set()
    if self.quant is not None and self.quant.rounding != "nearest":
      self.guided = set(self.quant.guided_layer_ids(num_layers))
      if self.quant.rounding == "stochastic" and key is None:
        raise ValueError(
          "QuantConfig.rounding='stochastic' needs a key: pass "
          "guidance=Guidance.of_key(key) to the forward"
        )
    if self.guidance and (self.quant is None or self.quant.rounding != "guided"):
      raise ValueError("guidance was given but QuantConfig.rounding is not 'guided'")

  @staticmethod
  def recording_of(quant: QuantConfig | None) -> Recording:
    """What a forward with `quant` records (nothing without a config)."""
    return quant.recording if quant is not None else Recording()

  def active(self, site: str) -> bool:
    return self.quant is not None and self.quant.quantizes(site)

  def records(self, layer: int) -> bool:
    """Whether this forward records the sites of `layer`."""
    return self.recording.covers(layer)

  def _rounding(self, layer: int, site: str) -> dict:
    if layer not in self.guided:
      return {}
    if self.quant.rounding == "stochastic":
      site_key = jax.random.fold_in(jax.random.fold_in(self.key, layer), zlib.crc32(site.encode()))
      return dict(rounding="stochastic", key=site_key)
    if (layer, site) not in self.guidance:
      raise ValueError(
        f"rounding='guided' at layer {layer} site {site!r}, but the guidance "
        f"has no entry for it (it has {sorted(self.guidance)[:8]}...)"
      )
    return dict(rounding="guided", guidance=self.guidance[(layer, site)])

  def site(
    self, x: jax.Array, layer: int, site: str, *, record: bool = True
  ) -> tuple[jax.Array, SiteRecord | None]:
    """Fake-quantize activation `x` [..., n] per row at (layer, site), quantizing once.

    Returns (values, SiteRecord or None); identity (and no record) where the scope leaves
    the site in high precision.
    """
    if not self.active(site):
      return x, None
    if self.quant.in_fp8(site):  # W4A8: nearest MXFP8, nothing recorded or guided
      return fp4.fake_quant_fp8(x), None
    keep = record and self.records(layer)
    form = self.recording.form if keep else "none"
    values, rec, fell_back, xq = quantize_site(
      x,
      self.quant.fmt,
      rounding=self._rounding(layer, site),
      form=form,
      kernels=self.kernels,
      sparse=self.recording.sparse.for_site(site),
    )
    if not keep:
      return values, None
    return values, SiteRecord(
      record=rec, fallback=fell_back, input=xq if self.recording.inputs else None
    )

  def __call__(self, x: jax.Array, layer: int, site: str) -> jax.Array:
    """The values of `site` alone (nothing recorded)."""
    return self.site(x, layer, site, record=False)[0]

  def cache_entry(
    self, x: jax.Array, layer: int, site: str
  ) -> tuple[fp4.QArray, SiteRecord | None]:
    """The packed FP4 entry of a K/V cache site, and its record."""
    keep = self.records(layer)
    q, rec, xq = cache_entry(
      x,
      self.quant.fmt,
      rounding=self._rounding(layer, site),
      form=self.recording.form if keep else "none",
      kernels=self.kernels,
      sparse=self.recording.sparse.for_site(site),
    )
    if not keep:
      return q, None
    return q, SiteRecord(record=rec, input=xq if self.recording.inputs else None)

  def weight(self, w, group: str) -> jax.Array:
    """A linear weight of `group` (one of `WEIGHT_GROUPS`) in the compute dtype: dequantized
    if packed (rollout path), fake-quantized from the master weight if the scope quantizes
    the group (training path), else just cast."""
    return self.weight_group((w,), group)[0]

  def weight_group(self, ws: Sequence[Any], group: str) -> tuple[jax.Array, ...]:
    """`weight` of sibling weights that share one global scale (their `scale_group`): the
    training path fake-quantizes them jointly, as `quantize_weight_group` packs them."""
    if isinstance(ws[0], kernel_layout.FusedWeight):  # fused for the kernels at weight sync
      ws = ws[0].parts()
    if all(isinstance(w, fp4.QArray) for w in ws):  # packed jointly by quantize_params
      return tuple(fp4.dequantize(w, self.dtype) for w in ws)
    if any(isinstance(w, fp4.QArray) for w in ws):
      raise ValueError("a shared-global-scale group mixes packed and unpacked weights")
    if self.quant is not None and self.quant.quantizes_weights(group):
      ws = fake_quant_weight_group(ws, self.quant.fmt)
    return tuple(w.astype(self.dtype) for w in ws)

  def on_kernels(self, w) -> bool:
    """Whether w is a packed weight (or fused siblings) that goes through the FP4 kernels."""
    return self.kernels == "pallas" and isinstance(w, (fp4.QArray, kernel_layout.FusedWeight))

  def fuses(self, site: str, layer: int) -> bool:
    """Whether activation site `site` at `layer` is quantized inside the Pallas kernel that
    consumes it (an FP4 GEMM's prologue, the cache write), recording what `site` would:
    kernels on, the site in FP4 (not FP8), nearest rounding there (the rollout's), and a
    record form the kernels emit (none, compact, full)."""
    return (
      self.kernels == "pallas"
      and self.active(site)
      and not self.quant.in_fp8(site)
      and layer not in self.guided
      and self.recording.form in ("none", "compact", "full")
    )

  def fused_record(self, x: jax.Array, layer: int, record) -> SiteRecord | None:
    """The `SiteRecord` of a site a kernel quantized (`fuses`): what `site` returns."""
    if not self.records(layer):
      return None
    return SiteRecord(record=record, input=x if self.recording.inputs else None)

  def record_form(self, layer: int) -> str:
    """The record form a fused kernel should emit at `layer`."""
    return self.recording.form if self.records(layer) else "none"

  def quantized_matmuls(
    self, x: jax.Array, ws: Sequence[Any], layer: int, site: str
  ) -> tuple[tuple[jax.Array, ...], SiteRecord | None]:
    """x [..., in] quantized at `site` inside the FP4 GEMM of its packed consumers `ws`
    (callers check `fuses` and `all(on_kernels(w))`): the GEMMs' outputs and the site's record.
    Siblings fused at weight sync (`kernels.layout.FusedWeight`) run as one GEMM."""
    outs, record = self._gemms(x, ws, quantize=self.quant.fmt, record=self.record_form(layer))
    return outs, self.fused_record(x, layer, record)

  def _gemms(self, x, ws, *, quantize, record):
    if isinstance(ws[0], kernel_layout.FusedWeight):
      y, rec = kernels_lib.fp4_gemm(x, ws[0], quantize=quantize, record=record, out_dtype=x.dtype)
      return tuple(jnp.split(y, np.cumsum(ws[0].widths)[:-1].tolist(), axis=-1)), rec
    results = [
      kernels_lib.fp4_gemm(
        x, w, quantize=quantize, record=record if i == 0 else "none", out_dtype=x.dtype
      )
      for i, w in enumerate(ws)
    ]
    return tuple(y for y, _ in results), results[0][1]

  def matmul(self, x: jax.Array, w, group: str) -> jax.Array:
    """x [..., in] @ w [in, out] (float32 accumulation, x's dtype), w of weight `group`; a
    packed weight goes through the FP4 GEMM kernel when kernels are on."""
    if self.on_kernels(w):
      return self._gemms(x, [w], quantize=None, record="none")[0][0]
    return layers.matmul(x, self.weight(w, group))

  def ragged_dot(self, lhs: jax.Array, w, group_sizes: jax.Array) -> jax.Array:
    """Grouped matmul of rows sorted by expert with stacked routed-expert weights [E, in, out]
    (XLA; the Pallas path of the routed experts is `kernels.moe_experts`, expert-major)."""
    return layers.ragged_matmul(lhs, self.weight(w, "experts"), group_sizes)

  def matmuls(self, x: jax.Array, ws: Sequence[Any], group: str) -> tuple[jax.Array, ...]:
    """`matmul` of one input with sibling weights of `group` that share one global scale."""
    if all(self.on_kernels(w) for w in ws if not isinstance(w, kernel_layout.FusedPart)):
      return self._gemms(x, ws, quantize=None, record="none")[0]
    return tuple(layers.matmul(x, w) for w in self.weight_group(ws, group))

  def ragged_dots(
    self, lhs: jax.Array, ws: Sequence[Any], group_sizes: jax.Array
  ) -> tuple[jax.Array, ...]:
    """`ragged_dot` of one input with sibling expert weights that share global scales."""
    return tuple(
      layers.ragged_matmul(lhs, w, group_sizes) for w in self.weight_group(ws, "experts")
    )
