"""Every kernel lowers for CUDA (Pallas' Triton backend, compiled) on a machine without a
GPU, at the shapes the model runs: Qwen3-30B-A3B decode (d_model 2048, expert ffn 768,
128 experts top-8, 32 query / 4 KV heads of 128), batches 1 / 32 / 128, caches of
context + 1 slots (odd). Inputs are ShapeDtypeStructs: nothing is allocated or run.

What a GPU would run is read off the lowering (`kernels.cuda_lowering`): Triton kernel
launches with their grids, and XLA ops. The decode step of one layer must issue at most 8
kernels, no XLA while loop or sort, and no more non-trivial XLA ops than the bf16 layer;
every kernel that reads the cache must run at least 264 programs (two per SM of an
H100/H200). The slow tests lower the other shapes and compile the kernels for sm_90 where
an interpreter with the `triton` package is available:
  TRACE_JAX_TRITON_PYTHON=/path/to/venv/bin/python pytest -m slow -n 0 \\
      tests/kernels/test_cuda_lowering.py
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from trace_jax import fp4, kernels
from trace_jax import model as M
from trace_jax.fp4 import numerics
from trace_jax.kernels import (
  cuda_lowering,
  launch,
  gemm as gemm_lib,
  grouped_gemm as grouped_gemm_lib,
  layout,
  routing,
  triton_divide,
)
from trace_jax.rollout.lowering import lower_decode_step

S = jax.ShapeDtypeStruct
D_MODEL, FFN, EXPERTS, TOP_K, KV_HEADS, HEAD_DIM = 2048, 768, 128, 8, 4, 128
CACHE_READERS = ("decode_attention",)  # the kernels that read the KV cache
SHAPES = [
  (1, 32769),
  (32, 32769),
  (128, 4097),
]  # (batch, cache slots): one long, 32 long, 128 short


def _qarray(shape, fmt, axis, global_shape):
  """A QArray of ShapeDtypeStructs, as `fp4.quantize(x, fmt, axis=axis)` would make."""
  block = fp4.get_format(fmt).block_size
  packed, scales = list(shape), list(shape)
  packed[axis] //= 2
  scales[axis] //= block
  return fp4.QArray(
    packed=S(tuple(packed), jnp.uint8),
    scales=S(tuple(scales), jnp.uint8),
    global_scale=S(global_shape, jnp.float32),
    fmt=fmt,
    axis=axis - len(shape),
  )


def _programs(call) -> int:
  return call.grid[0] * call.grid[1] * call.grid[2]


def _lower(fn, *args):
  return cuda_lowering.triton_calls(cuda_lowering.lower(fn, *args))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("batch", [1, 32, 128])
def test_fp4_gemm_lowers_and_fills_the_gpu_at_decode(fmt, batch):
  """q|k|v fused (N = 5120) and the output projection (K = 4096): one launch each, at
  least two programs per SM, each with at least two K steps (a pipeline to overlap)."""
  qkv = _qarray((D_MODEL, 5120), fmt, 0, (1, 1))
  o_proj = _qarray((4096, D_MODEL), fmt, 0, (1, 1))
  for w in (qkv, o_proj):
    k, n = w.shape
    [call] = _lower(
      lambda x, w: kernels.fp4_gemm(x, w, quantize=fmt, record="compact"),
      S((batch, k), jnp.bfloat16),
      w,
    )
    bm, bn, bk, splits = gemm_lib.dense_tiling(batch, n, k, quantize=fmt, w_fmt=fmt)
    assert call.name == "fp4_gemm" and call.grid == (-(-batch // bm), n // bn, splits)
    assert _programs(call) >= 264 and k // bk // splits >= 2, (call.grid, bk)


@pytest.mark.parametrize("batch", [1, 32, 128])
def test_moe_experts_lower_to_two_expert_major_launches(batch):
  w = _qarray((EXPERTS, D_MODEL, FFN), "nvfp4", 1, (EXPERTS, 1, 1))
  down = _qarray((EXPERTS, FFN, D_MODEL), "nvfp4", 1, (EXPERTS, 1, 1))

  def run(x, gate, up, down, experts):
    return kernels.moe_experts(
      x, experts, (gate, up), down, quantize_in="nvfp4", quantize_mid="nvfp4", record="compact"
    )

  lowered = cuda_lowering.lower(
    run, S((batch, D_MODEL), jnp.bfloat16), w, w, down, S((batch, TOP_K), jnp.int32)
  )
  calls = cuda_lowering.triton_calls(lowered)
  assert [c.name for c in calls] == ["fp4_grouped_gemm"] * 2
  block_m = grouped_gemm_lib.grouped_tile_rows(batch * TOP_K, EXPERTS)
  tiles = routing.max_tiles(batch * TOP_K, EXPERTS, block_m)
  assert calls[0].grid == (tiles, FFN // 64, 1) and calls[1].grid == (tiles, D_MODEL // 64, 1)
  assert cuda_lowering.op_counts(lowered).loops_and_sorts == 0


@pytest.mark.parametrize("batch, length", SHAPES)
def test_decode_attention_fills_the_gpu_at_any_length(batch, length):
  cache = _qarray((batch, length, KV_HEADS, HEAD_DIM), "nvfp4", 3, (batch, length, KV_HEADS, 1))
  calls = _lower(
    lambda q, k, v, n, m: kernels.fp4_decode_attention(q, k, v, n, m),
    S((batch, 32, HEAD_DIM), jnp.bfloat16),
    cache,
    cache,
    S((batch,), jnp.int32),
    S((batch, length), bool),
  )
  assert [c.name for c in calls] == ["decode_attention", "decode_attention_combine"]
  assert _programs(calls[0]) >= 264, calls[0].grid
  # one program a query head; vmap's axes (KV heads, sequences) launch last, inner first
  assert calls[1].grid == (32 // KV_HEADS, KV_HEADS, batch)


def test_write_kv_and_quantize_lower():
  cache = _qarray((32, 4097, KV_HEADS, HEAD_DIM), "nvfp4", 3, (32, 4097, KV_HEADS, 1))
  new = S((32, 1, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  [call] = _lower(
    lambda k, v, ck, cv, i: kernels.write_kv(k, v, ck, cv, i, record="compact"),
    new,
    new,
    cache,
    cache,
    S((), jnp.int32),
  )
  assert call.name == "fp4_write_kv" and call.grid == (32, 1, 1)
  [call] = _lower(lambda x: kernels.fused_quantize(x, "mxfp4"), S((32, FFN), jnp.bfloat16))
  assert call.name == "fp4_quantize"


def _divisions(call) -> tuple[int, list[str]]:
  """(inline div.rn.f32 count, float32 tensor divisions Triton would make div.full.f32)."""
  text = call.ttir_text()
  approximate = [line for line in text.splitlines() if "arith.divf" in line and "f32>" in line]
  return text.count(triton_divide.DIV_RN_F32), approximate


def test_quantizing_kernels_divide_only_with_div_rn():
  """Triton lowers a float32 `/` to div.full.f32 (2 ulp), and XLA compiles `tt.precise_divf`
  with its own -nvptx-prec-divf32=1 to div.full.f32 too; every division of the format math
  in the kernels that quantize is PTX div.rn.f32, inline, which nothing rewrites."""
  x = S((4, FFN), jnp.bfloat16)
  cache = _qarray((4, 64, KV_HEADS, HEAD_DIM), "nvfp4", 3, (4, 64, KV_HEADS, 1))
  new = S((4, 1, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  calls = [
    *_lower(lambda x: kernels.fused_quantize(x, "nvfp4"), x),
    *_lower(
      lambda x, w: kernels.fp4_gemm(x, w, quantize="nvfp4", record="compact"),
      x,
      _qarray((FFN, 256), "nvfp4", 0, (1, 1)),
    ),
    *_lower(
      lambda k, v, ck, cv: kernels.write_kv(k, v, ck, cv, 0, record="compact"),
      new,
      new,
      cache,
      cache,
    ),
  ]
  for call in calls:
    exact, approximate = _divisions(call)
    # global scale, block scale, step, x / step (the GEMM also divides out the scales)
    assert exact >= 4 and not approximate, (call.name, exact, approximate[:3])
    assert "precise_divf" not in call.ttir_text()


def test_true_divide_is_float64_on_xla_gpu_and_unchanged_on_cpu():
  """XLA:GPU compiles float32 division to div.full.f32; on a GPU `true_divide` divides in
  float64 and rounds once (correctly rounded, see its docstring), on CPU it stays IEEE
  float32 division (bit-identical to before)."""
  a, b = S((4, 16), jnp.float32), S((4, 1), jnp.float32)
  lowered = jax.jit(numerics.true_divide).trace(a, b)
  gpu = lowered.lower(lowering_platforms=("cuda",)).as_text()
  cpu = lowered.lower(lowering_platforms=("cpu",)).as_text()
  assert re.search(r"stablehlo.divide %\S+, %\S+ : tensor<4x16xf64>", gpu), gpu
  assert not re.search(r"stablehlo.divide %\S+, %\S+ : tensor<4x16xf32>", gpu)
  assert re.search(r"stablehlo.divide %\S+, %\S+ : tensor<4x16xf32>", cpu), cpu
  # The whole quantizer on XLA:GPU: every division of the format math in float64.
  text = jax.jit(lambda x: fp4.quantize(x, global_group="row").packed).trace(a)
  text = text.lower(lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"stablehlo.divide .*xf64>", text) and not re.findall(
    r"stablehlo.divide .*xf32>", text
  )


def test_inline_division_in_a_plain_pallas_kernel():
  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = numerics.true_divide(a_ref[...], b_ref[...])

  def f(a, b):
    return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
      compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1),
    )(a, b)

  [call] = _lower(f, S((16, 16), jnp.float32), S((16, 16), jnp.float32))
  exact, approximate = _divisions(call)
  assert exact == 1 and not approximate


def _layer(batch, length, precision, kernels):
  return lower_decode_step(
    M.get_preset("qwen3_30b_a3b", num_layers=1), batch, length, precision=precision, kernels=kernels
  )


def _check_layer(batch, length):
  fp4_step, bf16_step = _layer(batch, length, "fp4", "pallas"), _layer(batch, length, "bf16", "xla")
  counts, bf16 = cuda_lowering.op_counts(fp4_step), cuda_lowering.op_counts(bf16_step)
  calls = cuda_lowering.triton_calls(fp4_step)
  assert counts.triton_kernels == len(calls) <= 8, [c.name for c in calls]
  assert counts.loops_and_sorts == 0, counts.xla_ops
  assert counts.non_trivial <= bf16.non_trivial, (counts.non_trivial, bf16.non_trivial)
  readers = [c for c in calls if c.name in CACHE_READERS]
  assert readers and all(_programs(c) >= 264 for c in readers), [c.grid for c in readers]
  return counts, bf16, calls


def test_one_layer_decode_step_at_batch_1_over_32k():
  """One Qwen3-30B-A3B layer's FP4 decode step (batch 1, 32,769 slots): the 7 kernels
  (q|k|v GEMM, cache write, attention, split combine, output GEMM, gate|up and down grouped
  GEMMs), no XLA loop or sort, fewer non-trivial XLA ops than the bf16 layer (which sorts
  its tokens by expert twice), and the attention fills the GPU."""
  counts, _, calls = _check_layer(1, 32769)
  assert [c.name for c in calls] == [
    "fp4_gemm",
    "fp4_write_kv",
    "decode_attention",
    "decode_attention_combine",
    "fp4_gemm",
    "fp4_grouped_gemm",
    "fp4_grouped_gemm",
  ]


def test_a_scanned_decode_step_holds_one_layer_of_kernels():
  """Four Qwen3-30B-A3B layers under the scan: the FP4 decode step lowers for CUDA with the
  one layer's kernels once (the cache write and attention reading the layer's entry of the
  cache's stacks at the scan's traced position), not once per layer."""
  cfg = M.get_preset("qwen3_30b_a3b", num_layers=4)
  assert cfg.scan_layers
  step = lower_decode_step(cfg, 4, 257, precision="fp4", kernels="pallas")
  one = lower_decode_step(cfg.replace(num_layers=1), 4, 257, precision="fp4", kernels="pallas")
  names = lambda lowered: sorted(c.name for c in cuda_lowering.triton_calls(lowered))  # noqa: E731
  assert "fp4_write_kv" in names(one) and "decode_attention" in names(one)
  assert names(step) == names(one)


@pytest.mark.slow  # ~30 s: the two other shapes, FP4 and bf16 layers
@pytest.mark.parametrize("batch, length", SHAPES[1:])
def test_one_layer_decode_step_at_the_other_shapes(batch, length):
  _check_layer(batch, length)


def test_triton_params_are_checked():
  with pytest.raises(ValueError, match="num_warps=3"):
    launch.triton_params(3, 2, "fp4_gemm")
  with pytest.raises(ValueError, match="num_stages=0"):
    launch.triton_params(4, 0, "fp4_gemm")
  w = _qarray((64, 32), "nvfp4", 0, (1, 1))
  with pytest.raises(ValueError, match="num_warps=6"):
    cuda_lowering.lower(
      lambda x, w: kernels.fp4_gemm(x, w, num_warps=6), S((2, 64), jnp.bfloat16), w
    )
  [call] = _lower(
    lambda x, w: kernels.fp4_gemm(x, w, num_warps=2, num_stages=5), S((2, 64), jnp.bfloat16), w
  )
  assert (call.num_warps, call.num_stages) == (2, 5)


@pytest.mark.slow
def test_each_kernel_compiles_for_sm90_without_spills_and_divides_correctly_rounded():
  """The offline sm_90 compile (no GPU: the `triton` package's compiler, ptxas): every
  kernel fits shared memory and registers without spilling, and its PTX divides float32
  only with div.rn.f32."""
  if cuda_lowering.triton_python() is None:
    pytest.skip(
      "no interpreter with the `triton` package to compile Triton IR to PTX (jaxlib ships "
      "only Triton's MLIR dialect, not its compiler; pip may not install it here): set "
      "TRACE_JAX_TRITON_PYTHON to one. The lowering tests above still check the divisions "
      "in the Triton IR."
    )
  batch, length = 32, 4097
  w = _qarray((D_MODEL, 5120), "nvfp4", 0, (1, 1))
  experts = _qarray((EXPERTS, D_MODEL, FFN), "nvfp4", 1, (EXPERTS, 1, 1))
  cache = _qarray((batch, length, KV_HEADS, HEAD_DIM), "nvfp4", 3, (batch, length, KV_HEADS, 1))
  new = S((batch, 1, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  calls = [
    *_lower(
      lambda x, w: kernels.fp4_gemm(x, w, quantize="nvfp4", record="compact"),
      S((batch, D_MODEL), jnp.bfloat16),
      w,
    ),
    *_lower(
      lambda x, g, u, d, e: kernels.moe_experts(
        x, e, (g, u), d, quantize_in="nvfp4", quantize_mid="nvfp4", record="compact"
      ),
      S((batch, D_MODEL), jnp.bfloat16),
      experts,
      experts,
      _qarray((EXPERTS, FFN, D_MODEL), "nvfp4", 1, (EXPERTS, 1, 1)),
      S((batch, TOP_K), jnp.int32),
    ),
    *_lower(
      lambda q, k, v, n: kernels.fp4_decode_attention(q, k, v, n),
      S((batch, 32, HEAD_DIM), jnp.bfloat16),
      cache,
      cache,
      S((batch,), jnp.int32),
    ),
    *_lower(
      lambda k, v, a, c: kernels.write_kv(k, v, a, c, 0, record="compact"), new, new, cache, cache
    ),
    *_lower(lambda x: kernels.fused_quantize(x, "nvfp4"), S((batch, FFN), jnp.bfloat16)),
  ]
  for call in calls:
    compiled = cuda_lowering.compile_triton(call)
    assert 0 < compiled.shared_bytes <= cuda_lowering.HOPPER_SHARED_MEMORY, compiled
    assert 0 < compiled.registers <= 255 and compiled.spill_bytes == 0, compiled
    assert compiled.ptx_divisions["div.full.f32"] == 0, compiled
    assert compiled.ptx_divisions["div.approx.f32"] == 0, compiled


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the script runs for real")
def test_gpu_check_without_a_gpu_says_so_and_fails():
  """Off a GPU (no --smoke) nothing is measured, and the exit status says so: a window
  that measured nothing must not read as a success."""
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  script = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "gpu_check.py")
  result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
  assert result.returncode == 1, result.stderr[-3000:]
  assert "needs a GPU" in result.stdout and "nothing ran" in result.stdout


def test_fused_layout_lowers_as_one_launch():
  """The engine's fused q|k|v weight runs as one GEMM launch."""
  parts = [_qarray((D_MODEL, n), "nvfp4", 0, (1, 1)) for n in (4096, 512, 512)]
  fused = jax.eval_shape(lambda *p: layout.fuse(p), *parts)
  [call] = _lower(
    lambda x, w: kernels.fp4_gemm(x, w, quantize="nvfp4"), S((1, D_MODEL), jnp.bfloat16), fused
  )
  _, bn, _, _ = gemm_lib.dense_tiling(1, 5120, D_MODEL, quantize="nvfp4")
  assert call.grid[1] * bn == 5120
