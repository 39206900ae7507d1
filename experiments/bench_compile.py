"""Compile time against depth, with ModelConfig.scan_layers off and on.

  python experiments/bench_compile.py                         # small widths, 2 / 8 / 32 layers
  python experiments/bench_compile.py --layers=2,16 --programs=qat_grad

Per depth L (`M.small(num_layers=L)`) and scan setting, the seconds from tracing to a
compiled executable (`jax.jit(...).trace(...).lower().compile()`, from abstract shapes: no
weights are made) of:

  prefill    the rollout's model call on a prompt chunk [B, P] over an FP4 KV cache (the
             trace arm's rollout: FP4 weights, activations and cache, compact capture);
  decode     the same call on one token [B, 1]: the decode loop's body;
  qat_grad   the FP4 QAT training forward and its gradient (fp4-qat's loss, no optimizer);
  trace      the learner's update as the trainer runs it for the trace arm (guided QAT,
             routing replay, recording, Adam: `run.memory_check.update_program`).

Then the ratio of the deepest to the shallowest depth per program and setting: a stack
compiled once per layer grows with depth, a scanned one stays near flat. Each program is
compiled in a fresh process (XLA's caches would otherwise carry over), one at a time: run
it alone on the machine.
"""

import json
import os
import subprocess
import sys
import time

from absl import app, flags

from trace_jax.utils import markdown_table

PROGRAMS = ("prefill", "decode", "qat_grad", "trace")
_LAYERS = flags.DEFINE_list("layers", ["2", "8", "32"], "Depths (small widths).")
_PROGRAMS = flags.DEFINE_list("programs", list(PROGRAMS), f"Programs: {', '.join(PROGRAMS)}.")
_SCAN = flags.DEFINE_list("scan", ["off", "on"], "scan_layers settings: off, on.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences.")
_CONTEXT = flags.DEFINE_integer("context", 128, "Slots per sequence (prompt: a quarter).")
_JSON = flags.DEFINE_string("json", None, "Also write the measurements to this JSON file.")
_CHILD = flags.DEFINE_string("child", None, "Internal: program,layers,scan to compile here.")


def _compile_seconds(program: str, layers: int, scan: bool, batch: int, context: int) -> float:
  """Seconds to trace, lower and compile `program` at `layers` layers (this process)."""
  import jax  # noqa: PLC0415 - the parent process never starts JAX
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from trace_jax import model as M  # noqa: PLC0415
  from trace_jax import plan as plan_lib  # noqa: PLC0415
  from trace_jax.model.cache import init_cache  # noqa: PLC0415
  from trace_jax.model.sharding import make_mesh  # noqa: PLC0415
  from trace_jax.rollout.params import quantize_params  # noqa: PLC0415
  from trace_jax.run import memory_check  # noqa: PLC0415
  from trace_jax.training import training_forward  # noqa: PLC0415

  cfg = M.small(num_layers=layers, scan_layers=scan, dtype="bfloat16")
  config = plan_lib.PlanConfig(mesh=(1, 1, 1), batch=batch, context=context)
  if program == "trace":
    start = time.perf_counter()
    memory_check.update_program(cfg, config, make_mesh(1, 1, 1))
    return time.perf_counter() - start
  model = nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)
  bf16 = M.CallOptions(compute_dtype="bfloat16")
  if program == "qat_grad":
    tokens = jax.ShapeDtypeStruct((batch, context), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, context), bool)

    def loss(state, rest, tokens, mask):
      policy = nnx.merge(graphdef, state, rest)
      logp, _ = training_forward(policy, tokens, tokens, mask, quant=M.QuantConfig(), options=bf16)
      return -jnp.sum(jnp.where(mask, logp, 0.0))

    fn, args = jax.grad(loss), (state, rest, tokens, mask)
  else:
    prompt = max(1, context // 4)
    rollout = memory_check.rollout_config(config, prompt)
    graphdef, state = nnx.split(model)  # the engine's: every variable, then FP4 weights
    params = jax.eval_shape(lambda s: quantize_params(s, rollout.quant, dtype=jnp.bfloat16), state)
    cache = jax.eval_shape(
      lambda: init_cache(cfg, batch, context, rollout.quant, dtype=jnp.bfloat16)
    )
    width = prompt if program == "prefill" else 1
    tokens = jax.ShapeDtypeStruct((batch, width), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, width), bool)
    options = bf16.replace(last_logits=True, recording=M.Recording(form="compact"))

    def fn(params, tokens, mask, cache):
      out = nnx.merge(graphdef, params)(
        tokens, positions=tokens, mask=mask, cache=cache, quant=rollout.quant, options=options
      )
      return out.logits, out.cache, out.sites

    args = (params, tokens, mask, cache)
  start = time.perf_counter()
  jax.jit(fn).trace(*args).lower().compile()
  return time.perf_counter() - start


