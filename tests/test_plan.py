"""The memory planner against hand-derived bytes of a published geometry.

(That its figures equal the bytes really placed on devices is checked in
tests/model/test_sharding.py, on 8 fake devices.)"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax.model.config import get_preset
from trace_jax import memory_bound, plan
from trace_jax.model.quant import CallOptions, QuantConfig, Recording
from trace_jax.rl import programs
from trace_jax.rl import optimizer as optimizer_lib
from trace_jax.rl import step as T
from trace_jax.rl.grpo import LossConfig
from trace_jax.training.forward import training_forward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def qwen3_rows():
  config = plan.PlanConfig(mesh=(8, 8, 1), batch=64, context=2048, micro_batch=8)
  return plan.plan(get_preset("qwen3_30b_a3b"), config)


def test_qwen3_30b_rows_match_hand_derivation(qwen3_rows):
  rows = qwen3_rows
  layers, kv_heads, head_dim, d, vocab = 48, 4, 128, 2048, 151936
  experts, ffn = 128, 768
  # KV cache: 8 sequences per data shard, K and V, bf16; FP4: 0.5 B per element, one E4M3
  # scale byte per 16, one f32 global scale per (token, head).
  tokens = 64 // 8 * 2048
  bf16 = 2 * layers * tokens * kv_heads * head_dim * 2
  fp4 = 2 * layers * tokens * kv_heads * (head_dim // 2 + head_dim // 16 + 4)
  assert rows["KV cache (bf16)"] == bf16
  assert rows["KV cache (FP4)"] == fp4
  assert rows["recurrent state"] == 0
  # Master weights: routed experts over expert x data (64), everything FSDP over data (8),
  # norms replicated.
  expert_params = layers * 3 * experts * d * ffn
  attn_params = layers * d * (32 * 128 + 2 * kv_heads * 128) + layers * 32 * 128 * d
  other = 2 * vocab * d + layers * d * experts  # embed, lm_head, routers
  norms = layers * (2 * d + 2 * head_dim) + d
  master = 4 * (expert_params / 64 + (attn_params + other) / 8 + norms)
  assert rows["master weights (f32)"] == pytest.approx(master, rel=1e-9)
  assert rows["optimizer state (Adam)"] == pytest.approx(2 * master, rel=1e-6)
  # Guidance (compact, layers 24..47, every site): per token and site a float32 global
  # scale per row (per KV head for k/v, per chosen expert for moe_mid), one E4M3 byte per
  # 16 elements and one mantissa bit per element; routing int16 (128 experts), all layers.
  compact = lambda rows, width: rows * (4 + width // 16 + width // 8)
  per_layer = (
    compact(1, d)
    + compact(1, 32 * head_dim)
    + 2 * compact(kv_heads, head_dim)
    + compact(1, d)
    + compact(8, ffn)
  )
  per_token = 24 * per_layer + layers * 8 * 2
  assert rows["guidance"] == per_token * tokens  # model=1: split over data only
  # The update's own records (one sequence of 2048 per device): every site of every layer in
  # full (f32 global scale per row, E4M3 byte per 16, 4 bits per element) and a bool
  # fallback per element at the guided layers' (24..47) sites.
  full = lambda rows, width: rows * (4 + width // 16 + width // 2)
  widths = ((1, d), (1, 32 * head_dim), (kv_heads, head_dim), (kv_heads, head_dim), (1, d))
  widths += ((8, ffn),)
  records = layers * sum(full(r, w) for r, w in widths) + 24 * sum(r * w for r, w in widths)
  assert rows["training-path records"] == records * 2048
  # The rollout's working set: a 128-slot prefill chunk of the 8 sequences per data shard,
  # float32 attention scores over the 2048 slots for 32 query heads, twice; float32 expert
  # weights gathered for 8 x 128 x 8 (token, slot) rows in tiles of 64 (one per expert, the
  # power of two from 8 up to rows / experts), 128 + 128 tiles, gate, up and down; the
  # layers' FP4 rollout weights once more (scanned), split over "expert" alone (8).
  scores = 2 * 8 * 32 * 128 * 2048 * 4
  tiles = 3 * (8 * 128 * 8 // 64 + experts) * d * ffn * 4
  packed = lambda n, k: n * (k // 2 + k // 16)  # FP4 codes and E4M3 scales of n x k
  expert_fp4 = 3 * experts * (packed(d, ffn) + 4)  # + a float32 global scale per expert
  attn_fp4 = packed(d, 32 * head_dim + 2 * kv_heads * head_dim) + packed(32 * head_dim, d) + 16
  layer_rest = (d * experts + 2 * d + 2 * head_dim) * 4  # float32 router and norms
  stacked = layers * (expert_fp4 / 8 + attn_fp4 + layer_rest)
  assert rows["rollout working set"] == scores + tiles + stacked
  # The LM head's backward beside its logits: shifted logits, exponentials and the logits'
  # gradient, float32 over the whole vocabulary ("model" = 1) for the 2048 tokens per device.
  assert rows["LM head gradients"] == 3 * 2048 * vocab * 4
  # Remat keeps one d_model bf16 vector per token and layer instead of every residual.
  assert rows["activations (remat)"] < rows["activations (no remat)"] / 4
  assert rows["activations (remat)"] >= layers * 8 // 8 * 2048 * d * 2


def test_lm_head_gradients_split_the_vocabulary_over_model():
  """Three float32 [batch, context, vocabulary / model] buffers, the last shard rounded up."""
  cfg = get_preset("qwen3_5_35b_a3b")  # vocabulary 248,320
  assert memory_bound.lm_head_grad_bytes(cfg, 1, 8192) == 3 * 8192 * 248320 * 4
  assert memory_bound.lm_head_grad_bytes(cfg, 2, 4096, model=4) == 3 * 2 * 4096 * 62080 * 4
  assert (
    memory_bound.lm_head_grad_bytes(cfg, 1, 16, model=3) == 3 * 16 * 82774 * 4
  )  # 248,320 / 3 up
  rows = plan.plan(
    cfg.replace(num_layers=4, layer_types=cfg.layer_types[:4]),
    plan.PlanConfig(mesh=(2, 1, 4), batch=8, context=256, micro_batch=8),
  )
  assert rows["LM head gradients"] == 3 * 4 * 256 * 62080 * 4  # micro-batch 8 / 2 per device


@pytest.mark.slow
@pytest.mark.timeout(1200)  # its run's own limit: 15 min
def test_plan_script_prints_the_table():
  """The CLI at full Qwen3.5 size (`pytest -m slow tests/rl/test_plan.py`)."""
  cmd = [
    sys.executable,
    os.path.join(ROOT, "experiments", "plan.py"),
    "--preset=qwen3_5_35b_a3b",
    "--mesh=8,8,1",
    "--batch=64",
    "--context=1024",
  ]
  result = subprocess.run(
    cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONPATH=ROOT)
  )
  assert result.returncode == 0, result.stderr[-3000:]
  for row in (
    "master weights (f32)",
    "optimizer state (Adam)",
    "FP4 rollout weights",
    "KV cache (bf16)",
    "KV cache (FP4)",
    "recurrent state",
    "guidance",
    "activations (no remat)",
    "activations (remat)",
    "training-path records",
    "H200 (141 GB)",
  ):
    assert row in result.stdout, row


def test_bad_plan_configs():
  with pytest.raises(ValueError, match="batch=6 must divide over data=4"):
    plan.PlanConfig(mesh=(4, 1, 1), batch=6)
  with pytest.raises(ValueError, match="mesh"):
    plan.PlanConfig(mesh=(8, 8))


@pytest.mark.slow
def test_train_peak_against_the_compiled_update():
  """The planner against XLA's compiled memory of the update the default trace arm runs
  (`rl.programs.train_step`, fused, recording, guided, routing replay, remat on), tiny preset,
  8 sequences of 256 slots on one device (~2 min of compile on 2 loaded cores).

  - arguments: master weights + Adam + guidance, plus the trajectories' own arrays, exactly;
  - what the update returns beside the donated state: the training-path records row, plus
    log pi_old and entropy (f32 per slot), the routers' own choices (int32 per slot, MoE
    layer and expert slot) and a few scalars (< 4 KiB);
  - temporaries: at least the planner's remat activations plus the gradients. Only a lower
    bound: XLA:CPU does not realise remat's savings (its temporaries are the same with and
    without jax.checkpoint, for an 8-layer MLP too). How close the remat row comes on a GPU
    is not checked here.
  """
  batch, context = 8, 256
  cfg = M.tiny(remat=True)
  config = plan.PlanConfig(mesh=(1, 1, 1), batch=batch, context=context, micro_batch=batch)
  rows = plan.plan(cfg, config)
  guidance = plan.abstract_guidance(cfg.replace(dtype="bfloat16"), config, QuantConfig())
  policy = nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0)))
  opt = nnx.eval_shape(
    lambda: nnx.Optimizer(
      M.Transformer(cfg, rngs=nnx.Rngs(0)), optimizer_lib.optimizer(1e-3), wrt=nnx.Param
    )
  )
  slots = lambda dtype: jax.ShapeDtypeStruct((batch, context), dtype)
  example = T.TrainExample(
    tokens=slots(jnp.int32),
    positions=slots(jnp.int32),
    mask=slots(bool),
    response_mask=slots(bool),
    rollout_logp=slots(jnp.float32),
    advantages=jax.ShapeDtypeStruct((batch,), jnp.float32),
  )
  quant = QuantConfig(rounding="guided", guided_layers=config.guided_layers)
  memory = (
    programs.train_step.lower(
      policy,
      opt,
      example,
      guidance,
      None,
      quant=quant,
      options=CallOptions(compute_dtype="bfloat16"),
      replay=True,
      temperature=1.0,
      loss_config=LossConfig(),
      fused=True,
      record=True,
    )
    .compile()
    .memory_analysis()
  )
  example_bytes = batch * context * (4 + 4 + 1 + 1 + 4) + batch * 4
  resident = rows["master weights (f32)"] + rows["optimizer state (Adam)"] + rows["guidance"]
  assert memory.argument_size_in_bytes == resident + example_bytes
  returned = memory.output_size_in_bytes - memory.alias_size_in_bytes
  per_slot = 2 * batch * context * 4  # log pi_old and entropy
  per_slot += cfg.num_moe_layers * batch * context * cfg.num_experts_per_tok * 4  # router choice
  assert 0 <= returned - rows["training-path records"] - per_slot < 4096
  assert memory.temp_size_in_bytes >= rows["activations (remat)"] + rows["gradients (f32)"]


def _kept_for_backward(cfg, batch: int, context: int) -> int:
  """Bytes the compiled forward of the trace arm's update keeps for its backward: the
  outputs of the jitted `jax.vjp` of its objective (guided, routing replay, full records,
  bf16), i.e. the residuals, compiled by XLA."""
  config = plan.PlanConfig(mesh=(1, 1, 1), batch=batch, context=context, micro_batch=batch)
  guidance = plan.abstract_guidance(cfg.replace(dtype="bfloat16"), config, QuantConfig())
  graphdef, state = nnx.split(nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0))))
  quant = QuantConfig(rounding="guided", guided_layers=config.guided_layers)
  options = CallOptions(recording=Recording(form="full"), compute_dtype="bfloat16")

  def forward(state, tokens, positions, mask, guidance):
    def objective(state):
      logp, out = training_forward(
        nnx.merge(graphdef, state),
        tokens,
        positions,
        mask,
        quant=quant,
        guidance=guidance,
        routing_replay=True,
        options=options,
      )
      return jnp.sum(logp) + out.lb_loss

    return jax.vjp(objective, state)[1]  # its residuals

  slots = lambda dtype: jax.ShapeDtypeStruct((batch, context), dtype)
  compiled = (
    jax.jit(forward)
    .lower(state, slots(jnp.int32), slots(jnp.int32), slots(bool), guidance)
    .compile()
  )
  return compiled.memory_analysis().output_size_in_bytes


@pytest.mark.slow
def test_kept_activations_against_the_compiled_forward():
  """The planner's activation rows describe what the trace arm's update keeps for its
  backward, compiled by XLA (tiny preset, 64 slots, four compiles: ~2 min).

  Per added micro-batch (4 -> 8 sequences: what the weights and their QAT copies add is
  the same in both and cancels), the compiled residuals are within 2% of what
  "activations (no remat)" adds without remat (measured 0.4%; the planner's row, too, holds
  a part that does not grow with the batch, each expert matmul's weights gathered per tile
  of `ragged_matmul`), and with remat, minus the guidance they hold (the rematerialised
  blocks read it again; in the update it is the argument itself), within 2% of the
  planner's kept part (measured 0.3%: token ids and per-sequence scalars it leaves out).
  Both count the attention mask and RoPE tables once for all layers (without them the kept
  part was 14% short). A recording forward that dropped remat kept ~10x that."""
  context, small, large = 64, 4, 8
  quant = QuantConfig()
  for remat in (False, True):
    cfg = M.tiny(remat=remat)
    compiled = _kept_for_backward(cfg, large, context) - _kept_for_backward(cfg, small, context)
    planned = {
      b: plan.activation_bytes(cfg.replace(dtype="bfloat16"), quant, b, context)
      for b in (small, large)
    }
    if not remat:
      no_remat = planned[large][0] - planned[small][0]
      assert abs(compiled / no_remat - 1) < 0.02, (compiled, no_remat)
      continue
    kept = planned[large][2] - planned[small][2]
    guidance = plan.guidance_bytes(
      cfg.replace(dtype="bfloat16"),
      plan.PlanConfig(mesh=(1, 1, 1), batch=large - small, context=context),
      plan.abstract_mesh(1, 1, 1),
      quant,
    )
    assert abs((compiled - guidance) / kept - 1) < 0.02, (compiled, guidance, kept)


# What --check's compiled column must equal, computed another way: the update compiled from
# a real tiny policy and optimizer (`rl.step.init_state`) placed on a fake mesh, and its
# guidance from a real rollout of a real engine; the rollout's generate from that engine's
# own weights and statics. Printed as {program: memory_analysis fields} (JSON).
_INDEPENDENT = """
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from trace_jax import model as M
from trace_jax.model.sharding import make_mesh, shard_model, batch_sharding, guidance_specs
from trace_jax.rl import programs
from trace_jax.rl import step as T
from trace_jax.rl.config import RLConfig
from trace_jax.rollout import decode as D
from trace_jax.rollout import engine as E
from trace_jax.rollout.config import RolloutConfig, SamplingConfig
from jax.sharding import NamedSharding

