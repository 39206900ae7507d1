"""`gpu_check.py`'s decode and rollout sections: FP4 against the fair bf16 decode, one step
per call at Qwen3-30B-A3B's shapes, and whole rollouts of the model's geometry."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gpu_record import Run, gigabytes, tree_bytes, fair_moe_kind
from trace_jax import kernels as kernels_lib
from trace_jax import model as M
from trace_jax.kernels import layout, moe_bf16
from trace_jax.model import moe as moe_module
from trace_jax.model.cache import init_cache
from trace_jax.rollout.params import fuse_for_kernels, quantize_params
from trace_jax.utils import markdown_table
from trace_jax.utils.device_time import device_time, device_time_carried

FULL_DEPTH = 48  # Qwen3-30B-A3B's layers
# FP4 / fair-bf16 tokens/s per decode case (docs/kernels.md).
SPEEDUP_TARGETS = {0: 1.5, 1: 1.2, 2: 2.0}


@contextlib.contextmanager
def _fair_bf16_layers(kind: str):
  """The model's bf16 MoE layers run `moe_bf16.apply(kind, ...)` on weights that
  `layout_bf16_experts(params, kind)` laid out at weight sync, in place of the engine's
  sort-and-`ragged_matmul` dispatch."""
  original = moe_module.MoE._grouped

  def grouped(self, xq, experts, *, layer, sq, tokens_shape):
    del layer, sq, tokens_shape
    gate_up, _, down = self._weights()
    return moe_bf16.apply(kind, xq, experts, gate_up, down)

  moe_module.MoE._grouped = grouped
  try:
    yield
  finally:
    moe_module.MoE._grouped = original


def layout_bf16_experts(params: nnx.State, kind: str) -> nnx.State:
  """bf16 parameters with each MoE layer's routed experts laid out as `kind` reads them:
  gate_up in w_gate's place, a `FusedPart` in w_up's, w_down as `prepare` gives it."""
  flat = list(nnx.to_flat_state(params))
  values = {tuple(path): variable.get_value() for path, variable in flat}
  new = {}
  for path in values:
    if path[-1] == "w_gate" and path[:-1] + ("w_up",) in values:
      base = path[:-1]
      gate_up, down = moe_bf16.prepare(
        kind, values[path], values[base + ("w_up",)], values[base + ("w_down",)]
      )
      new.update({path: gate_up, base + ("w_up",): layout.FusedPart(1), base + ("w_down",): down})
  return nnx.from_flat_state([(p, v.replace(new.get(tuple(p), v.get_value()))) for p, v in flat])


# --- decode ---------------------------------------------------------------------------


def _random_cache(cfg, batch: int, slots: int, quant, key):
  """A cache with every slot written: random codes, finite E4M3 scales, unit global scales
  (or random bf16 entries); the next write goes to the last slot."""
  cache = init_cache(cfg, batch, slots, quant, dtype=jnp.bfloat16)
  leaves, tree = jax.tree.flatten(cache)
  keys = jax.random.split(key, len(leaves))

  def fill(leaf, k):
    if leaf.dtype == jnp.uint8:  # codes, or E4M3 scale bits in [0x20, 0x40): 2^-3 .. 2
      value = jax.random.randint(k, leaf.shape, 0, 256, jnp.int32)
      if leaf.shape[-1] == cfg.head_dim // 2:
        return value.astype(jnp.uint8)
      return (0x20 + value % 0x20).astype(jnp.uint8)
    if leaf.dtype == jnp.bfloat16:
      return jax.random.normal(k, leaf.shape, jnp.bfloat16)
    if leaf.dtype == jnp.bool_:
      return jnp.ones(leaf.shape, bool)
    if leaf.ndim == 0:  # the write index
      return jnp.asarray(slots - 1, leaf.dtype)
    return leaf  # global scales: ones

  return jax.tree.unflatten(tree, [fill(leaf, k) for leaf, k in zip(leaves, keys)])


def _decode_time(graphdef, params, cfg, batch, context, quant, kernels, key, calls):
  """Device seconds of one decode step (every step writes the same last slot)."""
  cache = _random_cache(cfg, batch, context + 1, quant, key)
  tokens = jax.random.randint(key, (batch, 1), 0, cfg.vocab_size)
  options = M.CallOptions(compute_dtype="bfloat16", kernels=kernels)

  @functools.partial(jax.jit, donate_argnums=0)  # the cache is updated in place
  def step(cache, params, tokens):
    out = nnx.merge(graphdef, params)(tokens, cache=cache, quant=quant, options=options)
    return dataclasses.replace(out.cache, index=cache.index)

  return device_time_carried(lambda c: step(c, params, tokens), cache, calls=calls)


def _step_logits(graphdef, params, cache, tokens, quant, kernels):
  options = M.CallOptions(compute_dtype="bfloat16", kernels=kernels)
  step = jax.jit(
    lambda p, c, t: nnx.merge(graphdef, p)(t, cache=c, quant=quant, options=options).logits
  )
  return np.asarray(step(params, cache, tokens), np.float32)


def decode_section(run: Run) -> None:
  rec, key = run.rec, jax.random.key(0)
  cfg = M.get_preset(run.shapes["preset"], num_layers=run.options["layers"])
  policy = M.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(policy)
  quant = M.QuantConfig()
  # Weights laid out once, outside every timed step: FP4 packed with q|k|v and gate|up
  # fused for the kernels; bf16 cast, its experts laid out for each batch's fair MoE.
  fp4_params = jax.jit(lambda s: fuse_for_kernels(quantize_params(s, quant, dtype=jnp.bfloat16)))(
    state
  )
  bf16_params = jax.jit(lambda s: quantize_params(s, None, dtype=jnp.bfloat16))(state)

  def parity(state=state):
    """One FP4 decode step on the Pallas kernels (fused weights) against the same step on
    the XLA path (per-matrix weights), same parameters and cache: both quantize
    identically, so only summation order and bf16 roundings differ."""
    context, batch = run.shapes["parity"]
    xla_params = jax.jit(lambda s: quantize_params(s, quant, dtype=jnp.bfloat16))(state)
    cache = _random_cache(cfg, batch, context + 1, quant, key)
    tokens = jax.random.randint(key, (batch, 1), 0, cfg.vocab_size)
    got = _step_logits(graphdef, fp4_params, cache, tokens, quant, "pallas")
    want = _step_logits(graphdef, xla_params, cache, tokens, quant, "xla")
    error = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    agree = float(np.mean(np.argmax(got, -1) == np.argmax(want, -1)))
    finite = bool(np.isfinite(got).all())
    rec.print(
      markdown_table(
        ["decode step parity", "relative L2 error of logits", "argmax agreement", "finite"],
        [(f"{context}/b{batch}: pallas vs xla", f"{error:.2e}", f"{agree:.0%}", finite)],
      )
      + "\n"
    )
    rec.target(
      f"FP4 decode step, Pallas vs XLA logits at {context}/b{batch}",
      f"rel. L2 {error:.2e}, argmax {agree:.0%}",
      "<= 5e-2, finite",
      finite and error <= 5e-2,
    )
    return dict(relative_l2=error, argmax_agreement=agree, finite=finite)

  run.measure("parity", "decode step parity", parity)
  head = state["lm_head"].get_value() if "lm_head" in state else state["embed"].get_value().T
  del policy, state
  rows, depth = [], cfg.num_layers
  laid_out: dict = {}
  for index, (context, batch) in enumerate(run.shapes["cases"]):
    kind, why = fair_moe_kind(run, batch)

    def case(context=context, batch=batch, kind=kind):
      h = jax.random.normal(key, (batch, 1, cfg.d_model), jnp.float32)
      head_fn = jax.jit(lambda h, w: jnp.einsum("btd,dv->btv", h, w, precision="highest"))
      head_time = device_time(head_fn, h, head, calls=run.calls).busy
      fp4_t = _decode_time(
        graphdef, fp4_params, cfg, batch, context, quant, "pallas", key, run.calls
      )
      if kind not in laid_out:
        laid_out.clear()  # one bf16 layout on the device at a time
        laid_out[kind] = jax.jit(functools.partial(layout_bf16_experts, kind=kind))(bf16_params)
      with _fair_bf16_layers(kind):
        bf16_t = _decode_time(
          graphdef, laid_out[kind], cfg, batch, context, None, "xla", key, run.calls
        )
      full = {}
      for arm, t in (("fp4", fp4_t), ("bf16", bf16_t)):
        per_layer = max(t.busy - head_time, 0.0) / depth
        full[arm] = batch / (head_time + FULL_DEPTH * per_layer)
      top = sorted(fp4_t.kernels.items(), key=lambda kv: -kv[1])[:8]
      return dict(
        context=context,
        batch=batch,
        layers=depth,
        bf16_moe=kind,
        fp4_tokens_per_second=batch / fp4_t.busy,
        bf16_tokens_per_second=batch / bf16_t.busy,
        speedup=bf16_t.busy / fp4_t.busy,
        full_depth_speedup=full["fp4"] / full["bf16"],
        full_depth_tokens_per_second=full,
        fp4_step_device_us=fp4_t.busy * 1e6,
        fp4_step_wall_us=fp4_t.wall * 1e6,
        timing_source=fp4_t.source,
        fp4_top_kernels_us={n: t * 1e6 for n, t in top},
      )

    values = run.measure("decode_case", f"decode {context}/b{batch}", case)
    goal = SPEEDUP_TARGETS[index] if index in SPEEDUP_TARGETS else None
    if values is None:
      state_ = rec.results["measurements"]["decode"][-1]["status"]
      rows.append((f"{context}/b{batch}", state_[:120], "", "", "", "", ""))
      if goal:
        rec.target(
          f"FP4 / fair-bf16 tokens/s at {context}/b{batch}", state_[:60], f">= {goal}x", False
        )
      continue
    v = values
    rows.append(
      (
        f"{context}/b{batch}",
        f"{v['fp4_tokens_per_second']:.0f}",
        f"{v['bf16_tokens_per_second']:.0f} (MoE: {kind}, {why})",
        f"{v['speedup']:.2f}x",
        f"{v['full_depth_speedup']:.2f}x",
        f"{v['fp4_step_device_us']:.1f} / {v['fp4_step_wall_us']:.1f}",
        v["timing_source"],
      )
    )
    if goal:
      rec.target(
        f"FP4 / fair-bf16 tokens/s at {context}/b{batch} ({depth} layers)",
        f"{v['speedup']:.2f}x",
        f">= {goal}x",
        v["speedup"] >= goal,
      )
  rec.print(
    f"\n{depth} layers of {cfg.name} (+ embedding and float32 LM head); FP4: NVFP4 weights, "
    "activations and KV cache on the Pallas kernels; bf16: bf16 weights and cache, XLA, "
    "attention reading V once, the fair bf16 MoE\n"
  )
  rec.print(
    markdown_table(
      [
        "context/batch",
        "FP4 tok/s",
        "fair bf16 tok/s",
        "FP4 / bf16",
        f"{FULL_DEPTH} layers (est.) FP4 / bf16",
        "FP4 step device / wall us",
        "timing source",
      ],
      rows,
    )
  )


# --- rollout --------------------------------------------------------------------------


def _random_block_values(key, like, std: float):
  """Random float32 values of abstract leaves `like`: matrices normal * std, vectors (norm
  scales) ones, integer leaves zeros."""
  leaves, tree = jax.tree.flatten(like)
  keys = jax.random.split(key, max(len(leaves), 1))
  out = []
  for k, leaf in zip(keys, leaves):
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      out.append(jnp.zeros(leaf.shape, leaf.dtype))
    elif len(leaf.shape) < 2:
      out.append(jnp.ones(leaf.shape, jnp.float32))
    else:
      out.append(jax.random.normal(k, leaf.shape, jnp.float32) * std)
  return tree.unflatten(out)


def _rekeyed(part, index):
  """A block's (path, variable) pairs with the block index in their paths replaced."""
  return [((path[0], index, *path[2:]), variable) for path, variable in part]