def _measure(program: str, layers: int, scan: bool) -> float:
  """`_compile_seconds` in a fresh process."""
  run = subprocess.run(
    [
      sys.executable,
      os.path.abspath(__file__),
      f"--child={program},{layers},{'on' if scan else 'off'}",
      f"--batch={_BATCH.value}",
      f"--context={_CONTEXT.value}",
    ],
    capture_output=True,
    text=True,
  )
  if run.returncode:
    raise RuntimeError(f"{program} at {layers} layers, scan {scan}: {run.stderr[-2000:]}")
  return float(run.stdout.strip().splitlines()[-1])


def _parse():
  try:
    depths = sorted({int(n) for n in _LAYERS.value})
  except ValueError as e:
    raise app.UsageError(f"--layers={','.join(_LAYERS.value)} must be integers") from e
  if not depths or depths[0] < 1:
    raise app.UsageError(f"--layers={','.join(_LAYERS.value)}: each depth must be >= 1")
  bad = sorted(set(_PROGRAMS.value) - set(PROGRAMS))
  if bad:
    raise app.UsageError(f"--programs: {bad} are not programs; programs: {list(PROGRAMS)}")
  scans = list(dict.fromkeys(_SCAN.value))
  if not scans or set(scans) - {"off", "on"}:
    raise app.UsageError(f"--scan={','.join(_SCAN.value)}: each must be off or on")
  if _BATCH.value < 1 or _CONTEXT.value < 2:
    raise app.UsageError(f"--batch={_BATCH.value} must be >= 1, --context={_CONTEXT.value} >= 2")
  return depths, [p for p in PROGRAMS if p in _PROGRAMS.value], [s == "on" for s in scans]


def main(argv):
  del argv
  if _CHILD.value:
    program, layers, scan = _CHILD.value.split(",")
    seconds = _compile_seconds(program, int(layers), scan == "on", _BATCH.value, _CONTEXT.value)
    print(f"{seconds:.3f}")
    return
  depths, programs, scans = _parse()
  seconds = {}
  rows = []
  for program in programs:
    for scan in scans:
      for layers in depths:
        seconds[(program, scan, layers)] = _measure(program, layers, scan)
        print(
          f"{program} scan {'on' if scan else 'off'} {layers} layers: "
          f"{seconds[(program, scan, layers)]:.1f} s",
          flush=True,
        )
      first, last = seconds[(program, scan, depths[0])], seconds[(program, scan, depths[-1])]
      rows.append(
        (
          program,
          "on" if scan else "off",
          *(f"{seconds[(program, scan, n)]:.1f}" for n in depths),
          f"{last / first:.2f}x",
        )
      )
  print(
    f"\nsmall widths, batch {_BATCH.value} x {_CONTEXT.value} slots, compile seconds "
    "(trace + lower + compile, a fresh process each)\n"
  )
  headers = ["program", "scan_layers", *(f"{n} layers s" for n in depths)]
  print(markdown_table(headers + [f"{depths[-1]} : {depths[0]}"], rows))
  if _JSON.value:
    saved = [
      {"program": p, "scan_layers": s, "layers": n, "seconds": v}
      for (p, s, n), v in seconds.items()
    ]
    with open(_JSON.value, "w") as f:
      json.dump(saved, f, indent=2)


if __name__ == "__main__":
  app.run(main)
