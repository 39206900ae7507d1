"""One prepared command for an H100 / H200: does the FP4 decode beat a fair bf16 decode in
device time, do the kernels reach the HBM roofline, and does kernels="auto" pick them?

  python experiments/gpu_check.py --out=DIR          # every section, within --budget_s
  python experiments/gpu_check.py --sections=rollout  # the full-depth rollout alone
  python experiments/gpu_check.py --sections=probe,kernels
  python experiments/gpu_check.py --peak_gbps=3350   # an H100 SXM's roofline
  python experiments/gpu_check.py --smoke            # tiny shapes on any backend (CPU:
                                                     # interpret mode): checks the script only

Without a GPU (and without --smoke) it says so and exits 0. Each section prints its own
table; a section that fails prints its error and the others still run. The last table lists
the targets, each with its measured value and PASS / FAIL. Sections run in the order
`rollout`, `probe`, `kernels`, `decode`; one that would start with less than a minute of
--budget_s left is skipped (and listed), so the run ends inside the budget. With --out, the
printed report (`report.md`) and what each section measured (`results.json`: its table,
seconds and status, and the targets) are written there after every section, so a run cut
short keeps what finished.

Every time is device time: the calls run back to back under `jax.profiler` and the device
kernels' durations are read from the trace (`trace_jax.utils.device_time`; no sync per
call). Roofline shares are bytes that must be read / device time / --peak_gbps (4.8 TB/s).
Note that profiling turns XLA's command buffers off (op by op), as on any profile.

  probe    the tie oracle on every path that quantizes (XLA training path and XLA rollout,
           each Pallas kernel): bit-equal to the host, or which field differs; what
           kernels="auto" picks and why.
  kernels  each kernel alone at Qwen3-30B-A3B shapes: attention over 32K and 64K cached
           slots, the FP4 GEMM over >= 4 MB of weights at 1 and 16 rows, the grouped MoE
           (gate|up + down) at batch 1 / 32 / 128 against the fair bf16 MoE (the same
           expert-major grouped GEMM on bf16 weights, and a gather of the routed experts'
           weights; the faster of the two is the decode's bf16 MoE).
  rollout  the full Qwen3-30B-A3B geometry (48 layers) with random weights made on the
           device block by block, in each arm's own precision (no float32 master copy):
           the FP4 rollout (the trace arm's: NVFP4 weights, activations and KV cache,
           compact guidance captured at the last half of the layers, kernels as "auto"
           picks) of --rollout_prompts prompts of --rollout_prompt_len random tokens and
           --rollout_new_tokens new tokens each, against the bf16 rollout (bf16 weights and
           cache, nothing captured, XLA) of the same prompts: compile seconds, the generate's
           wall seconds and tokens/s (new tokens of every prompt over the wall time, prefill
           included), the compiled program's bytes (arguments, outputs, temporaries), the
           device's bytes in use and its peak. Each arm frees its weights before the next.
  decode   first, one FP4 decode step on the Pallas kernels against the XLA path (logits'
           relative L2 error and argmax agreement, at 4K/b8: a correctness check at the
           real geometry); then --layers layers of Qwen3-30B-A3B, one decode step per call
           at 4K/b128, 32K/b1, 32K/b32 (the cache full of random entries; the step writes the last slot):
           FP4 (NVFP4 weights, activations, cache; the Pallas kernels; fused q|k|v and
           gate|up) against the fair bf16 decode (bf16 weights and cache, XLA dots and
           attention, the fair bf16 MoE). The LM head is float32 in both (as the rollout
           runs it). Full depth (48 layers) is estimated as head + 48 * per-layer time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import json
import os
import sys
import time
import traceback

import numpy as np

from absl import app, flags, logging
import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import fp4
from trace_jax import kernels as kernels_lib
from trace_jax import model as M
from trace_jax.kernels import moe as moe_lib, probe
from trace_jax.model import moe as moe_module
from trace_jax.model.cache import init_cache
from trace_jax.model.quantizer import quantize_weight_group
from trace_jax.rollout.params import (
  fuse_for_kernels,
  fuse_for_kernels_jit,
  quantize_params,
  quantize_params_jit,
)
from trace_jax.utils import markdown_table
from trace_jax.utils.io import write_atomic
from trace_jax.utils.device_time import device_time, device_time_carried

SECTIONS = ("rollout", "probe", "kernels", "decode")
_SECTIONS = flags.DEFINE_list("sections", list(SECTIONS), f"Which of {SECTIONS} to run.")
_PEAK = flags.DEFINE_float("peak_gbps", 4800.0, "HBM bandwidth of the roofline, GB/s.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Layers of Qwen3-30B-A3B in `decode`.")
_CALLS = flags.DEFINE_integer("calls", 8, "Profiled calls per measurement (after 2 warm-up).")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes on any backend: checks the script.")
_OUT = flags.DEFINE_string("out", None, "Also write report.md and results.json into this dir.")
_BUDGET = flags.DEFINE_float(
  "budget_s", 540.0, "Seconds for the whole run: a section starting with < 60 s left is skipped."
)
_ROLLOUT_PROMPTS = flags.DEFINE_integer("rollout_prompts", 128, "`rollout`: prompts.")
_ROLLOUT_PROMPT_LEN = flags.DEFINE_integer("rollout_prompt_len", 64, "`rollout`: prompt tokens.")
_ROLLOUT_NEW = flags.DEFINE_integer("rollout_new_tokens", 1024, "`rollout`: new tokens each.")
_ROLLOUT_ARMS = flags.DEFINE_list(
  "rollout_arms", ["trace", "bf16"], "`rollout`: trace (the FP4 rollout) and / or bf16, in order."
)

FULL_DEPTH = 48  # Qwen3-30B-A3B's layers
FULL = dict(
  preset="qwen3_30b_a3b",
  cases=((4096, 128), (32768, 1), (32768, 32)),  # (context, batch)
  attention=((1, 32769), (2, 32769), (16, 4097)),  # (batch, cache slots)
  gemms=((2048, 5120, "qkv"), (4096, 2048, "o_proj")),
  gemm_rows=(1, 16),
  moe_batches=(1, 32, 128),
  tie_rows=96,
  parity=(4096, 8),  # (context, batch) of the decode-step parity check
  rollout_layers=FULL_DEPTH,
)
SMOKE = dict(
  preset="tiny",
  cases=((64, 4), (128, 1), (128, 2)),
  attention=((1, 129), (2, 129), (4, 33)),
  gemms=((64, 96, "qkv"), (128, 64, "o_proj")),
  gemm_rows=(1, 16),
  moe_batches=(1, 4),
  tie_rows=2,
  parity=(64, 2),
  rollout_layers=0,  # the preset's own
)
# Issue 29's targets: FP4 / fair-bf16 tokens/s per decode case.
SPEEDUP_TARGETS = {0: 1.5, 1: 1.2, 2: 2.0}


@dataclasses.dataclass
class Run:
  """What the sections measured, for the final table."""

  shapes: dict
  peak: float  # bytes / s
  targets: list = dataclasses.field(default_factory=list)  # (target, measured, goal, ok)
  fair_moe: dict = dataclasses.field(default_factory=dict)  # batch -> "grouped" | "gather"
  deadline: float = float("inf")  # time.time() by which the run must end
  results: dict = dataclasses.field(default_factory=dict)  # section -> what it measured

  def target(self, name: str, measured: str, goal: str, ok: bool | None) -> None:
    self.targets.append((name, measured, goal, "-" if ok is None else ("PASS" if ok else "FAIL")))


def _nbytes(*trees) -> int:
  return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(trees)))


def _us(seconds: float) -> str:
  return f"{seconds * 1e6:.1f}"


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


def _random_rollout_params(cfg, rollout_config, kernels: str, key):
  """(graphdef, params): a random `cfg` policy's rollout weights made on the device one block
  at a time (random float32 weights of one block, then `quantize_params` and, for the Pallas
  kernels, `fuse_for_kernels` of that block), so the whole float32 model is never held."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0))))
  parts: dict = {}
  for path, variable in nnx.to_flat_state(state):
    parts.setdefault(tuple(path[:2]) if path[0] == "blocks" else (), []).append((path, variable))
  fill = jax.jit(_random_block_values, static_argnums=2)
  dtype = jnp.dtype(rollout_config.compute_dtype)
  fp4_weights = rollout_config.quant is not None
  out = []
  for i, part in enumerate(parts.values()):
    like = [variable.get_value() for _, variable in part]
    values = fill(jax.random.fold_in(key, i), tuple(like), cfg.init_std) if like else []
    block = nnx.from_flat_state([(p, v.replace(x)) for (p, v), x in zip(part, values)])
    block = quantize_params_jit(block, rollout_config.quant, dtype=dtype)
    if kernels == "pallas" and fp4_weights:
      block = fuse_for_kernels_jit(block)
    out.extend(nnx.to_flat_state(block))
    del values
  return graphdef, nnx.from_flat_state(out)