batch, context, prompt, mesh_shape = {batch}, {context}, {prompt}, {mesh}
mesh = make_mesh(*mesh_shape)
rl = RLConfig(arm="trace", mesh=mesh_shape, compute_dtype="bfloat16")
cfg = M.get_preset("tiny").replace(dtype="bfloat16")
policy = shard_model(M.Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
state = T.init_state(rl, policy, mesh=mesh)
spec = T.StepSpec.of(rl, cfg.num_layers, mesh)
base = RolloutConfig(
  max_len=context,
  sampling=SamplingConfig(max_new_tokens=context - prompt),
  compute_dtype="bfloat16",
  fp4=rl.fp4,
)
engine = E.RolloutEngine(policy, rl.arm_spec.rollout(base), mesh=mesh)
rng = np.random.default_rng(0)
prompts = rng.integers(1, cfg.vocab_size, (batch, prompt)).tolist()
key = jax.random.key(0)
tokens = engine._place(jnp.asarray(prompts, jnp.int32))
mask = engine._place(jnp.ones((batch, prompt), bool))
out = {{}}
rows = (engine._place(jnp.arange(batch, dtype=jnp.uint32)),)
rows += (engine._place(jnp.full((batch,), context - prompt, jnp.int32)),)
m = D.generate_program.lower(
  engine.graphdef, engine.params, tokens, mask, key, None, *rows, engine.statics
)
out["rollout"] = m.compile().memory_analysis()
micro = mesh_shape[0]
r = engine.generate(prompts[:micro], key)
g = r.guidance.select_layers(spec.guided_layers)
g = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), g, guidance_specs(g, mesh))
put = lambda a: jax.device_put(a, batch_sharding(mesh, a.ndim))
example = T.TrainExample(
  tokens=put(r.tokens), positions=put(r.positions), mask=put(r.mask),
  response_mask=put(r.response_mask), rollout_logp=put(r.logprobs),
  advantages=put(jnp.ones((micro,), jnp.float32)),
)
with jax.set_mesh(mesh):
  m = programs.train_step.lower(
    state.policy, state.opt, example, g, None, loss_config=rl.loss_config, fused=spec.fused,
    record=spec.arm.measured, mesh=mesh, **spec.static,
  )
  out["update"] = m.compile().memory_analysis()
