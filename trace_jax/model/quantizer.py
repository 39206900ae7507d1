"""How one forward pass quantizes: the `SiteQuantizer`, the pure site and cache-entry
quantizers it calls, and the linear weights' packing (rollout) and fake quantization
(training path). What is quantized, and in which scope, is `quant.py` (`QuantConfig`).

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

All arithmetic is `trace_jax.fp4`'s; nothing here rounds by itself.
"""

from __future__ import annotations

import copy

import zlib
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4, kernels as kernels_lib
from trace_jax.kernels import layout as kernel_layout
from trace_jax.model import layers
from trace_jax.model.quant import CallOptions, QuantConfig
from trace_jax.model.sites import SiteKey, SiteRecord


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
    q, bits = kernels_lib.fused_quantize(xq.astype(x.dtype), fmt)  # exact: xq holds x's values
    values = fp4.dequantize(q, x.dtype)
    record = None if form == "none" else q  # full, sparse: the codes
    if form == "compact":
      record = fp4.compact_guidance(q, bits)
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
    q, bits = kernels_lib.fused_quantize(xq.astype(x.dtype), fmt)
  else:
    q, bits = fp4.quantize(xq, fmt, global_group="row", **rounding), None
  record = None
  if form == "full":
    record = q
  elif form == "compact":
    record = fp4.compact_guidance(q, bits)
  elif form == "sparse":
    record = fp4.sparse_guidance(xq, q, sparse or fp4.SparseSpec())
  return q, record, xq


class SiteQuantizer:
  """How one forward pass quantizes: config, guidance, rounding, kernels (immutable).

  Created inside the forward; it collects nothing: `site` returns each site's record,
  which the module sows (`sow_site`) and the forward captures the Flax way.

  Args:
    quant: the QuantConfig (what is quantized), or None for no quantization.
    num_layers: the model's layer count (to resolve guided layers).
    dtype: compute dtype of the returned activations and weights.
    options: how this call runs: its `kernels` and what it records (`recording`);
      default `CallOptions()`.
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
    options: CallOptions | None = None,
    guidance: Mapping[SiteKey, Any] | None = None,
    key: jax.Array | None = None,
  ):
    options = CallOptions() if options is None else options
    self.recording = options.recording
    self.kernels = options.kernels  # "pallas" or "xla"
    self.moe_blocks = options.moe_blocks
    self.router_dtype = options.router_dtype
    self.quant = quant if quant is not None and quant.enabled else None
    self.dtype = dtype
    self.guidance = dict(guidance or {})
    self.key = key
    self.layer_ids = {}  # layer -> the traced layer id it stands for (`relabelled`)
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

  def relabelled(self, layer: int, layer_id: jax.Array, guidance: Mapping[str, Any]):
    """A copy in which `layer` stands for the traced layer `layer_id` (one step of a scan
    over alike layers): its guidance is `guidance` ({site: entry}) and its stochastic keys
    fold `layer_id`, so the step quantizes as the real layer would."""
    out = copy.copy(self)
    out.guidance = {k: v for k, v in self.guidance.items() if k[0] != layer}
    out.guidance.update({(layer, site): g for site, g in guidance.items()})
    out.layer_ids = {**self.layer_ids, layer: layer_id}
    return out

  def active(self, site: str) -> bool:
    return self.quant is not None and self.quant.quantizes(site)

  def records(self, layer: int) -> bool:
    """Whether this forward records the sites of `layer`."""
    return self.recording.covers(layer)

  def _rounding(self, layer: int, site: str) -> dict:
    if layer not in self.guided:
      return {}
    if self.quant.rounding == "stochastic":
      layer_id = self.layer_ids.get(layer, layer)
      site_key = jax.random.fold_in(
        jax.random.fold_in(self.key, layer_id), zlib.crc32(site.encode())
      )
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

  def ragged_dot(
    self, lhs: jax.Array, w, group_sizes: jax.Array, *, tile: int | None = None
  ) -> jax.Array:
    """Grouped matmul of rows sorted by expert with stacked routed-expert weights [E, in, out]
    (XLA, `layers.ragged_matmul`, its `tile`; the Pallas path of the routed experts is
    `kernels.moe_experts`, expert-major)."""
    return layers.ragged_matmul(lhs, self.weight(w, "experts"), group_sizes, tile=tile)

  def matmuls(self, x: jax.Array, ws: Sequence[Any], group: str) -> tuple[jax.Array, ...]:
    """`matmul` of one input with sibling weights of `group` that share one global scale."""
    if all(self.on_kernels(w) for w in ws if not isinstance(w, kernel_layout.FusedPart)):
      return self._gemms(x, ws, quantize=None, record="none")[0]
    return tuple(layers.matmul(x, w) for w in self.weight_group(ws, group))

  def ragged_dots(
    self, lhs: jax.Array, ws: Sequence[Any], group_sizes: jax.Array, *, tile: int | None = None
  ) -> tuple[jax.Array, ...]:
    """`ragged_dot` of one input with sibling expert weights that share global scales."""
    return tuple(
      layers.ragged_matmul(lhs, w, group_sizes, tile=tile) for w in self.weight_group(ws, "experts")
    )
