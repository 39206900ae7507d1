"""QuantConfig's FP4 scope ("all" | "experts+kv"): which activation sites and which linear
weights run in FP4, on the training path and in the rollout's packed parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax import guidance as G
from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.model import accounting
from trace_jax.model import sites as sites_lib
from trace_jax.model.quant import Recording, layer_sites
from trace_jax.rl.config import RLConfig

EXPERTS_KV = M.QuantConfig(sites="experts+kv")


@pytest.fixture(scope="module")
def hybrid():
  """Shared expert (gated), a dense layer 0 and an MoE layer 1: every weight group."""
  cfg = M.tiny(
    shared_expert_dim=32, shared_expert_gate=True, dense_layers=(0,), ffn_dim=64, num_layers=2
  )
  return M.Transformer(cfg, rngs=nnx.Rngs(3))


def _forward(model, tokens, quant, record=False):
  """(logits, ModelOutput) of a jitted forward; `record`: every site, in full."""
  options = M.CallOptions(recording=Recording(form="full" if record else "none"))
  out = _jitted(model, tokens, quant, options)
  return out.logits, out


_jitted = nnx.jit(
  lambda m, t, quant, options: m(t, quant=quant, options=options), static_argnums=(2, 3)
)


def _tokens(seed, b=2, t=9):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, 128)


def test_config_scope_validation_and_legacy_tuple():
  with pytest.raises(ValueError, match="sites='experts'"):
    M.QuantConfig(sites="experts")
  with pytest.raises(ValueError, match="unknown sites"):
    M.QuantConfig(sites=("k", "router"))
  assert M.QuantConfig().activation_sites == M.ACTIVATION_SITES
  assert set(EXPERTS_KV.activation_sites) == {"k", "v", "moe_in", "moe_mid"}
  assert EXPERTS_KV.weight_groups == ("experts",)
  legacy = M.QuantConfig(sites=["k", "v"])  # a list becomes a tuple (hashable, static)
  assert legacy.sites == ("k", "v") and legacy.quantizes("k") and not legacy.quantizes("moe_in")
  assert legacy.weight_groups == M.WEIGHT_GROUPS
  assert M.QuantConfig(precision="bf16", sites="experts+kv").weight_groups == ()
  assert not M.QuantConfig(precision="bf16").quantizes("k")
  with pytest.raises(ValueError, match="weight group"):
    EXPERTS_KV.quantizes_weights("router")


def test_weight_groups_declared_on_the_parameters(hybrid):
  """Each linear weight's declared group matches the module that owns it (spelled out here
  by path); everything DESIGN.md keeps in high precision declares none."""
  groups = {}
  for path, var in nnx.to_flat_state(nnx.state(hybrid)):
    groups.setdefault(M.weight_group(var), set()).add(".".join(str(p) for p in path))
  assert groups["attention"] == {f"blocks.{i}.attn.{n}_proj" for i in range(2) for n in "qkvo"}
  assert groups["mlp"] == {f"blocks.0.mlp.{n}" for n in ("w_gate", "w_up", "w_down")}
  assert groups["shared"] == {f"blocks.1.moe.shared.{n}" for n in ("w_gate", "w_up", "w_down")}
  assert groups["experts"] == {f"blocks.1.moe.{n}" for n in ("w_gate", "w_up", "w_down")}
  assert {"embed", "lm_head", "blocks.1.moe.router", "blocks.1.moe.shared_gate"} <= groups[None]


def test_layer_sites_per_scope(hybrid):
  cfg = hybrid.cfg
  assert M.quant.layer_sites(cfg, EXPERTS_KV) == {0: ("k", "v"), 1: ("k", "v", "moe_in", "moe_mid")}
  everything = M.quant.layer_sites(cfg, M.QuantConfig())
  assert everything[0] == ("attn_in", "attn_out", "k", "v", "mlp_in", "mlp_mid")
  assert everything[1] == ("attn_in", "attn_out", "k", "v", "moe_in", "moe_mid", "shared_mid")


def _experts_by_hand(moe) -> dict:
  """Routed-expert weights quantized per expert, gate and up with one global scale (the
  concatenation along the output axis is one global group)."""
  gate, up, down = (getattr(moe, n).get_value() for n in ("w_gate", "w_up", "w_down"))
  joint = fp4.dequantize(fp4.quantize(jnp.concatenate([gate, up], -1), axis=1, global_group=0))
  return {
    "w_gate": joint[..., : gate.shape[-1]],
    "w_up": joint[..., gate.shape[-1] :],
    "w_down": fp4.dequantize(fp4.quantize(down, axis=1, global_group=0)),
  }


def test_rollout_params_pack_only_the_scope(hybrid):
  state = nnx.state(hybrid)
  packed = R.quantize_params(state, EXPERTS_KV)
  by_hand = _experts_by_hand(hybrid.blocks[1].moe)
  n_packed = 0
  for (path, var), (_, master) in zip(nnx.to_flat_state(packed), nnx.to_flat_state(state)):
    value = var.get_value()
    if tuple(str(p) for p in path[-2:]) in {("moe", name) for name in by_hand}:
      assert isinstance(value, fp4.QArray), path
      np.testing.assert_array_equal(fp4.dequantize(value), by_hand[str(path[-1])])
      n_packed += 1
    else:
      assert not isinstance(value, fp4.QArray), path
      np.testing.assert_array_equal(value, master.get_value())
  assert n_packed == 3
  every = R.params_nbytes(R.quantize_params(state, M.QuantConfig()))
  assert every < R.params_nbytes(packed) < R.params_nbytes(state)


def test_experts_kv_forward_quantizes_only_experts_and_kv(hybrid):
  """The scope's forward equals an independent construction: routed-expert weights
  fake-quantized by hand (per expert), every other weight untouched, FP4 on exactly
  k, v, moe_in and moe_mid, and the shared expert fed the unquantized input."""
  tokens = _tokens(1)
  logits, aux = _forward(hybrid, tokens, EXPERTS_KV, record=True)
  assert set(aux.sites) == {(0, "k"), (0, "v"), (1, "k"), (1, "v"), (1, "moe_in"), (1, "moe_mid")}

  by_hand = nnx.clone(hybrid)
  moe = by_hand.blocks[1].moe
  values = _experts_by_hand(moe)
  for name in ("w_gate", "w_up", "w_down"):
    getattr(moe, name).set_value(values[name])
  # Activations only: the same sites, no weight quantization at all.
  acts_only = M.QuantConfig(sites=("k", "v", "moe_in", "moe_mid"), weights=False)
  expected, _ = _forward(by_hand, tokens, acts_only)
  np.testing.assert_array_equal(logits, expected)
  everything, _ = _forward(hybrid, tokens, M.QuantConfig())  # ... unlike the "all" scope
  assert float(jnp.abs(everything - logits).max()) > 1e-3


def test_experts_kv_rollout_matches_training_forward(hybrid):
  """The rollout's packed parameters under the scope give the training path's logits."""
  tokens = _tokens(2)
  packed = R.quantize_params(nnx.state(hybrid), EXPERTS_KV)
  rollout_model = nnx.merge(nnx.graphdef(hybrid), packed)
  got, _ = _forward(rollout_model, tokens, EXPERTS_KV)
  want, _ = _forward(hybrid, tokens, EXPERTS_KV)
  np.testing.assert_array_equal(got, want)


def test_weight_bytes_per_scope():
  cfg = M.tiny(shared_expert_dim=32, dense_layers=(0,), ffn_dim=64, num_layers=2)
  bf16 = accounting.weight_bytes(cfg)
  every = accounting.weight_bytes(cfg, "nvfp4")
  experts = accounting.weight_bytes(cfg, "nvfp4", sites="experts+kv")
  assert every < experts < bf16
  expert_elems = 3 * cfg.num_experts * cfg.d_model * cfg.moe_ffn_dim  # 1 MoE layer
  # Packing the routed experts saves 2 - 0.5 - 1/16 bytes per element, minus global scales.
  saved = expert_elems * (2 - 0.5 - 1 / 16) - 3 * cfg.num_experts * 4
  assert bf16 - experts == pytest.approx(saved)


def test_w4a8_puts_linear_inputs_in_fp8_and_keeps_kv_in_fp4(hybrid):
  """activations="fp8": every linear input site is MXFP8 E4M3 (nearest, not recorded, so no
  guidance), K/V stay FP4 (recorded, guidable); the sites guidance covers are only K/V."""
  w4a8 = M.QuantConfig(activations="fp8")
  x = jax.random.normal(jax.random.key(4), (3, 64)) * 5
  sq = M.SiteQuantizer(
    w4a8, 2, jnp.float32, options=M.CallOptions(recording=Recording(form="full"))
  )
  for site in ("attn_in", "moe_mid"):  # FP8: values only, no record
    values, record = sq.site(x, 1, site)
    np.testing.assert_array_equal(values, fp4.fp8_values(x))
    assert record is None
  k = x.reshape(3, 4, 16)
  values, record = sq.site(k, 1, "k")
  np.testing.assert_array_equal(values, fp4.fake_quant(k, global_group="row"))
  assert record is not None
  assert layer_sites(hybrid.cfg, w4a8) == {0: ("k", "v"), 1: ("k", "v")}
  with pytest.raises(ValueError, match="activations='fp16'"):
    M.QuantConfig(activations="fp16")
  # A whole forward: only K/V recorded; it differs from W4A4 and from no activation rounding.
  tokens = _tokens(3)
  logits, aux = _forward(hybrid, tokens, w4a8, record=True)
  assert set(aux.sites) == {(0, "k"), (0, "v"), (1, "k"), (1, "v")}
  w4a4, _ = _forward(hybrid, tokens, M.QuantConfig())
  kv_only, _ = _forward(hybrid, tokens, M.QuantConfig(sites=("k", "v")))
  assert float(jnp.abs(logits - w4a4).max()) > 1e-4
  assert float(jnp.abs(logits - kv_only).max()) > 1e-6
  # Guided rounding under W4A8 needs guidance for K/V only.
  guided = w4a8.replace(rounding="guided", guided_layers="all")
  own = G.Guidance(sites=dict(aux.sites), routing=None, mode="full", layers=(0, 1))
  again = nnx.jit(lambda m, t, g: m(t, quant=guided, guidance=g).logits)(hybrid, tokens, own)
  np.testing.assert_allclose(np.asarray(again), np.asarray(logits), atol=1e-5)


def test_site_declarations_derive_the_lists_scopes_and_layer_sites():
  """One declaration per site (`sites.SITES`): the site list, the scopes, the cache and
  routed-expert sites and each layer's sites all derive from the declarations."""
  assert M.ACTIVATION_SITES == (
    "attn_in",
    "attn_out",
    "k",
    "v",
    "moe_in",
    "moe_mid",
    "shared_mid",
    "mlp_in",
    "mlp_mid",
  )
  assert M.ACTIVATION_SITES == tuple(s.name for s in M.SITES)
  assert sites_lib.SCOPE_SITES == {
    "all": M.ACTIVATION_SITES,
    "experts+kv": ("k", "v", "moe_in", "moe_mid"),
  }
  assert sites_lib.KV_SITES == ("k", "v") and sites_lib.ROUTED_SITES == ("moe_mid",)
  # Every layer kind, against a hand table: a linear (DeltaNet) MoE layer with a shared
  # expert, a full-attention dense layer.
  cfg = M.qwen3_5_tiny(
    num_layers=2, layer_types=("linear_attention", "full_attention"), dense_layers=(1,), ffn_dim=64
  )
  assert layer_sites(cfg, M.QuantConfig()) == {
    0: ("attn_in", "attn_out", "moe_in", "moe_mid", "shared_mid"),
    1: ("attn_in", "attn_out", "k", "v", "mlp_in", "mlp_mid"),
  }
  with pytest.raises(ValueError, match="declared twice"):
    sites_lib.site_table((*M.SITES, M.Site(name="moe_in")))
  with pytest.raises(ValueError, match="scopes"):
    M.Site(name="new_site", scopes=("experts-only",))
  assert M.Site(name="new_site", scopes=("experts+kv",)).scopes == ("all", "experts+kv")
  with pytest.raises(ValueError, match="unknown quantization site"):
    sites_lib.site_spec("nope")


