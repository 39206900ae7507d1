"""One prepared command for an H100 / H200: does the FP4 decode beat a fair bf16 decode in
device time, do the kernels reach the HBM roofline, and does kernels="auto" pick them?

  bash experiments/gpu_window.sh --out=DIR            # the lent window: every section, in
                                                       # its own process and time cap
  python experiments/gpu_check.py --sections=kernels --out=DIR   # one section
  python experiments/gpu_check.py --sections=rollout --rollout_layers=48 --rollout_arms=trace
  python experiments/gpu_check.py --smoke --out=DIR   # tiny shapes on any backend (CPU:
                                                       # interpret mode): checks the script

Off a GPU without --smoke it exits 1 at once: nothing measured is not a success. Sections
run in order of value: `probe`, `kernels`, `decode`, `rollout`. Every measurement runs on
its own: it starts only if its estimated seconds fit what is left of --budget_s, a failure
is recorded with its error and the rest go on, and with --out `results.json` and
`report.md` are rewritten after each one (`gpu_record.py`), so a run cut short keeps what
finished. Sections run as separate processes on one --out read what earlier ones measured.

Every time is device time: the calls run back to back under `jax.profiler` and the device
kernels' durations are read from the trace (`trace_jax.utils.device_time`; no sync per
call). Roofline shares are bytes that must be read / device time, against the copy
bandwidth measured in `probe` (a one-second device copy: bytes read + written / time) and
against the datasheet's --peak_gbps (4.8 TB/s). Profiling turns XLA's command buffers off
(op by op), as on any profile.

  probe    the tie oracle on every path that quantizes (XLA training path and XLA rollout,
           each Pallas kernel): bit-equal to the host, or which field differs; what
           kernels="auto" picks and why; the device's copy bandwidth.
  kernels  each kernel alone at Qwen3-30B-A3B shapes: attention over 32K and 64K cached
           slots, the FP4 GEMM over >= 4 MB of weights at 1 and 16 rows, the FP4 grouped
           MoE (gate|up + down, gate|up fused before timing) at batch 1 / 32 / 128 against
           four bf16 MoEs on the same routing (`kernels.moe_bf16`: the grouped GEMM, a
           gather of the routed experts, `ragged_dot`, a dense all-experts einsum, each laid
           out before timing); the fastest at each batch is the fair bf16 MoE.
  decode   one FP4 decode step on the Pallas kernels against the XLA path (logits' relative
           L2 error and argmax agreement, at 4K/b8); then --layers layers of Qwen3-30B-A3B,
           one decode step per call at 4K/b128, 32K/b1, 32K/b32 (the cache full of random
           entries; the step writes the last slot): FP4 (NVFP4 weights, activations, cache;
           the Pallas kernels; q|k|v and gate|up fused at weight sync) against the fair bf16
           decode (bf16 weights and cache, XLA dots, attention reading V once, the fair bf16
           MoE of that batch laid out at weight sync). The LM head is float32 in both (as
           the rollout runs it). Full depth (48 layers) is estimated as head + 48 * layer.
  rollout  --rollout_layers of Qwen3-30B-A3B (default: the depth at which both arms fit one
           device with 15% to spare, from the planner's bytes) with random weights made on
           the device block by block (each block's program compiled once), in each arm's
           own precision: the FP4 rollout (the trace arm's: NVFP4 weights, activations and
           KV cache, compact guidance at the last half of the layers, kernels as "auto"
           picks) of --rollout_prompts prompts of --rollout_prompt_len random tokens and
           --rollout_new_tokens new tokens each, against the bf16 rollout (bf16 weights and
           cache, nothing captured, XLA, the fair bf16 MoE): compile seconds, the generate's
           wall seconds and tokens/s (prefill included), the compiled program's bytes and
           the device's peak. Each arm frees its weights before the next.
"""

from __future__ import annotations

import functools
import os
import sys
import time


from absl import app, flags, logging
import jax
import jax.numpy as jnp

