"""The quantization sites, written down once: `Site` declarations and the lists they make.

A site is where an activation is quantized (DESIGN.md section 2). Each is declared here once
(`ATTN_IN`, ..., `MLP_MID`): which layers have it, the named FP4 scopes that include it,
whether it is a cache entry or a routed-expert site, and which dimension of its records a
sharded forward splits over "model". The module that quantizes it (attention.py: attn_in,
attn_out, k, v; deltanet.py: attn_in, attn_out; moe.py: moe_in, moe_mid, shared_mid;
transformer.py and moe.py: mlp_in, mlp_mid) imports its `Site` and passes it to `sow_site`.
Everything else reads the declarations: `SITES`, and the constants computed from them right
below (`ACTIVATION_SITES`, `SCOPE_SITES`, `KV_SITES`, `ROUTED_SITES`), `quant.layer_sites`
(hence the guidance checks), the guidance's shardings (`sharding.guidance_site_specs`), and,
through an abstract forward, the guidance buffers and their bytes. The linear weights a site
feeds name it (`parameters.input_site`).

At run time the module calls `sow_site` (or `sow_cache_entry`), which quantizes through the
forward's `SiteQuantizer` and sows the site's `SiteRecord` into `nnx.Intermediate`;
`Transformer.__call__` runs under `nnx.capture` and gathers them (`collect_site_records`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
from flax import nnx, struct

from trace_jax.guidance import SiteKey
from trace_jax.model.scan import in_key_order

# Named FP4 scopes (DESIGN.md section 2); each site declares the scopes that include it.
SITE_SCOPES = ("all", "experts+kv")


def _every_layer(cfg, layer: int) -> bool:
  return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Site:
  """One activation quantization site.

  Attributes:
    name: the key of its records and guidance, (layer, name).
    present: (ModelConfig, layer) -> whether that layer of a model has the site.
    scopes: the named FP4 scopes (`SITE_SCOPES`) that quantize it; "all" always does (it is
      added first if not given).
    cache: a K/V cache entry: stored packed in the cache (`sow_cache_entry`), and FP4 even
      under W4A8 (`QuantConfig.activations="fp8"` rounds only the linear inputs to FP8).
    routed: its rows are (token, chosen expert): its guidance only fits the rollout's experts,
      so guiding it needs routing replay.
    model_dim: the dimension of its records [B, S, ...] that a sharded forward splits over
      the "model" mesh axis (K/V: the KV-head axis; the input of a row-split projection: its
      width, -1), so guidance is kept where the activation is; None: not split.
  """

  name: str
  present: Callable[[Any, int], bool] = _every_layer
  scopes: tuple[str, ...] = ("all",)
  cache: bool = False
  routed: bool = False
  model_dim: int | None = None

  def __post_init__(self):
    scopes = ("all",) + tuple(s for s in self.scopes if s != "all")
    bad = [s for s in scopes if s not in SITE_SCOPES]
    if bad:
      raise ValueError(f"Site({self.name!r}).scopes: {bad} are not among {SITE_SCOPES}")
    object.__setattr__(self, "scopes", scopes)


def _has_kv(cfg, layer: int) -> bool:
  """Full-attention layers keep a K/V cache; linear (DeltaNet) layers a recurrent state."""
  return layer not in cfg.linear_layers


def _moe(cfg, layer: int) -> bool:
  return layer not in cfg.dense_layers


def _dense(cfg, layer: int) -> bool:
  return layer in cfg.dense_layers


def _shared_expert(cfg, layer: int) -> bool:
  return _moe(cfg, layer) and bool(cfg.shared_expert_dim)


# The token mixer's sites (softmax attention; Gated DeltaNet layers have them too).
# Input of the q/k/v projections (DeltaNet: of in_proj_qkv and in_proj_z).
ATTN_IN = Site(name="attn_in")
# Input of the output projection, split over "model" along its width like o_proj's rows.
ATTN_OUT = Site(name="attn_out", model_dim=-1)
# K and V cache entries, after RoPE (k), per (token, KV head); full-attention layers only.
K = Site(name="k", present=_has_kv, scopes=("experts+kv",), cache=True, model_dim=2)
V = Site(name="v", present=_has_kv, scopes=("experts+kv",), cache=True, model_dim=2)
# Input of the routed experts' gate/up projections (and the shared expert's), once per token.
MOE_IN = Site(name="moe_in", present=_moe, scopes=("experts+kv",))
# Input of each routed expert's down projection, per (token, chosen expert) row. The inputs
# of every down projection are split over "model" along their width, like its rows.
MOE_MID = Site(name="moe_mid", present=_moe, scopes=("experts+kv",), routed=True, model_dim=-1)
# Input of the shared expert's down projection, per token.
SHARED_MID = Site(name="shared_mid", present=_shared_expert, model_dim=-1)
# A dense feed-forward layer's input and the input of its down projection.
MLP_IN = Site(name="mlp_in", present=_dense)
MLP_MID = Site(name="mlp_mid", present=_dense, model_dim=-1)


def site_table(sites: Sequence[Site]) -> dict[str, Site]:
  """{name: site} of `sites`, in their order; a name declared twice is an error."""
  table: dict[str, Site] = {}
  for site in sites:
    if site.name in table:
      raise ValueError(f"site {site.name!r} is declared twice; site names are unique")
    table[site.name] = site
  return table


# Every site, in declaration order, and the lists derived from them.
SITES = (ATTN_IN, ATTN_OUT, K, V, MOE_IN, MOE_MID, SHARED_MID, MLP_IN, MLP_MID)
_BY_NAME = site_table(SITES)
ACTIVATION_SITES = tuple(_BY_NAME)
SCOPE_SITES = {scope: tuple(s.name for s in SITES if scope in s.scopes) for scope in SITE_SCOPES}
KV_SITES = tuple(s.name for s in SITES if s.cache)  # cache entries
ROUTED_SITES = tuple(s.name for s in SITES if s.routed)  # (token, chosen expert) rows


def site_spec(name: str) -> Site:
  """The declaration of site `name`."""
  if name not in _BY_NAME:
    raise ValueError(f"unknown quantization site {name!r}; declared: {ACTIVATION_SITES}")
  return _BY_NAME[name]


@struct.dataclass
class SiteRecord:
  """What one quantization site reports beside its values (sown as an nnx.Intermediate).

  Attributes:
    record: the site's quantization outcome in guidance form (`fp4.QArray` for "full",
      `fp4.CompactGuidance` for "compact", `fp4.SparseGuidance` for "sparse"), or None.
    fallback: bool, input-shaped: where guided rounding fell back (guided sites), or None.
    input: the activation as the quantizer read it, float32 (`quantizer.site_input`; with
      `Recording.inputs`), or None: `fp4.quantize` of it is the record, bit for bit.
  """

  record: Any = None
  fallback: Any = None
  input: Any = None


def sow_site(module: nnx.Module, sq, x: jax.Array, *, layer: int, site: Site) -> jax.Array:
  """Quantize activation site `site` of `module` at `layer` through the forward's
  `quantizer.SiteQuantizer` `sq`; sow its record (if any) into
  the `nnx.Intermediate` collection, which `Transformer.__call__` captures."""
  values, record = sq.site(x, layer, site.name)
  if record is not None:
    module.sow(nnx.Intermediate, site.name, record)
  return values


def sow_cache_entry(module: nnx.Module, sq, x: jax.Array, *, layer: int, site: Site):
  """A K/V cache site of `module`: the packed FP4 entry the cache stores if the scope
  quantizes it (its record sown as `sow_site` does), else `x` itself."""
  if not sq.active(site.name):
    return x
  entry, record = sq.cache_entry(x, layer, site.name)
  if record is not None:
    module.sow(nnx.Intermediate, site.name, record)
  return entry


@struct.dataclass
class ScannedSiteRecord:
  """The `SiteRecord`s of one site at the layers of a scanned run (`Transformer` sows it on
  itself): each field stacked along a leading axis, one entry per layer of `layers`."""

  record: SiteRecord
  layers: tuple = struct.field(pytree_node=False)
  site: str = struct.field(pytree_node=False)


def _sown_items(sown):
  """(path, item) of every value sown in a forward's captured `nnx.Intermediate` state
  (what `nnx.capture` returns; a name sown twice holds a tuple)."""
  for path, variable in nnx.to_flat_state(sown):
    value = variable.get_value() if hasattr(variable, "get_value") else variable
    for item in value if isinstance(value, tuple) else (value,):
      yield path, item


def collect_site_records(sown) -> dict[SiteKey, SiteRecord]:
  """The `SiteRecord`s of a forward's captured `nnx.Intermediate` state: {(layer, site):
  record}. Sites live at `blocks/<layer>/.../<site>`; the runs of scanned layers, kept
  stacked, are `collect_scanned_site_records`'."""
  return {
    (int(path[1]), str(path[-1])): item
    for path, item in _sown_items(sown)
    if isinstance(item, SiteRecord)
  }


