"""Lower the kernels for CUDA on a machine without a GPU, and compile them there too.

Lowering (`lower`) runs everywhere: `jax.jit(f).trace(*args).lower(lowering_platforms=
("cuda",))` with `interpret=False` turns each `pallas_call` into a custom call holding the
kernel's Triton IR (TTIR, MLIR bytecode). It catches what Pallas' Triton lowering lacks (a
primitive, a non-power-of-two load) but not what Triton's own compiler rejects later
(layouts, shared memory, registers).

Compiling without a device (`compile_triton`): XLA's GPU backend needs a CUDA jaxlib plugin
and a device, but the TTIR in the custom call is a complete Triton module, so the `triton`
package (pip, its own bundled LLVM and ptxas) compiles it for sm_90 (H100/H200) with no GPU:
TTIR -> TTGIR -> LLVM IR -> PTX -> cubin, reporting shared memory, registers and spills.
It runs in a subprocess with `TRACE_JAX_TRITON_PYTHON` (an interpreter that has `triton`,
e.g. a separate venv: `python -m venv /work/venv-triton && /work/venv-triton/bin/pip install
triton`), or this interpreter if it imports `triton`. The installed Triton is newer than the
one inside XLA, so a module it compiles is strong evidence, not proof, that XLA will.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

import jax

from trace_jax import _jax_private  # jaxlib's MLIR bindings, Pallas' Triton-dialect context
from trace_jax.kernels import launch

ir = _jax_private.mlir_ir

_TRITON_CALL = "__gpu$xla.gpu.triton"
HOPPER_SHARED_MEMORY = 232448  # bytes a block may use on sm_90 (227 KiB)


@dataclasses.dataclass(frozen=True)
class TritonCall:
  """One Pallas kernel as lowered for CUDA."""

  name: str
  ttir: bytes  # the Triton module, MLIR bytecode
  num_warps: int
  num_stages: int
  grid: tuple[int, int, int]

  def ttir_text(self) -> str:
    """The module as MLIR text (what the `triton` package reads)."""
    with _jax_private.pallas_triton().new_ir_context():
      return str(ir.Module.parse(self.ttir))


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
  """What Triton's compiler reports for one kernel, for sm_90."""

  name: str
  shared_bytes: int
  registers: int  # per thread
  spill_bytes: int  # spill stores per thread
  ptx_divisions: dict[str, int]  # e.g. {"div.rn.f32": 12, "div.full.f32": 0}


def lower(fn, *args, **kwargs) -> jax.stages.Lowered:
  """`fn(*args, **kwargs)` lowered for CUDA on any machine (args may be ShapeDtypeStructs),
  kernels compiled (`launch.compiled_kernels`: not their interpret-mode emulation)."""
  with launch.compiled_kernels():
    return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


def _walk(lowered: jax.stages.Lowered):
  """Every op the program executes, in program order, through `func.call`s (a function
  called twice is walked twice: counts are per execution, not per definition)."""
  module = lowered.compiler_ir("stablehlo")
  functions = {
    ir.StringAttr(op.attributes["sym_name"]).value: op.operation for op in module.body.operations
  }

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          child = child.operation
          if child.name == "func.call":
            yield from walk(functions[ir.FlatSymbolRefAttr(child.attributes["callee"]).value])
            continue
          yield child
          yield from walk(child)

  yield from walk(functions["main"])


# StableHLO ops that move or relabel data without computing on it, or only build
# constants: a reshape, a broadcast, a dtype cast, a slice of an operand, a constant or
# iota, the plumbing of regions and tuples. XLA fuses them into their consumers (or they
# are free: a bitcast, a reshape of a contiguous array), so they are not counted as work.
TRIVIAL_OPS = frozenset(
  {
    "func.return",
    "stablehlo.return",
    "stablehlo.constant",
    "stablehlo.iota",
    "stablehlo.reshape",
    "stablehlo.broadcast_in_dim",
    "stablehlo.convert",
    "stablehlo.bitcast_convert",
    "stablehlo.slice",
    "stablehlo.tuple",
    "stablehlo.get_tuple_element",
    "stablehlo.optimization_barrier",
    "sdy.sharding_constraint",
  }
)


@dataclasses.dataclass(frozen=True)
class OpCounts:
  """What a CUDA lowering runs: Triton kernels, and XLA ops by kind."""

  triton_kernels: int  # Pallas kernel launches (custom calls), per execution
  xla_ops: collections.Counter  # every other op, by name
  # Non-trivial XLA ops: everything but `TRIVIAL_OPS` and the kernels themselves; the
  # regions of reductions and sorts are counted as ops of their own (a `stablehlo.add`
  # inside a reduce), so an op with a body counts its body too.

  @property
  def non_trivial(self) -> int:
    return sum(n for name, n in self.xla_ops.items() if name not in TRIVIAL_OPS)

  @property
  def loops_and_sorts(self) -> int:
    return self.xla_ops["stablehlo.while"] + self.xla_ops["stablehlo.sort"]


