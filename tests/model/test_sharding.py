"""Sharded rollout and RL training on (data, expert, model) meshes of 8 fake CPU devices equal
one device; every array is really split the way the rules say (bytes per device)."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from trace_jax import model as M
from trace_jax.model import parameters, sharding

SCRIPT = textwrap.dedent("""
    import dataclasses, os, json, sys
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax, jax.numpy as jnp, numpy as np, optax, chex
    from flax import nnx
    from trace_jax import model as M
    from trace_jax.model import sharding
    from trace_jax.model.quant import QuantConfig
    from trace_jax import plan
    from trace_jax.rl import step as step_lib
    from trace_jax.rl.config import RLConfig
    from trace_jax.rl.episodes import Episodes
    from trace_jax.run import warmstart
    from trace_jax.training.sft import sft_batch
    from trace_jax.rollout.config import RolloutConfig, SamplingConfig
    from trace_jax.rollout.engine import RolloutEngine

    assert jax.device_count() == 8
    cfg = M.tiny(num_layers=1)  # one layer (compile time); float32: shardings only reorder sums
    rollout_config = RolloutConfig(precision="fp4", compute_dtype="float32", max_len=32,
                                   prompt_bucket=8, guidance="compact", guided_layers="all",
                                   record_routing=True, kernels="xla",
                                   sampling=SamplingConfig(temperature=1.0, max_new_tokens=6))
    # The training path: guided on every layer with replay, float32, TIS; pi_old's own forward
    # (`score`, unfused) then the update.
    config = RLConfig.from_flat(arm="trace-full", preset="tiny", prompts_per_step=2, group_size=4,
                      temperature=1.0, compute_dtype="float32", correction="tis")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, cfg.vocab_size, rng.integers(3, 9)).tolist() for _ in range(8)]
    played = Episodes(rollout=None, rewards=rng.uniform(size=8).astype(np.float32), actions=[],
                      turns=np.ones(8, np.int32))
    key = jax.random.key(3)

    def run(mesh):
      policy = M.Transformer(cfg, rngs=nnx.Rngs(0))
      opt = nnx.Optimizer(policy, optax.sgd(0.5), wrt=nnx.Param)
      if mesh is not None:
        sharding.shard_model(policy, mesh)
        opt = nnx.Optimizer(policy, optax.adam(1e-3), wrt=nnx.Param)  # has moments to place
        sharding.shard_optimizer(opt, policy, mesh)
        adam_state = nnx.state(opt)
        master_bytes = sharding.device_bytes(nnx.state(policy, nnx.Param))  # as the rules place
        opt = nnx.Optimizer(policy, optax.sgd(0.5), wrt=nnx.Param)
      engine = RolloutEngine(policy, rollout_config, mesh=mesh)
      rollout = engine.generate(prompts, key)
      guidance = rollout.guidance
      batch = step_lib.TrainExample(tokens=rollout.tokens, positions=rollout.positions,
                                    mask=rollout.mask, response_mask=rollout.response_mask,
                                    rollout_logp=rollout.logprobs)
      if mesh is not None:
        batch = jax.tree.map(lambda v: jax.device_put(v, sharding.batch_sharding(mesh, v.ndim)), batch)
      spec = dataclasses.replace(step_lib.StepSpec.of(config, cfg.num_layers, mesh), fused=False)
      state = step_lib.RLState(policy=policy, opt=opt)
      collected = step_lib.Collected(played=played, rollout=rollout, example=batch, guidance=guidance)
      scored = step_lib.score(spec, state, collected, step=1)
      old_logp = scored.example.old_logp
      state, done = step_lib.update(spec, state, scored)
      loss, norm = done.losses[0], done.grad_norms[0]
      out = dict(tokens=np.asarray(rollout.tokens), rollout_logp=np.asarray(rollout.logprobs),
                 old_logp=np.asarray(old_logp), loss=float(loss), norm=float(norm),
                 params=jax.device_get(nnx.to_pure_dict(nnx.state(policy, nnx.Param))))
      if mesh is not None:
        out["arrays"] = dict(
            master_experts=policy.blocks[0].moe.w_gate.get_value(),
            master_q=policy.blocks[0].attn.q_proj.get_value(),
            master_embed=policy.embed.get_value(),
            adam_mu_experts=adam_state["opt_state"][0]["mu"]["blocks"][0]["moe"]["w_gate"].get_value(),
            rollout_experts=engine.params["blocks"][0]["moe"]["w_gate"].get_value().packed,
            rollout_q=engine.params["blocks"][0]["attn"]["q_proj"].get_value().packed,
            kv_cache=rollout.cache.k[0].packed,
            guidance=next(iter(guidance.sites.values())).mantissa_bits,
            routing=guidance.routing)
        out["specs_after"] = policy.blocks[0].moe.w_gate.get_value().sharding.spec
        out["device_bytes"] = {  # what the planner must predict, read off the devices
            "master weights (f32)": master_bytes,
            "optimizer state (Adam)": sharding.device_bytes(adam_state),
            "FP4 rollout weights": sharding.device_bytes(engine.params),
            "KV cache (FP4)": sharding.device_bytes((rollout.cache.k, rollout.cache.v)),
            "guidance": sharding.device_bytes(guidance)}
      return out

    ref = run(None)
    assert ref["tokens"][:, 8:].any() and np.isfinite(ref["loss"])
    for shape in json.loads(sys.argv[1]):
      shape = tuple(shape)
      mesh = sharding.make_mesh(*shape)
      sizes = dict(zip(("data", "expert", "model"), shape))
      split = lambda *axes: int(np.prod([sizes[a] for a in axes]))
      with jax.set_mesh(mesh):
        got = run(mesh)
      np.testing.assert_array_equal(got["tokens"], ref["tokens"], err_msg=str(shape))
      np.testing.assert_allclose(got["rollout_logp"], ref["rollout_logp"], atol=2e-5, err_msg=str(shape))
      np.testing.assert_allclose(got["old_logp"], ref["old_logp"], atol=2e-5, err_msg=str(shape))
      np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-4, atol=1e-6, err_msg=str(shape))
      np.testing.assert_allclose(got["norm"], ref["norm"], rtol=1e-4, err_msg=str(shape))
      chex.assert_trees_all_close(got["params"], ref["params"], atol=1e-6, rtol=1e-5)
      assert got["specs_after"] == got["arrays"]["master_experts"].sharding.spec
      # Bytes on one device = total / the product of the axes the array is split over.
      expected = dict(master_experts=split("data", "expert", "model"),
                      master_q=split("data", "model"), master_embed=split("data", "model"),
                      adam_mu_experts=split("data", "expert", "model"),
                      rollout_experts=split("expert", "model"), rollout_q=split("model"),
                      kv_cache=split("data", "model"), guidance=split("data"),
                      routing=split("data"))
      for name, array in got["arrays"].items():
        assert len(array.sharding.device_set) == 8, (shape, name, array.sharding)
        per_device = {s.data.nbytes for s in array.addressable_shards}
        assert per_device == {array.nbytes // expected[name]}, (shape, name, per_device, array.nbytes, expected[name])
      planned = plan.plan(cfg, plan.PlanConfig(mesh=shape, batch=8, context=32,
                                                          guided_layers="all"))
      for name, measured in got["device_bytes"].items():
        assert planned[name] == measured, (shape, name, planned[name], measured)
      # The SFT warm start's batch: rows over "data" like the RL batch (5 rows padded to 6
      # on data=2), each device holding its own rows.
      sft = warmstart.place_sft_batch(sft_batch([([1, 2], [3])] * 5, 8, 0), mesh)
      for array in sft:
        assert array.shape[0] == -(-5 // sizes["data"]) * sizes["data"], (shape, array.shape)
        assert {s.data.shape[0] for s in array.addressable_shards} == {array.shape[0] // sizes["data"]}
        assert len(array.sharding.device_set) == 8
      print("OK", shape, got["loss"], flush=True)
""")


def _run_meshes(meshes):
  # Compilation is most of this test's time: XLA's lowest backend optimisation level (how
  # fast the code runs, not what it computes; the mesh runs and the reference alike).
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=8 "
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
  )
  result = subprocess.run(
    [sys.executable, "-c", SCRIPT, json.dumps(meshes)],
    capture_output=True,
    text=True,
    env=env,
    timeout=1800,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert result.stdout.count("OK") == len(meshes), result.stdout


def test_sharded_rollout_and_train_step_match_single_device():
  """(2, 2, 2): every axis at once (the default suite's one mesh: each costs a compile)."""
  _run_meshes([(2, 2, 2)])


@pytest.mark.slow
@pytest.mark.timeout(2100)  # its subprocess's own limit: 30 min
def test_sharded_rollout_and_train_step_match_single_device_more_meshes():
  """Pure FSDP (8, 1, 1) and expert parallel (2, 4, 1): `pytest -m slow tests/model/test_sharding.py`."""
  _run_meshes([(8, 1, 1), (2, 4, 1)])


def _abstract(cfg):
  return nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0)))


def test_param_rules():
  """The rules the modules declare are the documented layout (module docstring): FSDP on
  the d_model side, experts over "expert", heads and widths over "model"."""
  model = _abstract(M.tiny())
  moe, attn = model.blocks[0].moe, model.blocks[0].attn
  assert sharding.param_spec(moe.w_down) == P("expert", "model", "data")
  assert sharding.param_spec(moe.w_gate) == P("expert", "data", "model")
  assert sharding.param_spec(moe.router) == P("data", None)
  assert sharding.param_spec(attn.q_proj) == P("data", "model")
  assert sharding.param_spec(attn.o_proj) == P("model", "data")
  assert sharding.param_spec(model.blocks[0].attn_norm.scale) == P(None)
  assert sharding.param_spec(model.embed) == P("model", "data")
  assert sharding.param_spec(model.lm_head) == P("data", "model")
  linear = _abstract(M.qwen3_5_tiny()).blocks[0].attn  # a Gated DeltaNet layer
  assert sharding.param_spec(linear.in_proj_qkv) == P("data", None)  # [q | k | v] columns
  assert sharding.param_spec(linear.out_proj) == P("model", "data")
  # flax reads the same declarations.
  assert nnx.get_partition_spec(nnx.state(model))["blocks"][0]["moe"]["w_down"].get_value() == P(
    "expert", "model", "data"
  )


def test_every_parameter_declares_its_rule():
  """Every parameter of every architecture declares a rule of its own rank (a new parameter
  cannot be replicated by accident); a variable without one is refused by name."""
  for preset in ("tiny", "qwen3_5_tiny"):
    for path, var in nnx.to_flat_state(nnx.state(_abstract(M.get_preset(preset)))):
      rule = parameters.sharding_of(var)
      assert rule is not None and len(rule) == var.get_value().ndim, (preset, path, rule)
  with pytest.raises(ValueError, match="parameter w declares no sharding"):
    sharding.param_spec(nnx.Param(jax.numpy.zeros((4, 4))), what="parameter w")


def test_indivisible_dimension_is_refused():
  devices = jax.devices()[:1] * 3  # a 3-way "data" axis over d_model=64 cannot divide
  mesh = jax.sharding.Mesh(
    __import__("numpy").asarray(devices).reshape(3, 1, 1), sharding.MESH_AXES
  )
  model = nnx.eval_shape(lambda: M.Transformer(M.tiny(), rngs=nnx.Rngs(0)))
  with pytest.raises(
    ValueError,
    match=r"parameter blocks/0/attn/k_proj: dimension 0 .* size 64.*'data' of size 3 does not divide",
  ):
    sharding.param_shardings(model, mesh)


def test_attention_replicated_over_model_when_heads_do_not_split():
  cfg = M.tiny(num_heads=4, num_kv_heads=1)  # 1 KV head: k/v cannot split over model=2
  mesh = jax.sharding.Mesh(
    __import__("numpy").asarray(jax.devices()[:1] * 2).reshape(1, 1, 2), sharding.MESH_AXES
  )
  attn = _abstract(cfg).blocks[0].attn
  assert sharding.param_spec(attn.k_proj, mesh) == P("data", None)
  assert sharding.param_spec(attn.q_proj, mesh) == P("data", "model")
  assert sharding.param_spec(attn.o_proj, mesh) == P("model", "data")


def test_guidance_split_over_model_where_each_site_declares():
  """Guidance records [B, S, ...] split over "data" by row and over "model" along the
  dimension where the activation is split: K/V by KV head, the inputs of o_proj and of the
  down projections along their width; the inputs of column-split projections whole."""
  cfg = M.tiny(shared_expert_dim=32, dense_layers=(0,), ffn_dim=64)
  model = _abstract(cfg)
  options = M.CallOptions(recording=M.Recording(form="compact"))
  out = nnx.eval_shape(
    lambda m, t: m(t, quant=M.QuantConfig(), options=options),
    model,
    jax.numpy.zeros((2, 16), "int32"),
  )
  mesh = jax.sharding.Mesh(
    __import__("numpy").asarray(jax.devices()[:1] * 4).reshape(2, 1, 2), sharding.MESH_AXES
  )
  specs = sharding.guidance_site_specs(out.sites, mesh)
  split = {"k": 2, "v": 2, "attn_out": -1, "mlp_mid": -1, "moe_mid": -1, "shared_mid": -1}
  assert {site for _, site in specs} == {"attn_in", "mlp_in", "moe_in"} | set(split)
  for (layer, site), record in specs.items():
    bits = record.mantissa_bits  # [B, S, ..., n / 8]
    want = [None] * len(bits)
    want[0] = "data"
    if site in split:
      want[split[site] % len(bits)] = "model"
    assert tuple(bits) == tuple(want), (layer, site, bits)