from gpu_decode import decode_section, rollout_section  # noqa: F401 (sections by name)
from gpu_record import SECTIONS, Recorder, Run, tree_bytes, micros
from trace_jax import fp4
from trace_jax import kernels as kernels_lib
from trace_jax import model as M
from trace_jax.kernels import layout, moe_bf16, probe
from trace_jax.kernels.moe import swiglu_tile
from trace_jax.model.quantizer import quantize_weight_group
from trace_jax.utils import markdown_table
from trace_jax.utils.device_time import device_time

_SECTIONS = flags.DEFINE_list("sections", list(SECTIONS), f"Which of {SECTIONS} to run.")
_PEAK = flags.DEFINE_float("peak_gbps", 4800.0, "Datasheet HBM bandwidth, GB/s.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Layers of Qwen3-30B-A3B in `decode`.")
_CALLS = flags.DEFINE_integer("calls", 8, "Profiled calls per measurement (after 2 warm-up).")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes on any backend: checks the script.")
_OUT = flags.DEFINE_string("out", None, "Write report.md and results.json into this dir.")
_BUDGET = flags.DEFINE_float(
  "budget_s", 540.0, "Seconds for this process: a measurement that would not fit is skipped."
)
_ROLLOUT_LAYERS = flags.DEFINE_integer(
  "rollout_layers", 0, "`rollout`: layers (0: the depth at which both arms fit one device)."
)
_ROLLOUT_PROMPTS = flags.DEFINE_integer("rollout_prompts", 128, "`rollout`: prompts.")
_ROLLOUT_PROMPT_LEN = flags.DEFINE_integer("rollout_prompt_len", 64, "`rollout`: prompt tokens.")
_ROLLOUT_NEW = flags.DEFINE_integer("rollout_new_tokens", 1024, "`rollout`: new tokens each.")
_ROLLOUT_ARMS = flags.DEFINE_list(
  "rollout_arms", ["trace", "bf16"], "`rollout`: trace (the FP4 rollout) and / or bf16, in order."
)

FULL = dict(
  preset="qwen3_30b_a3b",
  cases=((4096, 128), (32768, 1), (32768, 32)),  # (context, batch)
  attention=((1, 32769), (2, 32769), (16, 4097)),  # (batch, cache slots)
  gemms=((2048, 5120, "qkv"), (4096, 2048, "o_proj")),
  gemm_rows=(1, 16),
  moe_batches=(1, 32, 128),
  tie_rows=96,
  parity=(4096, 8),  # (context, batch) of the decode-step parity check
  copy_bytes=2**30,
  device_bytes=139 * 2**30,  # an H200's memory as JAX sees it
)
SMOKE = dict(
  preset="tiny",
  cases=((64, 2),),
  attention=((1, 65),),
  gemms=((64, 96, "qkv"),),
  gemm_rows=(1,),
  moe_batches=(2,),
  tie_rows=1,
  parity=(32, 2),
  copy_bytes=2**20,
  device_bytes=139 * 2**30,
)
# --- probe ----------------------------------------------------------------------------


def probe_section(run: Run) -> None:
  rec = run.rec

  def oracle():
    verdicts = probe.tie_oracle(rows=run.shapes["tie_rows"])
    rows = [(p, "bit-equal" if not bad else f"DIFFERS: {bad}") for p, bad in verdicts.items()]
    rec.print(markdown_table(["path (tie oracle)", "against the host"], rows))
    equal = sum(not bad for bad in verdicts.values())
    rec.target(
      "every path bit-equal on the tie oracle",
      f"{equal}/{len(verdicts)}",
      "all",
      equal == len(verdicts),
    )
    return dict(verdicts={p: bad or "bit-equal" for p, bad in verdicts.items()})

  rec.measure("tie_oracle", oracle)

  def auto():
    implementation, reason = kernels_lib.resolve_with_reason("auto")
    rec.print(f'\nkernels="auto" picks {implementation}' + (f" ({reason})" if reason else ""))
    rec.target('kernels="auto" picks Pallas', implementation, "pallas", implementation == "pallas")
    return dict(picks=implementation, reason=reason)

  rec.measure("kernels_auto", auto)

  def copy():
    values = copy_bandwidth(run.shapes["copy_bytes"])
    rec.print(
      f"\ncopy bandwidth: {values['copy_gbps']:.0f} GB/s ({values['copy_bytes'] / 2**20:.0f}"
      f" MiB read and written, {values['calls']} calls, timing source {values['source']});"
      f" the datasheet's {run.peak / 1e9:.0f} GB/s"
    )
    return values

  rec.measure("copy_bandwidth", copy)