def collect_scanned_site_records(sown) -> list[ScannedSiteRecord]:
  """The `ScannedSiteRecord`s of a forward's captured `nnx.Intermediate` state."""
  return [item for _, item in _sown_items(sown) if isinstance(item, ScannedSiteRecord)]


def site_record_field(records, scanned, field: str):
  """One `SiteRecord` field of a forward's records ({(layer, site): SiteRecord}, the
  unrolled layers') and its scanned runs' (`ScannedSiteRecord`s): {(layer, site): value}
  where nothing ran under a scan, else a `ByLayer` of the same items, its runs kept in
  their stacks. A None field is left out."""
  per_layer = {k: getattr(r, field) for k, r in records.items() if getattr(r, field) is not None}
  runs = [s for s in scanned if getattr(s.record, field) is not None]
  if not runs:
    return per_layer
  parts = [((k,), jax.tree.map(lambda a: a[None], v)) for k, v in per_layer.items()]
  parts += [(tuple((layer, s.site) for layer in s.layers), getattr(s.record, field)) for s in runs]
  return ByLayer.from_parts(parts)


@functools.lru_cache(maxsize=64)
def _positions(keys_by_stack: tuple) -> dict:
  """{key: (stack, index)} of a `ByLayer`'s keys."""
  return {key: (s, i) for s, group in enumerate(keys_by_stack) for i, key in enumerate(group)}