def random_rollout_params(cfg, make_block, key):
  """(graphdef, params): a random `cfg` policy's rollout weights made on the device one block
  at a time: random float32 weights of one block, then `make_block` (the arm's weight
  sync: quantize, fuse or lay out), so the whole float32 model is never held. Each block is
  re-keyed to block 0 before `make_block`, so its program compiles once for every block."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0))))
  parts: dict = {}
  for path, variable in nnx.to_flat_state(state):
    parts.setdefault(tuple(path[:2]) if path[0] == "blocks" else (), []).append((path, variable))
  fill = jax.jit(_random_block_values, static_argnums=2)
  make = jax.jit(make_block)
  out = []
  for i, (name, part) in enumerate(parts.items()):
    index = name[1] if name else None
    if index is not None:
      part = _rekeyed(part, 0)
    like = [variable.get_value() for _, variable in part]
    values = fill(jax.random.fold_in(key, i), tuple(like), cfg.init_std) if like else []
    block = make(nnx.from_flat_state([(p, v.replace(x)) for (p, v), x in zip(part, values)]))
    made = list(nnx.to_flat_state(block))
    out.extend(_rekeyed(made, index) if index is not None else made)
    del values
  return graphdef, nnx.from_flat_state(out)


def _arm_state_bytes(cfg, quant, batch: int, context: int) -> int:
  """Bytes a rollout of `cfg` holds on one device in an arm's precision (quant None: bf16):
  its rollout weights, its cache and the planner's working set (the scan's stacked copy
  of the layer weights, a prefill chunk's attention scores, the expert tiles)."""
  from trace_jax import plan  # noqa: PLC0415 (the rollout section's own import)

  model = nnx.eval_shape(lambda: M.Transformer(cfg.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)))
  params = jax.eval_shape(lambda s: quantize_params(s, quant, dtype=jnp.bfloat16), nnx.state(model))
  cache = jax.eval_shape(lambda: init_cache(cfg, batch, context, quant, dtype=jnp.bfloat16))
  config = plan.PlanConfig(mesh=(1, 1, 1), batch=batch, context=context)
  working = plan.rollout_working_bytes(cfg, config, params, plan.abstract_mesh(1, 1, 1))
  size = lambda tree: sum(  # noqa: E731
    int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)
  )
  return size(params) + size(cache) + int(working)