def _random_norm_scales(model, seed):
  """`model` with random RMSNorm scales (not 1): the norm's bf16 product then feeds
  attn_in, moe_in and mlp_in too, where XLA may keep excess precision."""
  rng = np.random.default_rng(seed)
  state = nnx.state(model, nnx.Param)
  scaled = jax.tree_util.tree_map_with_path(
    lambda path, x: (
      jnp.asarray(rng.uniform(0.5, 2.0, x.shape), x.dtype)
      if jax.tree_util.keystr(path).endswith("['scale']")
      else x
    ),
    state,
  )
  nnx.update(model, scaled)
  return model


@pytest.fixture(scope="module")
def bf16_policy():
  cfg = M.tiny(shared_expert_dim=32, dense_layers=(0,), ffn_dim=64, num_layers=2)
  return _random_norm_scales(M.Transformer(cfg, rngs=nnx.Rngs(5)), seed=5)


def _assert_records_are_fp4_of_inputs(out, what):
  """Every recorded site: the record is `fp4.quantize` of the recorded input, bits included."""
  assert out.sites and set(out.site_inputs) == set(out.sites), what
  for key, record in out.sites.items():
    x = out.site_inputs[key]
    assert x.dtype == jnp.float32, (what, key)  # what the quantizer read, excess precision kept
    expected = fp4.quantize(x, global_group="row")
    if isinstance(record, fp4.CompactGuidance):
      expected = fp4.compact_guidance(expected)
    for field in ("packed", "mantissa_bits", "scales", "global_scale"):
      if hasattr(record, field):
        np.testing.assert_array_equal(
          np.asarray(getattr(record, field)),
          np.asarray(getattr(expected, field)),
          err_msg=f"{what} {key} {field}",
        )