def _entry(stack, i: int):
  """Entry `i` of a stack (its shape and dtype, for an abstract one)."""
  if isinstance(stack, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(stack.shape[1:], stack.dtype)
  return stack[i]


@struct.dataclass
class ByLayer(Mapping):
  """{(layer, site): record} held as one stack per site: the records of a site whose layers
  have alike records (one tree structure, shapes and dtypes) stacked along a new leading
  axis, in layer order. A jitted program returns this in place of the dict: a scanned stack
  of L layers makes each site's records as one stacked array, which the dict would cut into
  L slices inside the program. Read like the dict; an item is its stack's slice (numpy
  after `jax.tree.map(np.asarray, ...)`: every stack read to the host at once)."""

  stacks: tuple  # per stack: the stacked tree
  keys_by_stack: tuple = struct.field(pytree_node=False)  # per stack: its (layer, site) keys

  @classmethod
  def of(cls, records: Mapping | None) -> "ByLayer | None":
    """`records` ({(layer, site): tree}, layers in any order) stacked; None stays None."""
    if records is None or isinstance(records, ByLayer):
      return records
    return cls.from_parts([((k,), jax.tree.map(lambda a: a[None], v)) for k, v in records.items()])

  @classmethod
  def from_parts(cls, parts) -> "ByLayer":
    """The `ByLayer` of records already stacked in parts: [(keys, tree stacked along a
    leading axis, one entry per key)], keys (layer, site) in any order. A site's parts of
    alike entries (structure, shapes and dtypes) join in one stack in layer order
    (`scan.in_key_order`), as `of` would stack the same records one by one."""
    groups: dict[tuple, list] = {}
    for keys, tree in sorted(parts, key=lambda part: min(part[0])):
      shapes = tuple((tuple(a.shape[1:]), str(a.dtype)) for a in jax.tree.leaves(tree))
      groups.setdefault((keys[0][1], jax.tree.structure(tree), shapes), []).append((keys, tree))
    joined = [in_key_order(group) for group in groups.values()]
    return cls(stacks=tuple(t for _, t in joined), keys_by_stack=tuple(k for k, _ in joined))

  def _where(self) -> dict:
    return _positions(self.keys_by_stack)

  def __getitem__(self, key):
    s, i = self._where()[key]
    return jax.tree.map(lambda a: _entry(a, i), self.stacks[s])

  def __iter__(self):
    return iter(sorted(self._where()))

  def __len__(self) -> int:
    return sum(len(group) for group in self.keys_by_stack)

  def unstack(self) -> dict:
    """The plain dict (every record sliced out)."""
    return {key: self[key] for key in self}