def op_counts(lowered: jax.stages.Lowered) -> OpCounts:
  """Count a CUDA lowering's Triton kernels and XLA ops (see `OpCounts`)."""
  kernels, ops = 0, collections.Counter()
  for op in _walk(lowered):
    if op.name == "stablehlo.custom_call" and _target(op) == _TRITON_CALL:
      kernels += 1
    else:
      ops[op.name] += 1
  return OpCounts(triton_kernels=kernels, xla_ops=ops)


def _target(op) -> str:
  return ir.StringAttr(op.attributes["call_target_name"]).value


def triton_calls(lowered: jax.stages.Lowered) -> list[TritonCall]:
  """The Triton kernels inside a CUDA lowering, in program order, one per launch."""
  calls = []
  for child in _walk(lowered):
    if child.name == "stablehlo.custom_call" and _target(child) == _TRITON_CALL:
      config = ir.DictAttr(child.attributes["mhlo.backend_config"])
      number = lambda key, c=config: ir.IntegerAttr(c[key]).value  # noqa: E731
      calls.append(
        TritonCall(
          name=ir.StringAttr(config["name"]).value,
          ttir=ir.StringAttr(config["ir"]).value_bytes,
          num_warps=number("num_warps"),
          num_stages=number("num_stages"),
          grid=(number("grid_x"), number("grid_y"), number("grid_z")),
        )
      )
  return calls


def triton_python() -> str | None:
  """An interpreter that can import `triton`, or None."""
  configured = os.environ.get("TRACE_JAX_TRITON_PYTHON")
  if configured:
    return configured
  return sys.executable if importlib.util.find_spec("triton") is not None else None


_COMPILE = r"""
import json, re, os, subprocess, sys, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
path, warps, stages, arch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
kernel = triton.compile(path, target=GPUTarget("cuda", arch, 32),
                        options={"num_warps": warps, "num_stages": stages})
ptx = kernel.asm["ptx"]
with open(path + ".ptx", "w") as f:
  f.write(ptx)
from triton.backends.nvidia.compiler import get_ptxas
ptxas = get_ptxas(arch).path  # the one Triton used for the cubin
report = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", path + ".ptx", "-o", os.devnull],
                        capture_output=True, text=True, check=True).stderr
print(json.dumps({
    "shared": kernel.metadata.shared,
    "registers": int(re.search(r"Used (\d+) registers", report).group(1)),
    "spills": int(re.search(r"(\d+) bytes spill stores", report).group(1)),
    "divisions": {d: ptx.count(d) for d in ("div.rn.f32", "div.full.f32", "div.approx.f32")},
}))
"""


def compile_triton(
  call: TritonCall, *, arch: int = 90, python: str | None = None, timeout: float = 600
) -> CompiledKernel:
  """Compile one lowered kernel to a cubin for sm_`arch` with the `triton` package, no GPU.

  Raises RuntimeError (with Triton's message) where the compiler rejects the kernel, and
  FileNotFoundError where no interpreter has `triton` (see the module docstring).
  """
  python = python or triton_python()
  if python is None:
    raise FileNotFoundError(
      "no interpreter with the `triton` package: set "
      "TRACE_JAX_TRITON_PYTHON (see trace_jax.kernels.cuda_lowering)"
    )
  with tempfile.TemporaryDirectory() as scratch:
    path = os.path.join(scratch, f"{call.name}.ttir")
    with open(path, "w") as f:
      f.write(call.ttir_text())
    result = subprocess.run(
      [python, "-c", _COMPILE, path, str(call.num_warps), str(call.num_stages), str(arch)],
      capture_output=True,
      text=True,
      timeout=timeout,
      env={**os.environ, "TRITON_DEFAULT_FP_FUSION": "0", "PYTHONPATH": ""},
    )
  if result.returncode:
    errors = [line for line in result.stderr.splitlines() if re.search(r"error|Error", line)]
    raise RuntimeError(
      f"Triton could not compile {call.name}: " + ("\n".join(errors[-5:]) or result.stderr[-2000:])
    )
  report = json.loads(result.stdout.strip().splitlines()[-1])
  return CompiledKernel(
    name=call.name,
    shared_bytes=report["shared"],
    registers=report["registers"],
    spill_bytes=report["spills"],
    ptx_divisions=report["divisions"],
  )