@pytest.mark.slow
def test_bf16_records_are_the_fp4_of_the_recorded_inputs_and_capture_changes_nothing(bf16_policy):
  """Capture changes nothing, and records the FP4 of its inputs, at bf16 compute on both paths.

  Rollout layout (packed weights, a prefill into an FP4 cache): the logits and cache of
  every capture form ("compact", "full", "sparse", with inputs) are those of a forward that
  records nothing, bits included, and each record (and each cached K / V) is the FP4 of the
  recorded input. Training path (whole sequences, fake-quantized master weights): the same
  for "compact" and "full". Before the fix, sparse capture rounded `k` before quantizing it
  (other logits), and the `k` records were not the FP4 of the (rounded) recorded `k`."""
  model = bf16_policy
  rng = np.random.default_rng(27)
  tokens = jnp.asarray(rng.integers(0, 128, (3, 16)), jnp.int32)
  mask = jnp.asarray(np.arange(16)[None] >= np.array([[0], [5], [11]]))  # left padding
  graphdef, state = nnx.split(model)
  params = R.quantize_params(state, M.QuantConfig(), dtype=jnp.bfloat16)

  def rollout_forward(form, inputs):
    quant = M.QuantConfig()
    options = M.CallOptions(recording=Recording(form=form, inputs=inputs), compute_dtype="bfloat16")
    cache = M.init_cache(model.cfg, 3, 32, quant, dtype=jnp.bfloat16)
    forward = jax.jit(
      lambda p, c: nnx.merge(graphdef, p)(tokens, mask=mask, cache=c, quant=quant, options=options)
    )
    return forward(params, cache)

  plain = rollout_forward("none", False)
  valid = np.asarray(mask)
  for form in ("sparse", "compact", "full"):
    out = rollout_forward(form, True)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(plain.logits), err_msg=form)
    for a, b in zip(jax.tree.leaves(out.cache), jax.tree.leaves(plain.cache)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=form)
    if form == "sparse":
      continue
    _assert_records_are_fp4_of_inputs(out, f"rollout {form}")
    for layer in range(model.cfg.num_layers):
      for name, entries in (("k", out.cache.k), ("v", out.cache.v)):
        expected = fp4.quantize(out.site_inputs[(layer, name)], global_group="row")
        np.testing.assert_array_equal(
          np.asarray(entries[layer].packed)[:, :16][valid], np.asarray(expected.packed)[valid]
        )
  for form in ("compact", "full"):
    options = M.CallOptions(recording=Recording(form=form, inputs=True), compute_dtype="bfloat16")
    out = _jitted(model, tokens, M.QuantConfig(), options)
    _assert_records_are_fp4_of_inputs(out, f"training {form}")


