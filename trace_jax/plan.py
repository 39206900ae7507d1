"""Memory planner: bytes per device of an RL run on a (data, expert, model) mesh, from shapes.

Nothing is materialised: every figure comes from `jax.eval_shape` (or an abstract trace) of
the real code and the per-device shard shapes of the real shardings
(`NamedSharding.shard_shape`), over an abstract mesh of the requested size, so no devices
are needed. Per device:

  master weights     float32 parameters, FSDP / expert / model split (`model.sharding`);
  optimizer state    Adam's two moments, split like their parameters;
  gradients          float32, split like the parameters (alive during the update);
  FP4 rollout weights `quantize_params` output (packed codes, scales, high-precision rest),
                     split over expert / model, whole on each data replica;
  KV cache           bf16 and FP4, `batch` sequences of `context` slots, batch over data,
                     KV heads over model; Gated DeltaNet layers keep a recurrent state instead;
  guidance           compact guidance of the rollout's guided layers (+ routing replay) for
                     `batch` x `context` tokens, batch over data and the sites of
                     model-split activations over model (`sharding.guidance_specs`);
  activations        the residuals the backward pass of one training micro-batch keeps: the
                     outputs of `jax.vjp` traced abstractly, of one block of each layer type
                     and of the LM head, counting only values that depend on the tokens
                     (weights and their QAT copies are not activations). Without remat every
                     layer keeps its residuals; with per-layer remat only each layer's input
                     is kept, plus one layer's residuals while it is recomputed. Activations
                     are split over data only (an upper bound when "model" > 1).
  training-path records  what the update returns beside the new state when the arm's two
                     paths both run FP4 (`Trainer.measured`, `PlanConfig.train_records`):
                     the training path's site records in full at every layer (the per-layer
                     disagreement metrics) and the bool guidance fallbacks of the guided
                     layers' sites, for one micro-batch; split like the activations. Not
                     small: Qwen3-30B-A3B, 2048 tokens per device, 1.6 GB beside 3.7 GB of
                     remat activations (4x the layers' saved inputs).
  softmax gradients  what the backward of one attention layer holds beside the residuals:
                     the gradients of its softmax's probabilities and scores, float32
                     [micro-batch, heads, context, context] each (`softmax_grad_bytes`).
  LM head gradients  what the backward of the LM head's log-softmax holds beside its
                     residual logits: the shifted logits, their exponentials and the
                     logits' gradient, float32 [micro-batch, context, vocabulary] each
                     (`lm_head_grad_bytes`; the vocabulary split over model).
  rollout working set  the rollout call's largest temporaries (`rollout_working_bytes`): a
                     prefill chunk's float32 attention scores over every cache slot (twice),
                     its routed experts' weights gathered per tile in float32 (gate, up and
                     down), and a stacked copy of the scanned layers' FP4 rollout weights.

A device fits if the larger phase, training (master + optimizer + gradients + rollout
weights + guidance + activations + training-path records + softmax and LM head gradients)
or rollout (master + optimizer + rollout weights + cache + guidance + rollout working set),
stays under its memory.

Remat runs in the default job: its update records the training path's sites, and the
records leave each rematerialised block as outputs (`transformer._rematerialized`).

What was checked against XLA's compiled memory (tests/rl/test_plan.py, on CPU, the trace
arm's update: guided, routing replay, full records):
- the update's arguments are master + optimizer + guidance (+ the trajectories) and its
  returned bytes the training-path records (+ per-token log-probs and entropy), exactly;
- what its forward keeps for the backward (the compiled `jax.vjp` residuals, per added
  micro-batch): within 1% of "activations (no remat)" without remat, and within 1% of the
  part of "activations (remat)" kept between the passes (`activation_bytes`' kept) with
  remat, beside the guidance it holds (the attention mask, bool [batch, context, context],
  and the RoPE tables are counted once for all layers: without them the kept part was 14%
  short at the tiny test model's d_model of 64);
XLA:CPU does not realise remat's savings inside one compiled update (its CSE merges the
recomputation with the forward: 16 tanh in an 8-layer MLP's lowered gradient, 8 after
compilation, the same temporaries with and without jax.checkpoint), so the update's
temporaries are checked there only as a lower bound; the transient part of the remat row
(one layer's residuals while it is recomputed) is the no-remat figure per layer, checked
above, but its realisation on a GPU is unverified.

At full size (`experiments/plan.py --check`, `run.memory_check`: the trainer's update and
the engine's generate compiled from abstract shapes on 64 fake CPU devices, Qwen3-30B-A3B
on mesh 8 x 8 x 1, batch 256, context 8192, micro-batch 8, remat off, 48 layers):
- the update's arguments (master + Adam + one micro-batch's guidance + trajectories) and
  the rollout's (FP4 rollout weights + prompt) are exact, the rollout's outputs (FP4 KV
  cache + every layer's guidance + slot buffers) within 0.4%, the update's temporaries
  (gradients + activations without remat) within 1.2%;
- the update returned 1.75x the training-path records row while it constrained no output
  (XLA left the moe_mid records of the unguided layers replicated, 8x their share); it now
  lays its records and fallbacks out by `guidance_site_specs`: 1.000x (4 layers, mesh
  2 x 4 x 1, 16 x 256; 1.108x before);
- the rollout's temporaries, which the planner leaves out, were most of its footprint while
  the prefill fed the whole prompt in one forward (2.96 TB per device at a 2048-token prompt,
  ~48 GB more per layer): the grouped MoE's weights gathered per tile of 256 token-expert rows
  (`layers.ragged_matmul`: f32 [2176 tiles, 768, 2048], 12.75 GiB, five such live with their
  bf16 copies) and the attention scores over every cache slot in float32 (f32 [32, 4, 8, 1024,
  4096], 16 GiB, two live, at 1 layer, mesh 2 x 4 x 1, 64 prompts of 1024 tokens). With the
  prompt fed `RolloutConfig.prefill_chunk` (128) slots at a time they were 48.7 GB at full size
  with the layers under the scan (62.4 GB unrolled; 103.6 GB with 256-slot chunks, unrolled),
  most of it the MoE's one sort over the whole batch (every device gathering weights for
  the 1,152 tiles of all 256 prompts' rows); with each "data" shard dispatching its own
  sequences (`CallOptions.moe_blocks`) they are 16.3 GB: the chunk's float32 attention
  scores (4 GiB, two live), the experts' tile weights (1.5 GiB per matrix, four live) and a
  stacked copy of the scanned layers' FP4 expert weights, which the "rollout working set"
  row counts (16.0 GB; the rollout's phase peak 74.4 GB against 73.9 planned, 57.9 before
  the row); the engine computes the LM head at the prompt's last slot only
  (`CallOptions.last_logits`), so no [B, T, V] float32 logits;
- the update, each "data" shard dispatching its own tokens too, needs 1,356 GB of
  temporaries (1,747 with one sort over the micro-batch) against the planner's 1,443 with the
  "softmax gradients" and "LM head gradients" rows (0.940); with remat 61.4 GB against 70.7
  (0.869). Other presets and their misses: docs/scale-out.md;
- unrolled, with remat the update's temporaries stay near the no-remat figure on XLA:CPU
  (8 layers: 277 GB against 313 GB without, the planner's 43 GB), as above.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from trace_jax import guidance as guidance_lib
from trace_jax.model import sharding
from trace_jax.model.cache import init_cache
from trace_jax.model.config import ModelConfig
from trace_jax.model.layers import (
  LayerInputs,
  block_tile_rows,
  rope_tables,
  tile_count,
  tile_rows,
)
from trace_jax.model.quant import (
  CallOptions,
  QuantConfig,
  Recording,
  check_run_scheme,
  resolve_layers,
)
from trace_jax.model.quantizer import SiteQuantizer
from trace_jax.memory_bound import has_attention, lm_head_grad_bytes, softmax_grad_bytes
from trace_jax.model.transformer import Block, Transformer, attention_mask
from trace_jax.rollout.config import RolloutConfig
from trace_jax.rollout.params import quantize_params
from trace_jax.training.forward import token_logprobs
from trace_jax.utils import flags
from trace_jax.utils.flags import knob

H200_BYTES = 141e9  # HBM3e of one H200 (141 GB)
GB = 1e9


def abstract_mesh(data: int, expert: int, model: int) -> AbstractMesh:
  """A mesh of the given shape without devices (shardings of it give shard shapes)."""
  for name, size in zip(sharding.MESH_AXES, (data, expert, model)):
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"mesh {name}={size!r} must be an int >= 1")
  return AbstractMesh((data, expert, model), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _per_device(tree, specs, mesh) -> int:
  """Bytes on one device of abstract `tree` placed by the PartitionSpecs `specs` (same
  structure, PartitionSpec leaves)."""
  leaves = jax.tree.leaves(tree)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  if len(leaves) != len(spec_leaves):
    raise AssertionError(f"{len(leaves)} arrays but {len(spec_leaves)} specs")
  total = 0
  for leaf, spec in zip(leaves, spec_leaves):
    shape = NamedSharding(mesh, spec).shard_shape(tuple(leaf.shape))
    total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
  return total


def _specs(state_shardings):
  return jax.tree.map(
    lambda s: s.spec, state_shardings, is_leaf=lambda x: isinstance(x, NamedSharding)
  )


def _dependent_residual_bytes(fn, args, dependent_argnums) -> int:
  """Bytes of the residuals `jax.vjp(fn, *args)` keeps that depend on the arguments in
  `dependent_argnums` (the activations), from an abstract trace: a residual that is an
  argument itself or a function of the others (weights, their QAT copies) is not counted."""
  closed, out_shape = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a), return_shape=True)(*args)
  jaxpr = closed.jaxpr
  num_res = len(jax.tree.leaves(out_shape[1]))
  flat_args = [jax.tree.leaves(a) for a in args]
  dependent, start = set(), 0
  for i, leaves in enumerate(flat_args):
    if i in dependent_argnums:
      dependent.update(jaxpr.invars[start : start + len(leaves)])
    start += len(leaves)
  for eqn in jaxpr.eqns:
    if any(not isinstance(v, jax_core.Literal) and v in dependent for v in eqn.invars):
      dependent.update(eqn.outvars)
  total, seen = 0, set()
  for var in jaxpr.outvars[len(jaxpr.outvars) - num_res :]:
    if isinstance(var, jax_core.Literal) or var in seen or var not in dependent:
      continue
    seen.add(var)
    total += math.prod(var.aval.shape) * jnp.dtype(var.aval.dtype).itemsize
  return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
  """What to plan for."""

  mesh: tuple = knob((8, 8, 1), "data,expert,model device counts.", parse=flags.parse_ints)
  batch: int = knob(256, "Rollout sequences in flight (global).")
  context: int = knob(8192, "Slots per sequence (prompt + response).")
  micro_batch: int = knob(0, "Training sequences per micro-batch (global); 0 = one per data shard.")
  fp4: QuantConfig = QuantConfig()  # of the rollout weights, the KV cache and QAT
  guidance: str = knob("compact", "Guidance kind.", choices=("none", "compact", "full"))
  guided_layers: str = knob("last_half", "Guided layers: last_half, all, none or a count.")
  train_records: bool = knob(
    True,
    "The update returns the training path's full site records and guided fallbacks (an arm "
    "whose two paths run FP4).",
  )
  device_gb: float = knob(H200_BYTES / GB, "Memory of one device, GB.")
  prefill_chunk: int = knob(
    RolloutConfig.prefill_chunk,
    "Prompt slots per sequence the rollout's prefill feeds at once (RolloutConfig."
    "prefill_chunk); 0: the whole context.",
  )

  def __post_init__(self):
    check_run_scheme(self.fp4, "PlanConfig.fp4")
    object.__setattr__(self, "mesh", tuple(int(m) for m in self.mesh))
    if len(self.mesh) != 3 or min(self.mesh) < 1:
      raise ValueError(f"PlanConfig.mesh={self.mesh} must be 3 sizes (data, expert, model) >= 1")
    for name in ("batch", "context"):
      if getattr(self, name) < 1:
        raise ValueError(f"PlanConfig.{name}={getattr(self, name)} must be >= 1")
    if self.batch % self.mesh[0]:
      raise ValueError(f"PlanConfig.batch={self.batch} must divide over data={self.mesh[0]}")
    micro = self.micro_batch or self.mesh[0]
    if micro % self.mesh[0]:
      raise ValueError(
        f"PlanConfig.micro_batch={self.micro_batch} must divide over data={self.mesh[0]}"
      )
    if self.prefill_chunk < 0:
      raise ValueError(f"PlanConfig.prefill_chunk={self.prefill_chunk} must be >= 0")
    if self.guidance not in ("none", "compact", "full"):
      raise ValueError(f"PlanConfig.guidance={self.guidance!r}; use none, compact or full")

  @property
  def device_bytes(self) -> float:
    return self.device_gb * GB


def plan(cfg: ModelConfig, config: PlanConfig) -> dict[str, float]:
  """Bytes per device of each item (see the module docstring), and the phase totals."""
  mesh = abstract_mesh(*config.mesh)
  data = config.mesh[0]
  quant = config.fp4
  cfg = cfg.replace(dtype="bfloat16")
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  rows: dict[str, float] = {}

  param_specs = _specs(sharding.param_shardings(model, mesh))
  rows["master weights (f32)"] = _per_device(params, param_specs, mesh)
  rows["gradients (f32)"] = rows["master weights (f32)"]
  opt = nnx.eval_shape(lambda: nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param))
  rows["optimizer state (Adam)"] = _per_device(
    nnx.state(opt), _specs(sharding.optimizer_shardings(opt, model, mesh)), mesh
  )

  rollout_params = jax.eval_shape(lambda s: quantize_params(s, quant), nnx.state(model))
  rows["FP4 rollout weights"] = _per_device(
    rollout_params, _specs(sharding.rollout_param_shardings(rollout_params, mesh)), mesh
  )

  def cache_bytes(q, part):
    cache = jax.eval_shape(
      lambda: init_cache(cfg, config.batch, config.context, q, dtype=jnp.bfloat16)
    )
    specs = sharding.cache_specs(cache, mesh)
    pick = (lambda c: (c.k, c.v)) if part == "kv" else (lambda c: (c.conv, c.recurrent))
    return _per_device(pick(cache), pick(specs), mesh)

  rows["KV cache (bf16)"] = cache_bytes(None, "kv")
  rows["KV cache (FP4)"] = cache_bytes(quant, "kv")
  rows["recurrent state"] = cache_bytes(None, "state")

  rows["guidance"] = float(guidance_bytes(cfg, config, mesh, quant))
  rows["rollout working set"] = float(rollout_working_bytes(cfg, config, rollout_params, mesh))

  micro = (config.micro_batch or data) // data  # sequences per device
  no_remat, remat, _ = activation_bytes(cfg, quant, micro, config.context, blocks=data)
  rows["activations (no remat)"] = no_remat
  rows["activations (remat)"] = remat
  rows["softmax gradients"] = float(softmax_grad_bytes(cfg, micro, config.context))
  rows["LM head gradients"] = float(
    lm_head_grad_bytes(cfg, micro, config.context, model=config.mesh[2])
  )
  rows["training-path records"] = (
    float(train_record_bytes(cfg, config, quant, micro)) if config.train_records else 0.0
  )

  resident = (
    rows["master weights (f32)"]
    + rows["optimizer state (Adam)"]
    + rows["FP4 rollout weights"]
    + rows["guidance"]
  )
  rows["rollout peak (FP4 KV)"] = (
    resident + rows["KV cache (FP4)"] + rows["recurrent state"] + rows["rollout working set"]
  )
  training = (
    resident
    + rows["gradients (f32)"]
    + rows["training-path records"]
    + rows["softmax gradients"]
    + rows["LM head gradients"]
  )
  rows["train peak (no remat)"] = training + no_remat
  rows["train peak (remat)"] = training + remat
  return rows


_RECORD_FULL = CallOptions(recording=Recording(form="full"))  # every site, in full


def rollout_working_bytes(cfg: ModelConfig, config: PlanConfig, rollout_params, mesh) -> int:
  """What a rollout call holds beside its arguments and outputs, per device: the largest
  temporaries of the compiled generate (XLA's buffer report at Qwen3-30B-A3B on 8 x 8 x 1):

  - a prefill chunk's float32 attention scores over every cache slot, [B / data, query
    heads (over "model" where it splits the KV heads), chunk, context], twice (the scores
    and their softmax);
  - its routed experts' weights gathered per tile (`layers.ragged_matmul`, [tiles, d_model,
    expert width over "model"]), for gate, up and down: the tiles of one data shard's
    (token, slot) rows, one tile per expert (`moe_blocks`) on a mesh with data > 1, else the
    default tiling of the whole batch's rows. Counted in float32: the program gathers them
    in the compute dtype, but XLA:CPU computes bf16 dots in float32 and holds float32
    copies (on a GPU, where they stay bf16, this is an upper bound);
  - with `cfg.scan_layers`, a stacked copy of the layers' FP4 rollout weights (the engine
    keeps them per layer; the program stacks each scanned run's once per call).

  The chunk is `config.prefill_chunk` slots (0: the context), at most the context: an upper
  bound for shorter prompts. A decode step's scores and tiles are smaller."""
  data, _, model = config.mesh
  rows = config.batch // data
  chunk = min(config.prefill_chunk or config.context, config.context)
  heads = cfg.num_heads
  if model > 1 and cfg.num_kv_heads % model == 0:
    heads //= model
  scores = 2 * rows * heads * chunk * config.context * 4 if has_attention(cfg) else 0
  tiles_bytes = 0
  if cfg.num_moe_layers:
    experts = cfg.num_experts
    width = cfg.moe_ffn_dim // model if cfg.moe_ffn_dim % model == 0 else cfg.moe_ffn_dim
    if data > 1:
      routed = rows * chunk * cfg.num_experts_per_tok
      tile = block_tile_rows(routed, experts)
    else:
      routed = config.batch * chunk * cfg.num_experts_per_tok
      tile = tile_rows(routed, experts)
    tiles_bytes = 3 * tile_count(routed, experts, tile) * cfg.d_model * width * 4
  stacked = 0
  if cfg.scan_layers:
    specs = _specs(sharding.rollout_param_shardings(rollout_params, mesh))
    stacked = _per_device(rollout_params["blocks"], specs["blocks"], mesh)
  return scores + tiles_bytes + stacked


