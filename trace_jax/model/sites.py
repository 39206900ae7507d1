"""The quantization sites: each declared once, beside the module call that quantizes it.

A site is where an activation is quantized (DESIGN.md section 2): `declare_site` at module
level in the module that owns it (attention.py: attn_in, attn_out, k, v; moe.py: moe_in,
moe_mid, shared_mid, mlp_in, mlp_mid) says which layers have it, the named FP4 scopes that
include it, whether it is a cache entry or a routed-expert site, and which dimension of its
records a sharded forward splits over "model". Everything else reads the declarations:
`ACTIVATION_SITES`, `SCOPE_SITES`, `KV_SITES`, `ROUTED_SITES` (module attributes here and in
`quant`), `quant.layer_sites` (hence the guidance checks), the guidance's shardings
(`sharding.guidance_site_specs`), and, through an abstract forward, the guidance buffers and
their bytes. The linear weights a site feeds name it (`parameters.input_site`).

At run time the module calls `sow_site` (or `sow_cache_entry`), which quantizes through the
forward's `SiteQuantizer` and sows the site's `SiteRecord` into `nnx.Intermediate`;
`Transformer.__call__` runs under `nnx.capture` and gathers them (`collect_site_records`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Sequence

import jax
from flax import nnx, struct

# Named FP4 scopes (DESIGN.md section 2); each site declares the scopes that include it.
SITE_SCOPES = ("all", "experts+kv")
SiteKey = tuple[int, str]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Site:
  """One activation quantization site, as declared beside the module call that quantizes it.

  Attributes:
    name: the key of its records and guidance, (layer, name).
    present: (ModelConfig, layer) -> whether that layer of a model has the site.
    scopes: the named FP4 scopes (`SITE_SCOPES`) that quantize it; "all" always does.
    cache: a K/V cache entry: stored packed in the cache (`sow_cache_entry`), and FP4 even
      under W4A8 (`QuantConfig.activations="fp8"` rounds only the linear inputs to FP8).
    routed: its rows are (token, chosen expert): its guidance only fits the rollout's experts,
      so guiding it needs routing replay.
    model_dim: the dimension of its records [B, S, ...] that a sharded forward splits over
      the "model" mesh axis (K/V: the KV-head axis; the input of a row-split projection: its
      width, -1), so guidance is kept where the activation is; None: not split.
  """

  name: str
  present: Callable[[Any, int], bool]
  scopes: tuple[str, ...] = ("all",)
  cache: bool = False
  routed: bool = False
  model_dim: int | None = None


_REGISTRY: dict[str, Site] = {}
# The modules that declare sites: importing them completes the registry (they import this
# module, so the registry is read lazily, never at this module's import).
_DECLARING_MODULES = (
  "trace_jax.model.attention",
  "trace_jax.model.deltanet",
  "trace_jax.model.moe",
)


def declare_site(
  name: str,
  *,
  present: Callable[[Any, int], bool] = lambda cfg, layer: True,
  scopes: Sequence[str] = (),
  cache: bool = False,
  routed: bool = False,
  model_dim: int | None = None,
) -> Site:
  """Register an activation site (once, at the import of the module that quantizes it).

  Args:
    name: the site's key; unique.
    present: (ModelConfig, layer) -> whether that layer has the site (default: every layer).
    scopes: named scopes besides "all" that quantize it (e.g. ("experts+kv",)).
    cache: a K/V cache entry (see `Site`).
    routed: rows are (token, chosen expert) (see `Site`).
    model_dim: the records' dimension split over "model" (see `Site`), or None.
  Returns:
    the `Site`, for the module's `sow_site(..., site=...)` call.
  """
  scopes = ("all",) + tuple(s for s in scopes if s != "all")
  bad = [s for s in scopes if s not in SITE_SCOPES]
  if bad:
    raise ValueError(f"declare_site({name!r}): scopes {bad} are not among {SITE_SCOPES}")
  if name in _REGISTRY:
    raise ValueError(f"declare_site({name!r}): a site of that name is already declared")
  site = Site(
    name=name, present=present, scopes=scopes, cache=cache, routed=routed, model_dim=model_dim
  )
  _REGISTRY[name] = site
  return site


def registered_sites() -> tuple[Site, ...]:
  """Every declared site, in declaration order."""
  for module in _DECLARING_MODULES:
    importlib.import_module(module)
  return tuple(_REGISTRY.values())


def site_spec(name: str) -> Site:
  """The declaration of site `name`."""
  sites = {s.name: s for s in registered_sites()}
  if name not in sites:
    raise ValueError(f"unknown quantization site {name!r}; declared: {tuple(sites)}")
  return sites[name]


_DERIVED = ("ACTIVATION_SITES", "SCOPE_SITES", "KV_SITES", "ROUTED_SITES")


def derived(name: str):
  """One of the lists derived from the declarations: ACTIVATION_SITES (every site, in
  declaration order), SCOPE_SITES ({scope: its sites}), KV_SITES (cache entries),
  ROUTED_SITES ((token, expert) rows)."""
  if name not in _DERIVED:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  sites = registered_sites()
  if name == "ACTIVATION_SITES":
    return tuple(s.name for s in sites)
  if name == "SCOPE_SITES":
    return {scope: tuple(s.name for s in sites if scope in s.scopes) for scope in SITE_SCOPES}
  if name == "KV_SITES":
    return tuple(s.name for s in sites if s.cache)
  return tuple(s.name for s in sites if s.routed)


def __getattr__(name: str):
  """ACTIVATION_SITES, SCOPE_SITES, KV_SITES and ROUTED_SITES, derived from the registry."""
  return derived(name)


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


def collect_site_records(sown) -> dict[SiteKey, SiteRecord]:
  """The `SiteRecord`s of a forward's captured `nnx.Intermediate` state (what `nnx.capture`
  returns): {(layer, site): record}. Sites live at `blocks/<layer>/.../<site>`."""
  out = {}
  for path, variable in nnx.to_flat_state(sown):
    value = variable.get_value() if hasattr(variable, "get_value") else variable
    for item in value if isinstance(value, tuple) else (value,):
      if isinstance(item, SiteRecord):
        out[(int(path[1]), str(path[-1]))] = item
  return out
