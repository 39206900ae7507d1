"""TRACE guidance: what the rollout records of its FP4 rounding, for the trainer to follow.

One pytree type, defined here once: the rollout engine captures it, the training path
consumes it. For every guided (layer, site) it holds, aligned with the rollout's token
slots [B, S]:
  compact  `fp4.CompactGuidance`: per-row global scale (f32), E4M3 block-scale bits and the
           mantissa bit of every element (8 per uint8): 1.5 bits per element;
  full     `fp4.QArray`: global scale, block scales and whole 4-bit codes: 4.5 bits;
  sparse   `fp4.SparseGuidance`: positions and mantissa bits of the elements near an E2M1
           rounding boundary, positions and bits of the block scales near an E4M3 one
           (`fp4.sparse`); its bytes depend on the data (measured, `nbytes(mask)`);
and the experts every MoE layer chose (routing replay), int8 (int16 past 127 experts),
[num_moe_layers, B, S, k]. It lives on the host between rollout and training
(`to_host` / `to_device`) and can be spilled to disk for long trajectories (`save`/`load`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4
from trace_jax.utils.io import write_atomic

# What a rollout records and training follows: nothing, an FP4 record form, or sparse records
GUIDANCE_MODES = ("none",) + fp4.RECORD_FORMS + ("sparse",)
SiteKey = tuple[int, str]  # (layer, site name): the key of a site's records and guidance


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["sites", "routing", "key"],
  meta_fields=["mode", "layers"],
)
@dataclasses.dataclass(frozen=True)
class Guidance:
  """Recorded FP4 rounding outcomes and routing of a batch of trajectories.

  Attributes:
    sites: {(layer, site): fp4.CompactGuidance (compact) or fp4.QArray (full)}, every
      array [B, S, ...] in the rollout's slot order.
    routing: int8/int16 [num_moe_layers, B, S, k] chosen experts, or None.
    mode: "compact", "full", "sparse" or "none" (routing only).
    layers: the guided layer ids.
    key: a PRNG key for `QuantConfig(rounding="stochastic")` (its rounding decisions are
      drawn, not recorded), or None; not saved by `save`.
  """

  sites: dict
  routing: Any
  mode: str
  layers: tuple
  key: Any = None

  def __post_init__(self):
    if self.mode not in GUIDANCE_MODES:
      raise ValueError(f"Guidance.mode={self.mode!r} is not allowed; use one of {GUIDANCE_MODES}")
    if isinstance(self.sites, Mapping) and not isinstance(self.sites, dict):
      # records stacked by layer (`ModelOutput.sites` of a scanned call): one entry per site
      object.__setattr__(self, "sites", dict(self.sites))

  @classmethod
  def of_key(cls, key) -> "Guidance":
    """The guidance of stochastic rounding: no records, no routing, just the PRNG key."""
    return cls(sites={}, routing=None, mode="none", layers=(), key=key)

  @property
  def tokens_shape(self) -> tuple[int, int]:
    """(B, S) of the trajectories this guidance is aligned with."""
    if self.sites:
      first = next(iter(self.sites.values()))
      leaf = first.count if isinstance(first, fp4.SparseGuidance) else first.global_scale
      return tuple(leaf.shape[:2])
    if self.routing is not None:
      return tuple(self.routing.shape[1:3])
    return (0, 0)

  def nbytes(self, mask=None) -> dict[str, int]:
    """Bytes by kind: "scales" (global and block), "bits" (mantissa bits or codes),
    "positions" (sparse: the flagged positions, encoded), "routing", "total".

    Compact and full guidance cost the same in every token slot; sparse guidance is
    measured on its data (`fp4.sparse.site_bits`, each site's smallest encoding) over the
    slots of `mask` (bool [B, S], real tokens; None: every slot)."""
    scales = bits = positions = 0
    slots = int(np.prod(self.tokens_shape)) if mask is None else int(np.asarray(mask).sum())
    for g in self.sites.values():
      if isinstance(g, fp4.SparseGuidance):
        if isinstance(g.count, jax.ShapeDtypeStruct):
          raise ValueError(
            "sparse guidance bytes depend on the data (the flagged share); "
            "measure them on a capture (mismatch study) instead of from shapes"
          )
        measured = fp4.sparse.site_bits(jax.device_get(g), mask)
        scales += measured["scales"] / 8
        bits += measured["bits"] / 8
        positions += measured["positions"] / 8
        continue
      per_slot = (_bytes(g.global_scale) + _bytes(g.scales)) / max(np.prod(self.tokens_shape), 1)
      scales += per_slot * slots
      stored = g.mantissa_bits if isinstance(g, fp4.CompactGuidance) else g.packed
      bits += _bytes(stored) / max(np.prod(self.tokens_shape), 1) * slots
    routing = 0
    if self.routing is not None:
      routing = _bytes(self.routing) / max(np.prod(self.routing.shape[1:3]), 1) * slots
    out = {"scales": scales, "bits": bits, "routing": routing}
    if self.mode == "sparse":
      out["positions"] = positions
    out = {k: int(v) if float(v).is_integer() else float(v) for k, v in out.items()}
    out["total"] = sum(out.values())
    return out

  def bytes_per_token(self, mask=None) -> float:
    """Every byte the guidance carries (scales, bits or codes, positions, routing) per token
    slot (per real token with `mask`, bool [B, S])."""
    b, s = self.tokens_shape
    slots = b * s if mask is None else int(np.asarray(mask).sum())
    return self.nbytes(mask)["total"] / max(slots, 1)

  def sparse_stats(self, mask=None) -> dict:
    """Sparse guidance only: the flag densities, overflows and encodings measured over the
    slots of `mask` ({} for other modes): "guidance/sparse_density" (flagged elements /
    elements), "guidance/sparse_block_density", "guidance/sparse_overflow" (flags beyond
    the buffers' capacity: rounded to nearest in training), "guidance/sparse_block_overflow"
    and per site {"per_site": {(layer, site): fp4.sparse.site_bits(...)}}."""
    if self.mode != "sparse":
      return {}
    per_site = {key: fp4.sparse.site_bits(jax.device_get(g), mask) for key, g in self.sites.items()}
    total = lambda name: sum(v[name] for v in per_site.values())  # noqa: E731
    return {
      "guidance/sparse_density": total("flagged") / max(total("elements"), 1),
      "guidance/sparse_block_density": total("flagged_blocks") / max(total("blocks"), 1),
      "guidance/sparse_overflow": total("overflow"),
      "guidance/sparse_block_overflow": total("block_overflow"),
      "per_site": per_site,
    }

  def select_layers(self, layers) -> "Guidance":
    """The guidance of a subset of the guided layers (routing kept)."""
    layers = tuple(sorted(set(int(i) for i in layers)))
    missing = [i for i in layers if i not in self.layers]
    if missing:
      raise ValueError(f"layers {missing} are not guided here (guided: {self.layers})")
    sites = {k: v for k, v in self.sites.items() if k[0] in layers}
    return Guidance(sites=sites, routing=self.routing, mode=self.mode, layers=layers)

  def to_compact(self) -> "Guidance":
    """Compact guidance from full guidance: the same scales and the codes' mantissa bits,
    exactly what a compact capture of the same rollout records."""
    if self.mode == "compact":
      return self
    if self.mode != "full":
      raise ValueError(
        f"only full guidance holds codes to make compact guidance of; mode={self.mode!r}"
      )
    sites = {k: fp4.compact_guidance(q) for k, q in self.sites.items()}
    return dataclasses.replace(self, sites=sites, mode="compact")

  def to_sparse(self, inputs: Mapping[SiteKey, Any], spec: "fp4.SparseSpec" = None) -> "Guidance":
    """Sparse guidance from full guidance and the rollout's site inputs
    (`Rollout.site_inputs`): exactly what a sparse capture of the same rollout records."""
    if self.mode != "full":
      raise ValueError(
        f"sparse guidance is made from full guidance (codes and scales); mode={self.mode!r}"
      )
    spec = fp4.SparseSpec() if spec is None else spec
    missing = sorted(set(self.sites) - set(inputs))
    if missing:
      raise ValueError(f"the site inputs lack {missing[:6]} (capture_inputs=True on the engine)")
    sites = {
      k: fp4.sparse_guidance(inputs[k], q, spec.for_site(k[1])) for k, q in self.sites.items()
    }
    return dataclasses.replace(self, sites=sites, mode="sparse")

  def take(self, rows) -> "Guidance":
    """The guidance of some sequences (a minibatch): rows index the batch axis."""
    return dataclasses.replace(
      self,
      sites=jax.tree.map(lambda a: a[rows], self.sites),
      routing=None if self.routing is None else self.routing[:, rows],
    )

  def trim(self, slots: int) -> "Guidance":
    """The first `slots` token slots."""
    return dataclasses.replace(
      self,
      sites=jax.tree.map(lambda a: a[:, :slots], self.sites),
      routing=None if self.routing is None else self.routing[:, :, :slots],
    )

  def without_routing(self) -> "Guidance":
    return dataclasses.replace(self, routing=None)

  def to_host(self) -> "Guidance":
    """A copy whose arrays are NumPy arrays in host memory."""
    return jax.device_get(self)

  def to_device(self, sharding=None) -> "Guidance":
    return jax.device_put(self, sharding)

  def save(self, path: str) -> None:
    """Write to one .npz file atomically (`utils.io.write_atomic`: a temporary file, fsynced,
    renamed into place), with a SHA-256 of its contents that `load` verifies."""
    arrays = {}
    for (layer, site), g in self.sites.items():
      for field in dataclasses.fields(g):
        value = getattr(g, field.name)
        if not isinstance(value, (str, int)):  # fmt, axis (and n) go into the meta entry
          arrays[f"site/{layer}/{site}/{field.name}"] = np.asarray(value)
      kind = (
        "full"
        if isinstance(g, fp4.QArray)
        else "sparse"
        if isinstance(g, fp4.SparseGuidance)
        else "compact"
      )
      extra = {"n": g.n} if kind == "sparse" else {}
      arrays[f"meta/{layer}/{site}"] = np.asarray(
        json.dumps({"kind": kind, "fmt": g.fmt, "axis": g.axis, **extra})
      )
    if self.routing is not None:
      arrays["routing"] = np.asarray(self.routing)
    meta = {"mode": self.mode, "layers": list(self.layers)}
    arrays["meta"] = np.asarray(json.dumps({**meta, "sha256": _digest(arrays, meta)}))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(path, buffer.getvalue())

  @classmethod
  def load(cls, path: str) -> "Guidance":
    """Read what `save` wrote; arrays come back as host NumPy arrays.

    Raises:
      ValueError: naming the file, when it is not a whole guidance file or its contents
        differ from the checksum saved with them (a damaged file never loads silently).
    """
    try:
      return cls._load(path)
    except FileNotFoundError:
      raise
    except Exception as e:  # noqa: BLE001 - zip, npy, JSON and checksum faults all mean "damaged"
      raise ValueError(
        f"{path} is not a readable guidance file ({type(e).__name__}: "
        f"{str(e)[:200]}); it is damaged: delete it and roll out again"
      ) from e

  @classmethod
  def _load(cls, path: str) -> "Guidance":
    with np.load(path, allow_pickle=False) as data:
      arrays = {name: data[name] for name in data.files}
    meta = json.loads(str(arrays["meta"]))
    saved = meta.pop("sha256", None)
    if saved is None:
      raise ValueError("it holds no checksum (saved by an older trace_jax?)")
    content = {k: v for k, v in arrays.items() if k != "meta"}
    if _digest(content, meta) != saved:
      raise ValueError("its contents differ from the SHA-256 saved with them")
    sites = {}
    for name in arrays:
      if not name.startswith("meta/"):
        continue
      _, layer, site = name.split("/")
      info = json.loads(str(arrays[name]))
      get = lambda field: arrays[f"site/{layer}/{site}/{field}"]
      if info["kind"] == "sparse":
        g = fp4.SparseGuidance(
          **{f: get(f) for f in _SPARSE_FIELDS}, fmt=info["fmt"], n=int(info["n"])
        )
      elif info["kind"] == "full":
        g = fp4.QArray(
          packed=get("packed"),
          scales=get("scales"),
          global_scale=get("global_scale"),
          fmt=info["fmt"],
          axis=info["axis"],
        )
      else:
        g = fp4.CompactGuidance(
          global_scale=get("global_scale"),
          scales=get("scales"),
          mantissa_bits=get("mantissa_bits"),
          fmt=info["fmt"],
          axis=info["axis"],
        )
      sites[(int(layer), site)] = g
    routing = arrays.get("routing")
    return cls(sites=sites, routing=routing, mode=meta["mode"], layers=tuple(meta["layers"]))


_SPARSE_FIELDS = ("index", "mantissa_bits", "count", "block_index", "block_scales", "block_count")


def _digest(arrays: Mapping[str, np.ndarray], meta: dict) -> str:
  """SHA-256 over the names, dtypes, shapes and bytes of `arrays` (sorted) and `meta`."""
  h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
  for name in sorted(arrays):
    a = np.ascontiguousarray(arrays[name])
    h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def _bytes(a) -> int:
  return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def routing_dtype(num_experts: int):
  return jnp.int8 if num_experts <= 127 else jnp.int16


def from_records(records: Mapping[SiteKey, fp4.QArray], mode: str, layers) -> dict:
  """The guidance entries of recorded site QArrays for the guided layers."""
  if mode not in GUIDANCE_MODES:
    raise ValueError(f"guidance mode {mode!r} is not allowed; use one of {GUIDANCE_MODES}")
  if mode == "none":
    return {}
  if mode == "sparse":
    raise ValueError(
      "sparse guidance is made from the site inputs too: use "
      "Guidance.to_sparse(inputs) or a sparse capture (Recording(form='sparse'))"
    )
  layers = set(layers)
  out = {}
  for key, q in records.items():
    if key[0] in layers:
      out[key] = q if mode == "full" else fp4.compact_guidance(q)
  return out


def check_fits(
  guidance: Guidance, *, tokens_shape, required, num_moe_layers=None, mode=None
) -> None:
  """Raise a ValueError saying what differs if `guidance` does not fit a training batch.

  Args:
    tokens_shape: (B, S) of the batch.
    required: the (layer, site) keys the training config rounds by guidance.
    num_moe_layers: expected routing layers (None: routing replay not asked for).
    mode: expected mode ("compact" / "full"), or None for either.
  """
  if mode is not None and guidance.mode != mode:
    raise ValueError(f"guidance mode is {guidance.mode!r}; the training config expects {mode!r}")
  if (guidance.sites or guidance.routing is not None) and tuple(guidance.tokens_shape) != tuple(
    tokens_shape
  ):
    raise ValueError(
      f"guidance covers {guidance.tokens_shape[0]} sequences x "
      f"{guidance.tokens_shape[1]} slots; the batch is {tokens_shape[0]} x "
      f"{tokens_shape[1]} (misaligned positions or another batch)"
    )
  required = set(required)
  missing_layers = sorted({layer for layer, _ in required} - set(guidance.layers))
  if missing_layers:
    raise ValueError(
      f"the training config guides layers {sorted({l for l, _ in required})}; "
      f"the guidance has layers {list(guidance.layers)} (missing {missing_layers})"
    )
  if required and guidance.mode == "none":
    raise ValueError("the training config rounds by guidance, but the guidance mode is 'none'")
  missing = sorted(required - set(guidance.sites))
  if missing:
    raise ValueError(f"guidance lacks sites {missing[:6]}")
  if num_moe_layers is not None:
    if guidance.routing is None:
      raise ValueError("routing replay needs recorded routing; the guidance has none")
    if guidance.routing.shape[0] != num_moe_layers:
      raise ValueError(
        f"guidance routing covers {guidance.routing.shape[0]} MoE layers; the "
        f"model has {num_moe_layers}"
      )