def train_record_bytes(cfg: ModelConfig, config: PlanConfig, quant: QuantConfig, batch: int):
  """Bytes of the training path's records that an FP4 arm's update returns for `batch`
  sequences of `config.context` slots: every site of every layer in full (codes, block
  scales, global scales) and a bool fallback per element at the guided layers' sites."""
  sites = jax.eval_shape(
    lambda: (
      Transformer(cfg, rngs=nnx.Rngs(0))(
        jnp.zeros((1, 1), jnp.int32), quant=quant, options=_RECORD_FULL
      ).sites
    )
  )
  per_token = sum(
    math.prod(x.shape[2:]) * x.dtype.itemsize for q in sites.values() for x in jax.tree.leaves(q)
  )
  if config.guidance != "none":
    guided = set(resolve_layers(config.guided_layers, cfg.num_layers))
    per_token += sum(math.prod(q.shape[2:]) for key, q in sites.items() if key[0] in guided)
  return per_token * batch * config.context


def abstract_guidance(cfg: ModelConfig, config: PlanConfig, quant: QuantConfig):
  """The eval_shape of the `Guidance` a rollout of `config.batch` x `config.context` slots
  captures: the records of one abstract forward of one token (their trailing shapes),
  stretched to [batch, context], as the rollout engine's buffers are (`_empty_records`)."""
  layers = resolve_layers(config.guided_layers, cfg.num_layers)

  def capture():
    out = Transformer(cfg, rngs=nnx.Rngs(0))(
      jnp.zeros((1, 1), jnp.int32), quant=quant, options=_RECORD_FULL
    )
    sites = guidance_lib.from_records(out.sites, config.guidance, layers)
    routing = out.routing.astype(guidance_lib.routing_dtype(cfg.num_experts))
    return guidance_lib.Guidance(sites=sites, routing=routing, mode=config.guidance, layers=layers)

  one = jax.eval_shape(capture)
  b, s = config.batch, config.context
  sites = jax.tree.map(lambda x: jax.ShapeDtypeStruct((b, s) + x.shape[2:], x.dtype), one.sites)
  routing = jax.ShapeDtypeStruct(
    one.routing.shape[:1] + (b, s) + one.routing.shape[3:], one.routing.dtype
  )
  return dataclasses.replace(one, sites=sites, routing=routing)