def _device_bytes() -> tuple[float | None, float | None]:
  """(bytes in use, peak bytes in use) of the first device, None where it does not say."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")


def _gb(value) -> str:
  return "-" if value is None else f"{value / 1e9:.2f}"


def _rollout_arm(name: str, cfg, tokens, mask, key) -> dict:
  """One arm's full-depth rollout: weights, compile, one timed generate, bytes."""
  from trace_jax.rl.arms import get_arm  # noqa: PLC0415 (a section's own import)
  from trace_jax.rollout import decode as decode_lib  # noqa: PLC0415
  from trace_jax.rollout.config import RolloutConfig, SamplingConfig  # noqa: PLC0415

  batch, prompt = tokens.shape
  new = _ROLLOUT_NEW.value
  base = RolloutConfig(
    max_len=prompt + new, sampling=SamplingConfig(max_new_tokens=new), prompt_bucket=1
  )
  config = get_arm(name).rollout(base)
  if name == "bf16":
    config = config.replace(kernels="xla")
  kernels, reason = kernels_lib.resolve_with_reason(config.kernels)
  start = time.time()
  graphdef, params = _random_rollout_params(cfg, config, kernels, key)
  jax.block_until_ready(params)
  made = time.time() - start
  weights = _nbytes(params)
  in_use_before, _ = _device_bytes()
  st = decode_lib.Statics.of(config, cfg, kernels)
  start = time.time()
  compiled = decode_lib.generate_program.lower(graphdef, params, tokens, mask, key, None, st)
  compiled = compiled.compile()
  compile_s = time.time() - start
  memory = compiled.memory_analysis()
  start = time.time()
  out = jax.block_until_ready(compiled(params, tokens, mask, key, None))
  seconds = time.time() - start
  generated = int(np.asarray(out.response_mask).sum())
  in_use, peak = _device_bytes()
  result = dict(
    arm=name,
    kernels=kernels + (f" ({reason})" if reason else ""),
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
  layers = run.shapes["rollout_layers"]
  cfg = M.get_preset(run.shapes["preset"], **({"num_layers": layers} if layers else {}))
  key = jax.random.key(0)
  batch, prompt = _ROLLOUT_PROMPTS.value, _ROLLOUT_PROMPT_LEN.value
  tokens = jax.random.randint(key, (batch, prompt), 1, cfg.vocab_size, jnp.int32)
  mask = jnp.ones((batch, prompt), bool)
  arms, rows = [], []
  for name in _ROLLOUT_ARMS.value:
    if arms and time.time() + arms[-1]["compile_seconds"] + 2 * arms[-1]["generate_seconds"] > (
      run.deadline
    ):
      print(f"{name}: skipped, too little of --budget_s left after the {arms[-1]['arm']} arm")
      continue
    arms.append(_rollout_arm(name, cfg, tokens, mask, key))
    run.results["rollout"] = {"model": cfg.name, "layers": cfg.num_layers, "arms": arms}
    a = arms[-1]
    rows.append(
      (
        "FP4 (trace arm)" if name == "trace" else "bf16",
        a["kernels"],
        _gb(a["weights_bytes"]),
        f"{a['compile_seconds']:.1f}",
        f"{a['generate_seconds']:.2f}",
        f"{a['tokens_per_second']:.0f}",
        f"{_gb(a['program_argument_bytes'])} / {_gb(a['program_output_bytes'])} / "
        f"{_gb(a['program_temp_bytes'])}",
        f"{_gb(a['device_bytes_in_use_after'])} / {_gb(a['device_peak_bytes'])}",
      )
    )
  print(
    f"{cfg.num_layers} layers of {cfg.name}, random weights; {batch} prompts of {prompt} tokens,"
    f" {_ROLLOUT_NEW.value} new tokens each (tokens/s: generated tokens over the generate's wall"
    " time, prefill included; the device peak is the process's so far)\n"
  )
  print(
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
  speed = {a["arm"]: a["tokens_per_second"] for a in arms}
  if len(speed) == 2:
    ratio = speed["trace"] / speed["bf16"]
    run.target(
      f"FP4 / bf16 rollout tokens/s, {cfg.num_layers} layers", f"{ratio:.2f}x", "measured", None
    )


# --- probe ----------------------------------------------------------------------------


def probe_section(run: Run) -> None:
  verdicts = probe.tie_oracle(rows=run.shapes["tie_rows"])
  rows = [(path, "bit-equal" if not bad else f"DIFFERS: {bad}") for path, bad in verdicts.items()]
  print(markdown_table(["path (tie oracle)", "against the host"], rows))
  equal = sum(not bad for bad in verdicts.values())
  run.target(
    "every path bit-equal on the tie oracle",
    f"{equal}/{len(verdicts)}",
    "all",
    equal == len(verdicts),
  )
  implementation, reason = kernels_lib.resolve_with_reason("auto")
  print(f'\nkernels="auto" picks {implementation}' + (f" ({reason})" if reason else ""))
  run.target('kernels="auto" picks Pallas', implementation, "pallas", implementation == "pallas")


# --- kernels --------------------------------------------------------------------------


def _random_qarray(key, shape, axis, global_group):
  return fp4.quantize(
    jax.random.normal(key, shape, jnp.float32), axis=axis, global_group=global_group
  )


def _share(nbytes: int, seconds: float, run: Run) -> float:
  return nbytes / seconds / run.peak


def kernels_section(run: Run) -> None:
  key = jax.random.key(0)
  rows = []
  cfg = M.get_preset(run.shapes["preset"])
  hkv, dh, heads = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
  shares = {}
  for b, length in run.shapes["attention"]:
    k = _random_qarray(key, (b, length, hkv, dh), -1, "row")
    v = _random_qarray(jax.random.fold_in(key, 1), (b, length, hkv, dh), -1, "row")
    q = jax.random.normal(key, (b, heads, dh), jnp.bfloat16)
    lengths = jnp.full((b,), length, jnp.int32)
    t = device_time(jax.jit(kernels_lib.fp4_decode_attention), q, k, v, lengths, calls=_CALLS.value)
    nbytes = _nbytes(q, k, v)
    shares[(b, length)] = _share(nbytes, t.busy, run)
    rows.append(
      ("decode_attention", f"B={b}, {length} slots", _us(t.busy), nbytes, shares[(b, length)])
    )
  (b1, l1), *big = run.shapes["attention"]
  run.target(
    f"attention % of roofline at B={b1}, {l1} slots",
    f"{shares[(b1, l1)]:.0%}",
    ">= 40%",
    shares[(b1, l1)] >= 0.40,
  )
  worst = min(shares[shape] for shape in big)
  run.target(
    "attention % of roofline at >= 64K cached slots",
    f"{worst:.0%} (worst of {big})",
    ">= 60%",
    worst >= 0.60,
  )

  gemm_shares = []
  for kk, n, label in run.shapes["gemms"]:
    w = _random_qarray(key, (kk, n), 0, "tensor")
    for m in run.shapes["gemm_rows"]:
      x = jax.random.normal(key, (m, kk), jnp.bfloat16)
      fn = jax.jit(lambda x, w: kernels_lib.fp4_gemm(x, w, quantize="nvfp4", record="compact"))
      t = device_time(fn, x, w, calls=_CALLS.value)
      nbytes = _nbytes(x, w)
      gemm_shares.append(_share(nbytes, t.busy, run))
      rows.append(
        (f"fp4_gemm {label}", f"{m} rows, K={kk}, N={n}", _us(t.busy), nbytes, gemm_shares[-1])
      )
  run.target(
    "FP4 GEMM % of roofline (>= 4 MB of weights, <= 16 rows)",
    f"{min(gemm_shares):.0%} (worst)",
    ">= 50%",
    min(gemm_shares) >= 0.50,
  )

  d, f, e, top = cfg.d_model, cfg.moe_ffn_dim, cfg.num_experts, cfg.num_experts_per_tok
  ws = [
    jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32) * 0.02
    for i, s in enumerate(((e, d, f), (e, d, f), (e, f, d)))
  ]
  gate_up = quantize_weight_group(ws[:2], "nvfp4")
  down = fp4.quantize(ws[2], axis=1, global_group=0)
  bf16 = [w.astype(jnp.bfloat16) for w in ws]
  del ws
  for b in run.shapes["moe_batches"]:
    x = jax.random.normal(key, (b, d), jnp.bfloat16)
    experts = jax.random.randint(jax.random.fold_in(key, b), (b, top), 0, e)
    used = len(set(jax.device_get(experts).reshape(-1).tolist()))
    fp4_fn = jax.jit(
      lambda x, ex, gu, dn: kernels_lib.moe_experts(
        x, ex, gu, dn, quantize_in="nvfp4", quantize_mid="nvfp4"
      )[0]
    )
    t = device_time(fp4_fn, x, experts, gate_up, down, calls=_CALLS.value)
    nbytes = _nbytes(x) + _nbytes(gate_up, down) * used // e
    share = _share(nbytes, t.busy, run)
    rows.append(("moe_experts FP4", f"batch {b} ({used} experts)", _us(t.busy), nbytes, share))
    if b == 1:
      run.target("grouped MoE % of roofline at batch 1", f"{share:.0%}", ">= 50%", share >= 0.50)
    bf16_bytes = _nbytes(x) + _nbytes(bf16) * used // e
    times = {}
    for kind in ("grouped", "gather"):
      fn = jax.jit(functools.partial(_fair_bf16_moe, kind))
      times[kind] = device_time(fn, x, experts, *bf16, calls=_CALLS.value).busy
      rows.append(
        (
          f"moe bf16 {kind}",
          f"batch {b}",
          _us(times[kind]),
          bf16_bytes,
          _share(bf16_bytes, times[kind], run),
        )
      )
    run.fair_moe[b] = min(times, key=times.get)
  print(
    markdown_table(
      ["kernel", "shape", "device us", "MB read", f"of roofline ({run.peak / 1e9:.0f} GB/s)"],
      [(k, s, t, f"{b / 2**20:.1f}", f"{share:.0%}") for k, s, t, b, share in rows],
    )
  )
  print(f"\nfair bf16 MoE per batch (the faster): {run.fair_moe}")


def _fair_bf16_moe(kind, x, experts, w_gate, w_up, w_down):
  """The routed experts on bf16 weights, reading only the routed experts: the expert-major
  grouped GEMM (as the FP4 path), or a gather of each routed row's expert weights."""
  if kind == "grouped":
    return moe_lib.moe_experts_bf16(x, experts, w_gate, w_up, w_down)
  gate = jnp.einsum("nd,nkdf->nkf", x, w_gate[experts], preferred_element_type=jnp.float32)
  up = jnp.einsum("nd,nkdf->nkf", x, w_up[experts], preferred_element_type=jnp.float32)
  h = (jax.nn.silu(gate.astype(x.dtype)) * up.astype(x.dtype)).astype(x.dtype)
  y = jnp.einsum("nkf,nkfd->nkd", h, w_down[experts], preferred_element_type=jnp.float32)
  return y.astype(x.dtype)


@contextlib.contextmanager
def _fair_bf16_layers(kind: str):
  """The model's bf16 MoE layers use `_fair_bf16_moe` instead of `jax.lax.ragged_dot`
  (which XLA:GPU expands into a dense masked dot over every expert)."""
  original = moe_module.MoE._grouped

  def grouped(self, xq, experts, *, layer, sq, tokens_shape):
    del layer, sq, tokens_shape
    return _fair_bf16_moe(kind, xq, experts, *self._weights())

  moe_module.MoE._grouped = grouped
  try:
    yield
  finally:
    moe_module.MoE._grouped = original


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


def _decode_time(graphdef, params, cfg, batch, context, quant, kernels, key):
  """Device seconds of one decode step (every step writes the same last slot)."""
  cache = _random_cache(cfg, batch, context + 1, quant, key)
  tokens = jax.random.randint(key, (batch, 1), 0, cfg.vocab_size)
  options = M.CallOptions(compute_dtype="bfloat16", kernels=kernels)

  @functools.partial(jax.jit, donate_argnums=0)  # the cache is updated in place
  def step(cache, params, tokens):
    out = nnx.merge(graphdef, params)(tokens, cache=cache, quant=quant, options=options)
    return dataclasses.replace(out.cache, index=cache.index)

  return device_time_carried(lambda c: step(c, params, tokens), cache, calls=_CALLS.value)


def _step_logits(graphdef, params, cache, tokens, quant, kernels):
  options = M.CallOptions(compute_dtype="bfloat16", kernels=kernels)
  step = jax.jit(
    lambda p, c, t: nnx.merge(graphdef, p)(t, cache=c, quant=quant, options=options).logits
  )
  return np.asarray(step(params, cache, tokens), np.float32)


def _decode_parity(run: Run, graphdef, fp4_params, xla_params, cfg, quant, key) -> None:
  """One FP4 decode step on the Pallas kernels (fused weights) against the same step on
  the XLA path (per-matrix weights), same parameters and cache (an odd number of slots):
  both quantize identically, so only summation order and bf16 roundings differ."""
  context, batch = run.shapes["parity"]
  cache = _random_cache(cfg, batch, context + 1, quant, key)
  tokens = jax.random.randint(key, (batch, 1), 0, cfg.vocab_size)
  got = _step_logits(graphdef, fp4_params, cache, tokens, quant, "pallas")
  want = _step_logits(graphdef, xla_params, cache, tokens, quant, "xla")
  error = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
  agree = float(np.mean(np.argmax(got, -1) == np.argmax(want, -1)))
  finite = bool(np.isfinite(got).all())
  print(
    markdown_table(
      ["decode step parity", "relative L2 error of logits", "argmax agreement", "finite"],
      [(f"{context}/b{batch}: pallas vs xla", f"{error:.2e}", f"{agree:.0%}", finite)],
    )
  )
  print()
  run.target(
    f"FP4 decode step, Pallas vs XLA logits at {context}/b{batch}",
    f"rel. L2 {error:.2e}, argmax {agree:.0%}",
    "<= 5e-2, finite",
    finite and error <= 5e-2,
  )


def decode_section(run: Run) -> None:
  cfg = M.get_preset(run.shapes["preset"], num_layers=_LAYERS.value)
  key = jax.random.key(0)
  policy = M.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(policy)
  quant = M.QuantConfig()
  fp4_params = jax.jit(lambda s: fuse_for_kernels(quantize_params(s, quant, dtype=jnp.bfloat16)))(
    state
  )
  bf16_params = jax.jit(lambda s: quantize_params(s, None, dtype=jnp.bfloat16))(state)
  try:
    xla_params = jax.jit(lambda s: quantize_params(s, quant, dtype=jnp.bfloat16))(state)
    _decode_parity(run, graphdef, fp4_params, xla_params, cfg, quant, key)
    del xla_params
  except Exception as error:  # noqa: BLE001 (report it, keep measuring)
    print(f"decode step parity failed to run: {type(error).__name__}: {str(error)[:300]}\n")
    run.target("FP4 decode step, Pallas vs XLA logits", "failed to run", "<= 5e-2", False)
  head = state["lm_head"].get_value() if "lm_head" in state else state["embed"].get_value().T
  del policy, state
  rows, depth = [], cfg.num_layers
  for index, (context, batch) in enumerate(run.shapes["cases"]):
    try:
      h = jax.random.normal(key, (batch, 1, cfg.d_model), jnp.float32)
      head_fn = jax.jit(lambda h, w: jnp.einsum("btd,dv->btv", h, w, precision="highest"))
      head_time = device_time(head_fn, h, head, calls=_CALLS.value).busy
      fp4_t = _decode_time(graphdef, fp4_params, cfg, batch, context, quant, "pallas", key)
      kind = run.fair_moe.get(batch, "grouped")
      with _fair_bf16_layers(kind):
        bf16_t = _decode_time(graphdef, bf16_params, cfg, batch, context, None, "xla", key)
    except Exception as error:  # noqa: BLE001 (report the case, keep measuring)
      rows.append(
        (
          f"{context}/b{batch}",
          f"failed: {type(error).__name__}: {str(error)[:200]}",
          "",
          "",
          "",
          "",
          "",
        )
      )
      run.target(
        f"FP4 / fair-bf16 tokens/s at {context}/b{batch}",
        "failed",
        f">= {SPEEDUP_TARGETS[index]}x",
        False,
      )
      continue
    full = {}
    for arm, t in (("fp4", fp4_t), ("bf16", bf16_t)):
      per_layer = max(t.busy - head_time, 0.0) / depth
      full[arm] = batch / (head_time + FULL_DEPTH * per_layer)
    ratio = bf16_t.busy / fp4_t.busy
    rows.append(
      (
        f"{context}/b{batch}",
        f"{batch / fp4_t.busy:.0f}",
        f"{batch / bf16_t.busy:.0f} (MoE: {kind})",
        f"{ratio:.2f}x",
        f"{full['fp4']:.0f} / {full['bf16']:.0f} = {full['fp4'] / full['bf16']:.2f}x",
        f"{_us(fp4_t.busy)} / {_us(fp4_t.wall)}",
        fp4_t.source,
      )
    )
    goal = SPEEDUP_TARGETS[index]
    run.target(
      f"FP4 / fair-bf16 tokens/s at {context}/b{batch} ({depth} layers)",
      f"{ratio:.2f}x",
      f">= {goal}x",
      ratio >= goal,
    )
    top = sorted(fp4_t.kernels.items(), key=lambda kv: -kv[1])[:8]
    print(
      f"{context}/b{batch} FP4 step, top kernels (device us): "
      + ", ".join(f"{n} {_us(t)}" for n, t in top)
    )
  print(
    f"\n{depth} layers of {cfg.name} (+ embedding and float32 LM head); FP4: NVFP4 weights, "
    f"activations and KV cache on the Pallas kernels; bf16: bf16 weights and cache, XLA, "
    f"the fair bf16 MoE\n"
  )
  print(
    markdown_table(
      [
        "context/batch",
        "FP4 tok/s",
        "fair bf16 tok/s",
        "FP4 / bf16",
        f"{FULL_DEPTH} layers (est.) FP4 / bf16 tok/s",
        "FP4 step device / wall us",
        "timing source",
      ],
      rows,
    )
  )


# --- main -----------------------------------------------------------------------------


class _Tee(io.TextIOBase):
  """stdout that also keeps what was printed (the report --out writes)."""

  def __init__(self, stream):
    self.stream, self.kept = stream, io.StringIO()

  def write(self, text):
    self.kept.write(text)
    return self.stream.write(text)

  def flush(self):
    self.stream.flush()


def _write_out(out: str | None, run: Run, sections: dict, report: str) -> None:
  """report.md and results.json under `out` (each replaced whole, never half-written)."""
  if out is None:
    return
  os.makedirs(out, exist_ok=True)
  write_atomic(os.path.join(out, "report.md"), report)
  results = dict(
    device=jax.devices()[0].device_kind,
    jax=jax.__version__,
    smoke=_SMOKE.value,
    sections=sections,
    measured=run.results,
    targets=[dict(zip(("target", "measured", "goal", "verdict"), t)) for t in run.targets],
  )
  write_atomic(os.path.join(out, "results.json"), json.dumps(results, indent=1, default=str))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  started = time.time()
  backend = jax.default_backend()
  if backend != "gpu" and not _SMOKE.value:
    print(
      f"gpu_check needs a GPU; the backend here is {backend!r}, so nothing ran. "
      "(tests/kernels/test_cuda_lowering.py checks the kernels' CUDA lowering anywhere; "
      "--smoke runs this script on tiny shapes.)"
    )
    return
  bad = [s for s in _SECTIONS.value if s not in SECTIONS]
  if bad:
    raise ValueError(f"--sections={bad} is not allowed; use some of {SECTIONS}")
  bad = [name for name in _ROLLOUT_ARMS.value if name not in ("trace", "bf16")]
  if bad:
    raise ValueError(f"--rollout_arms={bad} is not allowed; use trace and / or bf16")
  if _OUT.value is not None:
    os.makedirs(_OUT.value, exist_ok=True)  # refused here, before any device work
  run = Run(
    shapes=SMOKE if _SMOKE.value else FULL,
    peak=_PEAK.value * 1e9,
    deadline=started + _BUDGET.value,
  )
  tee = _Tee(sys.stdout)
  sections: dict = {}
  with contextlib.redirect_stdout(tee):
    device = jax.devices()[0]
    print(
      f"# gpu_check on {device.device_kind} ({jax.device_count()} device(s)), jax "
      f"{jax.__version__}, roofline {_PEAK.value:.0f} GB/s, XLA_FLAGS="
      f"{os.environ.get('XLA_FLAGS', '')!r}{' (smoke shapes)' if _SMOKE.value else ''}\n"
    )
    order = [s for s in SECTIONS if s in _SECTIONS.value]  # kernels picks decode's bf16 MoE
    for section in order:
      print(f"\n## {section}\n")
      left = run.deadline - time.time()
      if left < 60:
        print(f"skipped: {left:.0f} s of --budget_s={_BUDGET.value:.0f} left")
        sections[section] = dict(status="skipped", seconds=0.0)
        _write_out(_OUT.value, run, sections, tee.kept.getvalue())
        continue
      start = time.time()
      status = "ok"
      try:
        globals()[f"{section}_section"](run)
      except Exception as error:  # noqa: BLE001 (one section's failure must not hide the rest)
        status = f"failed: {type(error).__name__}: {str(error)[:300]}"
        print(f"{section} failed: {type(error).__name__}: {error}")
        traceback.print_exc(limit=4, file=sys.stdout)
      print(f"\n({section}: {time.time() - start:.0f} s)")
      sections[section] = dict(status=status, seconds=round(time.time() - start, 1))
      _write_out(_OUT.value, run, sections, tee.kept.getvalue())
    print("\n## targets\n")
    print(markdown_table(["target", "measured", "goal", "verdict"], run.targets))
    skipped = [s for s, r in sections.items() if r["status"] == "skipped"]
    failed = [s for s, r in sections.items() if r["status"].startswith("failed")]
    if skipped:
      print(f"\nsections skipped for time: {skipped}")
    if failed:
      print(f"\nsections that failed to run: {failed}")
    print(f"\n(total: {time.time() - started:.0f} s)")
  _write_out(_OUT.value, run, sections, tee.kept.getvalue())
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