def test_kv_precision_bf16_leaves_only_the_cache_unquantized(hybrid):
  """The KV ablation (`--kv_precision=bf16`): the K/V sites leave the scope, the cache
  is bf16, and every other site and weight stays as the scope says: the forward equals the
  same scope written out as its sites without k and v (an independent spelling), bit for
  bit in one process, and differs from the FP4-cache forward."""
  with pytest.raises(ValueError, match="QuantConfig.kv='fp8'"):
    M.QuantConfig(kv="fp8")
  with pytest.raises(ValueError, match="QuantConfig.kv='int8'"):
    RLConfig.from_flat(kv_precision="int8")
  tokens = _tokens(int(np.random.default_rng().integers(1 << 20)))
  for scope in ("all", "experts+kv"):
    fp4_kv = M.QuantConfig(sites=scope)
    bf16_kv = M.QuantConfig(sites=scope, kv="bf16")
    run = RLConfig.from_flat(arm="fp4-qat", fp4_sites=scope, kv_precision="bf16")
    assert run.train_quant == bf16_kv
    assert set(bf16_kv.activation_sites) == set(fp4_kv.activation_sites) - {"k", "v"}
    assert bf16_kv.weight_groups == fp4_kv.weight_groups
    cache = M.init_cache(hybrid.cfg, 2, 16, quant=bf16_kv)
    assert not isinstance(cache.k[0], fp4.QArray)
    assert isinstance(M.init_cache(hybrid.cfg, 2, 16, quant=fp4_kv).k[0], fp4.QArray)
    logits, aux = _forward(hybrid, tokens, bf16_kv, record=True)
    assert not {site for _, site in aux.sites} & {"k", "v"}
    if scope == "all":  # a tuple of sites quantizes every weight group, as "all" does
      spelled = M.QuantConfig(sites=bf16_kv.activation_sites)
      np.testing.assert_array_equal(logits, _forward(hybrid, tokens, spelled)[0])
    assert not np.array_equal(logits, _forward(hybrid, tokens, fp4_kv)[0])