def guidance_bytes(cfg: ModelConfig, config: PlanConfig, mesh, quant: QuantConfig) -> int:
  """Guidance bytes per device: `abstract_guidance` placed by `sharding.guidance_specs`
  (batch over "data", and over "model" where the site's activation is split), the
  layout the rollout engine and the trainer hold it in."""
  if config.guidance == "none":
    return 0
  guidance = abstract_guidance(cfg, config, quant)
  specs = sharding.guidance_specs(guidance, mesh)
  return _per_device(guidance, specs, mesh)


def activation_bytes(
  cfg: ModelConfig, quant: QuantConfig, batch: int, context: int, blocks: int = 1
) -> tuple[float, float, float]:
  """(without remat, with per-layer remat, kept with remat) residual bytes of a training
  forward of [batch, context] tokens on one device (QAT with `quant`, bf16 activations).
  `blocks`: the "data" shards, each dispatching its own tokens to the routed experts
  (`CallOptions.moe_blocks`): traced as `blocks` x `batch` sequences, per device a
  `blocks`-th of that.

  With remat, "kept" is what stays between the forward and the backward pass (each layer's
  input, what every layer reads beside it, and the LM head's residuals); the remat figure
  adds one layer's residuals, alive while the backward recomputes it."""
  b, t = batch * blocks, context
  options = CallOptions(moe_blocks=blocks)
  x = jax.ShapeDtypeStruct((b, t, cfg.d_model), jnp.bfloat16)
  per_type: dict[bool, int] = {}
  for layer in range(cfg.num_layers):
    kind = (layer in cfg.linear_layers, layer in cfg.dense_layers)
    if kind in per_type:
      continue
    block = nnx.eval_shape(lambda: Block(cfg, layer, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(block)

    def block_fn(state, x, layer=layer, graphdef=graphdef):
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
      valid = jnp.ones((b, t), bool)
      cos, sin = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
      mask = attention_mask(valid, positions, jnp.arange(t, dtype=jnp.int32), cfg.sliding_window)
      sq = SiteQuantizer(quant, cfg.num_layers, jnp.bfloat16, options=options)
      inputs = LayerInputs(
        cos=cos, sin=sin, attn_mask=mask, valid=valid, start=jnp.zeros((), jnp.int32)
      )
      out, _, stats = nnx.merge(graphdef, state)(x, inputs, sq=sq)
      return out, None if stats is None else stats.lb_loss

    per_type[kind] = _dependent_residual_bytes(block_fn, (state, x), {1}) // blocks
  counts: dict = {}
  for layer in range(cfg.num_layers):
    kind = (layer in cfg.linear_layers, layer in cfg.dense_layers)
    counts[kind] = counts.get(kind, 0) + 1

  head = nnx.eval_shape(
    lambda: Transformer(
      cfg.replace(num_layers=1, layer_types=(), dense_layers=()), rngs=nnx.Rngs(0)
    )
  )
  tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)

  def head_fn(head_state, x, tokens):
    model = nnx.merge(nnx.graphdef(head), head_state)
    h = model.final_norm(x).astype(jnp.float32)
    table = model.embed.get_value().T if model.lm_head is None else model.lm_head.get_value()
    logits = jnp.einsum("btd,dv->btv", h, table)
    return jnp.sum(token_logprobs(logits, tokens))

  head_state = nnx.state(head)
  head_bytes = _dependent_residual_bytes(head_fn, (head_state, x, tokens), {1, 2}) // blocks
  head_bytes += _shared_input_bytes(cfg, b, t) // blocks
  layer_input = batch * t * cfg.d_model * 2
  no_remat = sum(per_type[k] * n for k, n in counts.items()) + head_bytes
  kept = cfg.num_layers * layer_input + head_bytes
  return float(no_remat), float(kept + max(per_type.values())), float(kept)


def _shared_input_bytes(cfg: ModelConfig, b: int, t: int) -> int:
  """Bytes of what every block reads beside the residual stream (`LayerInputs`): the
  valid-token mask and, with attention layers, the RoPE tables and the attention mask
  (bool [b, t, t]). The forward makes them once from the tokens' positions and mask, and
  the backward keeps one copy for all layers, with remat or without (a block's residuals
  above count only what depends on its input x)."""

  def make(positions, valid):
    slots = jnp.arange(t, dtype=jnp.int32)
    if not has_attention(cfg):
      return valid
    cos, sin = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
    return cos, sin, attention_mask(valid, positions, slots, cfg.sliding_window), valid

  shapes = jax.eval_shape(
    make, jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), bool)
  )
  return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(shapes))


def format_table(name: str, config: PlanConfig, rows: dict[str, float]) -> str:
  """A markdown table of `plan` rows in GB per device, with the verdict against the device."""
  limit = config.device_bytes
  lines = [
    f"{name} on mesh (data, expert, model) = {config.mesh}, batch {config.batch}, "
    f"context {config.context}, micro-batch {config.micro_batch or config.mesh[0]}, "
    f"{config.fp4.fmt} ({config.fp4.sites}), guidance {config.guidance}",
    "",
    "| per device | GB |",
    "| --- | ---: |",
  ]
  for key, value in rows.items():
    lines.append(f"| {key} | {value / GB:,.2f} |")
  verdicts = []
  for key in ("rollout peak (FP4 KV)", "train peak (no remat)", "train peak (remat)"):
    verdicts.append(f"{key}: {'fits' if rows[key] <= limit else 'does NOT fit'}")
  lines.append("")
  lines.append(f"H200 ({limit / GB:.0f} GB): " + "; ".join(verdicts))
  return "\n".join(lines)