def fitting_layers(preset: str, batch: int, context: int, device_bytes: float, spare=0.15):
  """(layers, why): the most layers of `preset` (at most its own depth) at which both arms'
  rollouts (bf16 and FP4) fit one device of `device_bytes` with `spare` of it left, from
  the planner's bytes (linear in depth: measured at 1 and 2 layers)."""
  full = M.get_preset(preset)
  usable = (1 - spare) * device_bytes
  layers, notes = full.num_layers, []
  for name, quant in (("bf16", None), ("FP4", M.QuantConfig())):
    one, two = (_arm_state_bytes(full.replace(num_layers=n), quant, batch, context) for n in (1, 2))
    per_layer, fixed = two - one, 2 * one - two
    fit = int((usable - fixed) // per_layer) if per_layer > 0 else full.num_layers
    layers = min(layers, max(fit, 1))
    notes.append(f"{name} {fixed / 1e9:.1f} GB + {per_layer / 1e9:.2f} GB per layer")
  why = (
    f"both arms fit {device_bytes / 2**30:.0f} GiB with {spare:.0%} to spare ({'; '.join(notes)};"
    f" {batch} prompts x {context} slots)"
  )
  return layers, why


def _device_bytes() -> tuple[float | None, float | None]:
  """(bytes in use, peak bytes in use) of the first device, None where it does not say."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")


def _rollout_arm(run: Run, name: str, cfg, tokens, mask, key) -> dict:
  """One arm's rollout: weights, compile, one timed generate, bytes."""
  from trace_jax.rl.arms import get_arm  # noqa: PLC0415 (a section's own import)
  from trace_jax.rollout import decode as decode_lib  # noqa: PLC0415
  from trace_jax.rollout.config import RolloutConfig, SamplingConfig  # noqa: PLC0415

  batch, prompt = tokens.shape
  new = run.options["rollout_new_tokens"]
  base = RolloutConfig(
    max_len=prompt + new, sampling=SamplingConfig(max_new_tokens=new), prompt_bucket=1
  )
  config = get_arm(name).rollout(base)
  dtype = jnp.dtype(config.compute_dtype)
  moe_kind = None
  if name == "bf16":
    config = config.replace(kernels="xla")
    moe_kind, _ = fair_moe_kind(run, batch)
  kernels, reason = kernels_lib.resolve_with_reason(config.kernels)

  def make_block(block):
    block = quantize_params(block, config.quant, dtype=dtype)
    if moe_kind is not None:
      return layout_bf16_experts(block, moe_kind)
    if kernels == "pallas" and config.quant is not None:
      return fuse_for_kernels(block)
    return block

  start = time.time()
  graphdef, params = random_rollout_params(cfg, make_block, key)
  jax.block_until_ready(params)
  made = time.time() - start
  weights = tree_bytes(params)
  in_use_before, _ = _device_bytes()
  st = decode_lib.Statics.of(config, cfg, kernels)
  layers = _fair_bf16_layers(moe_kind) if moe_kind else contextlib.nullcontext()
  with layers:
    start = time.time()
    rows = (jnp.arange(tokens.shape[0], dtype=jnp.uint32),)
    rows += (jnp.full((tokens.shape[0],), config.sampling.max_new_tokens, jnp.int32),)
    compiled = decode_lib.generate_program.lower(
      graphdef, params, tokens, mask, key, None, *rows, st
    )
    compiled = compiled.compile()
    compile_s = time.time() - start
  memory = compiled.memory_analysis()
  start = time.time()
  out = jax.block_until_ready(compiled(params, tokens, mask, key, None, *rows))
  seconds = time.time() - start
  generated = int(np.asarray(out.response_mask).sum())
  in_use, peak = _device_bytes()
  result = dict(
    arm=name,
    kernels=kernels + (f" ({reason})" if reason else ""),
    bf16_moe=moe_kind,
    layers=cfg.num_layers,
    prompts=batch,
    prompt_tokens=prompt,
    new_tokens=new,
    generated_tokens=generated,
    weights_bytes=weights,
    weights_seconds=round(made, 2),
    compile_seconds=round(compile_s, 2),
    generate_seconds=round(seconds, 3),
    tokens_per_second=generated / seconds,
    program_argument_bytes=int(memory.argument_size_in_bytes),
    program_output_bytes=int(memory.output_size_in_bytes),
    program_temp_bytes=int(memory.temp_size_in_bytes),
    device_bytes_in_use_before=in_use_before,
    device_bytes_in_use_after=in_use,
    device_peak_bytes=peak,
  )
  del out, params, compiled
  gc.collect()
  return result


def rollout_section(run: Run) -> None:
  rec = run.rec
  batch, prompt = run.options["rollout_prompts"], run.options["rollout_prompt_len"]
  preset = run.shapes["preset"]
  layers, why = run.options["rollout_layers"], "--rollout_layers"
  if not layers:
    if run.smoke:
      layers, why = M.get_preset(preset).num_layers, "the smoke preset's own"
    else:
      limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
      layers, why = fitting_layers(
        preset,
        batch,
        prompt + run.options["rollout_new_tokens"],
        limit or run.shapes["device_bytes"],
      )
  cfg = M.get_preset(preset, num_layers=layers)
  rec.print(f"{layers} layers of {cfg.name}: {why}\n")
  key = jax.random.key(0)
  tokens = jax.random.randint(key, (batch, prompt), 1, cfg.vocab_size, jnp.int32)
  mask = jnp.ones((batch, prompt), bool)
  rows, speed = [], {}
  for name in run.options["rollout_arms"]:
    values = run.measure(
      "rollout_arm",
      f"rollout {name}",
      lambda name=name: _rollout_arm(run, name, cfg, tokens, mask, key),
    )
    if values is None:
      continue
    a = values
    speed[name] = a["tokens_per_second"]
    rows.append(
      (
        "FP4 (trace arm)" if name == "trace" else f"bf16 (fair MoE: {a['bf16_moe']})",
        a["kernels"],
        gigabytes(a["weights_bytes"]),
        f"{a['compile_seconds']:.1f}",
        f"{a['generate_seconds']:.2f}",
        f"{a['tokens_per_second']:.0f}",
        f"{gigabytes(a['program_argument_bytes'])} / {gigabytes(a['program_output_bytes'])} / "
        f"{gigabytes(a['program_temp_bytes'])}",
        f"{gigabytes(a['device_bytes_in_use_after'])} / {gigabytes(a['device_peak_bytes'])}",
      )
    )
  rec.print(
    f"random weights; {batch} prompts of {prompt} tokens, {run.options['rollout_new_tokens']} new tokens each"
    " (tokens/s: generated tokens over the generate's wall time, prefill included; the"
    " device peak is the process's so far)\n"
  )
  rec.print(
    markdown_table(
      [
        "rollout",
        "kernels",
        "weights GB",
        "compile s",
        "generate s",
        "tokens/s",
        "program args / out / temp GB",
        "device in use / peak GB",
      ],
      rows,
    )
  )
  if len(speed) == 2:
    ratio = speed["trace"] / speed["bf16"]
    rec.target(
      f"FP4 / bf16 rollout tokens/s, {cfg.num_layers} layers", f"{ratio:.2f}x", "measured", None
    )