fields = ("argument", "output", "alias", "temp", "generated_code")
print("JSON" + json.dumps({{
  k: {{f: int(getattr(v, f + "_size_in_bytes")) for f in fields}} for k, v in out.items()
}}))
"""


def _fake_devices_env(count: int) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  flag = f"--xla_force_host_platform_device_count={count}"
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
  return env


@pytest.mark.slow
@pytest.mark.timeout(2100)  # two programs of up to 15 min each
def test_check_prints_the_planner_beside_the_compiled_programs():
  """`plan.py --check` (tiny preset, 8 fake devices on a 2 x 2 x 2 mesh; ~1 min): both
  columns for both programs, and its compiled bytes exactly XLA's memory_analysis of the
  trainer's update and the engine's generate compiled from real arrays on the same mesh."""
  batch, context, mesh = 8, 64, (2, 2, 2)
  cmd = [
    sys.executable,
    os.path.join(ROOT, "experiments", "plan.py"),
    "--preset=tiny",
    f"--mesh={','.join(map(str, mesh))}",
    f"--batch={batch}",
    f"--context={context}",
    "--check",
  ]
  result = subprocess.run(
    cmd, capture_output=True, text=True, timeout=900, env=_fake_devices_env(1)
  )
  assert result.returncode == 0, result.stderr[-3000:]
  table = {}
  for line in result.stdout.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 6 and cells[0] in ("update", "rollout"):
      table[cells[0], cells[1]] = cells[2:]
  script = _INDEPENDENT.format(batch=batch, context=context, prompt=context // 4, mesh=mesh)
  ref = subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    timeout=900,
    env=_fake_devices_env(8),
  )
  assert ref.returncode == 0, ref.stderr[-3000:]
  import json  # noqa: PLC0415

  memory = json.loads(ref.stdout.split("JSON", 1)[1])
  for program, m in memory.items():
    expected = {
      "arguments": m["argument"],
      "outputs (not aliased)": m["output"] - m["alias"],
      "aliased outputs (donated)": m["alias"],
      "temporaries": m["temp"],
      "generated code": m["generated_code"],
      "program peak": m["argument"] + m["output"] - m["alias"] + m["temp"],
    }
    for item, value in expected.items():
      planner, compiled_gb, ratio, compiled = table[program, item]
      assert int(compiled) == value, (program, item, compiled, value)
      assert compiled_gb == f"{value / 1e9:,.3f}"
      if item in ("arguments", "outputs (not aliased)", "temporaries"):
        assert planner != "—" and float(planner.replace(",", "")) >= 0, (program, item)
        if ratio == "—":  # no planned bytes (the rollout's temporaries)
          assert float(planner.replace(",", "")) == 0, (program, item)
  assert "H200 (141 GB): update: planner" in result.stdout