def copy_bandwidth(nbytes: int, seconds: float = 1.0) -> dict:
  """The device's copy bandwidth: an `nbytes` bf16 array negated into a new one (read +
  write, no arithmetic to speak of) back to back for about `seconds` of device time."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  fn = jax.jit(lambda a: -a)
  once = device_time(fn, x, calls=2).busy
  calls = int(min(max(seconds / max(once, 1e-9), 2), 10_000))
  t = device_time(fn, x, calls=calls)
  return dict(copy_gbps=2 * nbytes / t.busy / 1e9, copy_bytes=nbytes, calls=calls, source=t.source)


# --- kernels --------------------------------------------------------------------------


def _random_qarray(key, shape, axis, global_group):
  return fp4.quantize(
    jax.random.normal(key, shape, jnp.float32), axis=axis, global_group=global_group
  )


def kernels_section(run: Run) -> None:
  rec, key, calls = run.rec, jax.random.key(0), run.calls
  cfg = M.get_preset(run.shapes["preset"])
  hkv, dh, heads = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
  rows = []

  def row(kernel, shape, values):
    rows.append((kernel, shape, micros(values["device_us"] / 1e6), values["bytes"], values))

  for b, length in run.shapes["attention"]:

    def attention(b=b, length=length):
      k = _random_qarray(key, (b, length, hkv, dh), -1, "row")
      v = _random_qarray(jax.random.fold_in(key, 1), (b, length, hkv, dh), -1, "row")
      q = jax.random.normal(key, (b, heads, dh), jnp.bfloat16)
      lengths = jnp.full((b,), length, jnp.int32)
      fn = jax.jit(kernels_lib.fp4_decode_attention)
      t = device_time(fn, q, k, v, lengths, calls=calls)
      return run.shares(tree_bytes(q, k, v), t.busy)

    values = run.measure("attention", f"attention B={b} slots={length}", attention)
    if values:
      row("decode_attention", f"B={b}, {length} slots", values)
  _attention_targets(run)

  for kk, n, label in run.shapes["gemms"]:
    w = _random_qarray(key, (kk, n), 0, "tensor")
    for m in run.shapes["gemm_rows"]:

      def gemm(m=m, w=w, kk=kk):
        x = jax.random.normal(key, (m, kk), jnp.bfloat16)
        fn = jax.jit(lambda x, w: kernels_lib.fp4_gemm(x, w, quantize="nvfp4", record="compact"))
        return run.shares(tree_bytes(x, w), device_time(fn, x, w, calls=calls).busy)

      values = run.measure("gemm", f"fp4_gemm {label} rows={m}", gemm)
      if values:
        row(f"fp4_gemm {label}", f"{m} rows, K={kk}, N={n}", values)
  shares = [
    m["of_datasheet"]
    for m in rec.results["measurements"]["kernels"]
    if m["name"].startswith("fp4_gemm") and m["status"] == "ok"
  ]
  if shares:
    rec.target(
      "FP4 GEMM % of datasheet roofline (>= 4 MB of weights, <= 16 rows)",
      f"{min(shares):.0%} (worst)",
      ">= 50%",
      min(shares) >= 0.50,
    )

  _moe_measurements(run, cfg, row)
  rec.print(
    markdown_table(
      ["kernel", "shape", "device us", "MB read", "of copy / datasheet roofline"],
      [(k, s, t, f"{b / 2**20:.1f}", run.share_text(v)) for k, s, t, b, v in rows],
    )
  )
  winners = rec.results["measurements"]["kernels"]
  fair = {m["batch"]: m["kind"] for m in winners if m["name"].startswith("fair bf16 MoE")}
  rec.print(f"\nfair bf16 MoE per batch (the fastest of {moe_bf16.CANDIDATES}): {fair}")
  if run.copy:
    rec.print(f"copy bandwidth measured in probe: {run.copy / 1e9:.0f} GB/s")


def _attention_targets(run: Run) -> None:
  done = {
    (m["name"]): m
    for m in run.rec.results["measurements"]["kernels"]
    if m["name"].startswith("attention") and m["status"] == "ok"
  }
  (b1, l1), *big = run.shapes["attention"]
  first = done.get(f"attention B={b1} slots={l1}")
  for basis in ("of_copy", "of_datasheet"):
    if first and basis in first:
      share = first[basis]
      run.rec.target(
        f"attention % of {basis[3:]} bandwidth at B={b1}, {l1} slots",
        f"{share:.0%}",
        ">= 40%",
        share >= 0.40,
      )
  rest = [
    done[f"attention B={b} slots={n}"] for b, n in big if f"attention B={b} slots={n}" in done
  ]
  if rest:
    worst = min(m["of_datasheet"] for m in rest)
    run.rec.target(
      "attention % of datasheet roofline at >= 64K cached slots",
      f"{worst:.0%} (worst of {big})",
      ">= 60%",
      worst >= 0.60,
    )


def _moe_measurements(run: Run, cfg, row) -> None:
  """The FP4 grouped MoE and the four bf16 MoEs at each batch, weights laid out once."""
  rec, key, calls = run.rec, jax.random.key(0), run.calls
  d, f, e, top = cfg.d_model, cfg.moe_ffn_dim, cfg.num_experts, cfg.num_experts_per_tok
  ws = [
    jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32) * 0.02
    for i, s in enumerate(((e, d, f), (e, d, f), (e, f, d)))
  ]
  # FP4: gate|up quantized with one global scale and fused into the grouped GEMM's SwiGLU
  # tiles here, once, as the rollout's weight sync does (not inside the timed call).
  gate_up = layout.fuse(quantize_weight_group(ws[:2], "nvfp4"), tile=swiglu_tile(f))
  down = fp4.quantize(ws[2], axis=1, global_group=0)
  bf16 = [w.astype(jnp.bfloat16) for w in ws]
  del ws
  prepared = {kind: moe_bf16.prepare(kind, *bf16) for kind in moe_bf16.CANDIDATES}
  fp4_fn = jax.jit(
    lambda x, ex, gu, dn: kernels_lib.moe_experts(
      x, ex, gu, dn, quantize_in="nvfp4", quantize_mid="nvfp4"
    )[0]
  )
  for b in run.shapes["moe_batches"]:
    x = jax.random.normal(key, (b, d), jnp.bfloat16)
    experts = jax.random.randint(jax.random.fold_in(key, b), (b, top), 0, e)
    used = len(set(jax.device_get(experts).reshape(-1).tolist()))

    def fp4_moe(x=x, experts=experts, used=used):
      t = device_time(fp4_fn, x, experts, gate_up, down, calls=calls)
      return run.shares(tree_bytes(x) + tree_bytes(gate_up, down) * used // e, t.busy)

    values = run.measure("moe", f"moe FP4 batch={b}", fp4_moe)
    if values:
      row("moe_experts FP4", f"batch {b} ({used} experts)", values)
      if b == 1:
        share = values["of_datasheet"]
        rec.target(
          "grouped MoE % of datasheet roofline at batch 1", f"{share:.0%}", ">= 50%", share >= 0.50
        )
    times = {}
    for kind in moe_bf16.CANDIDATES:

      def bf16_moe(kind=kind, x=x, experts=experts, used=used):
        fn = jax.jit(functools.partial(moe_bf16.apply, kind))
        t = device_time(fn, x, experts, *prepared[kind], calls=calls)
        return run.shares(tree_bytes(x) + tree_bytes(bf16) * used // e, t.busy)

      values = run.measure("moe", f"moe bf16 {kind} batch={b}", bf16_moe)
      if values:
        times[kind] = values["device_us"]
        row(f"moe bf16 {kind}", f"batch {b}", values)
    if times:
      best = min(times, key=times.get)
      rec.measure(f"fair bf16 MoE batch={b}", lambda: dict(batch=b, kind=best, device_us=times))


# --- main -----------------------------------------------------------------------------


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  started = time.time()
  backend = jax.default_backend()
  bad = [s for s in _SECTIONS.value if s not in SECTIONS]
  if bad:
    raise app.UsageError(f"--sections={bad} is not allowed; use some of {SECTIONS}")
  bad = [name for name in _ROLLOUT_ARMS.value if name not in ("trace", "bf16")]
  if bad:
    raise app.UsageError(f"--rollout_arms={bad} is not allowed; use trace and / or bf16")
  if _ROLLOUT_LAYERS.value < 0:
    raise app.UsageError(f"--rollout_layers={_ROLLOUT_LAYERS.value} must be >= 0")
  if backend != "gpu" and not _SMOKE.value:
    print(
      f"gpu_check needs a GPU; the backend here is {backend!r}, so nothing ran (exit 1). "
      "(tests/kernels/test_cuda_lowering.py checks the kernels' CUDA lowering anywhere; "
      "--smoke runs this script on tiny shapes.)"
    )
    sys.exit(1)
  if _OUT.value is not None:
    os.makedirs(_OUT.value, exist_ok=True)  # refused here, before any device work
  device = jax.devices()[0]
  header = dict(
    device=device.device_kind,
    device_count=jax.device_count(),
    jax=jax.__version__,
    smoke=_SMOKE.value,
    datasheet_gbps=_PEAK.value,
  )
  print(
    f"# gpu_check on {device.device_kind} ({jax.device_count()} device(s)), jax "
    f"{jax.__version__}, datasheet {_PEAK.value:.0f} GB/s, XLA_FLAGS="
    f"{os.environ.get('XLA_FLAGS', '')!r}{' (smoke shapes)' if _SMOKE.value else ''}",
    flush=True,
  )
  failed = []
  for section in [s for s in SECTIONS if s in _SECTIONS.value]:
    print(f"\n## {section}\n", flush=True)
    rec = Recorder(_OUT.value, section, deadline=started + _BUDGET.value, header=header)
    run = Run(
      shapes=SMOKE if _SMOKE.value else FULL,
      peak=_PEAK.value * 1e9,
      rec=rec,
      calls=_CALLS.value,
      smoke=_SMOKE.value,
      options=dict(
        layers=_LAYERS.value,
        rollout_layers=_ROLLOUT_LAYERS.value,
        rollout_prompts=_ROLLOUT_PROMPTS.value,
        rollout_prompt_len=_ROLLOUT_PROMPT_LEN.value,
        rollout_new_tokens=_ROLLOUT_NEW.value,
        rollout_arms=_ROLLOUT_ARMS.value,
      ),
    )
    try:
      globals()[f"{section}_section"](run)
      bad = [m for m in rec.results["measurements"][section] if m["status"].startswith("failed")]
      status = f"failed: {len(bad)} measurement(s)" if bad else "ok"
    except Exception as error:  # noqa: BLE001 (a section's own fault, outside a measurement)
      status = f"failed: {type(error).__name__}: {str(error)[:300]}"
      rec.print(f"{section} failed: {type(error).__name__}: {error}")
    if status != "ok":
      failed.append(section)
    rec.finish(status)
    print(f"\n({section}: {status}, {time.time() - rec.started:.0f} s)", flush=True)
  print(f"\n(total: {time.time() - started:.0f} s)")
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
