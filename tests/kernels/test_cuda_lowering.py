"""Every kernel lowers for CUDA (Pallas' Triton backend, `interpret=False`) on a machine
without a GPU, at the shapes the model runs: decode batches 1 / 32 / 256 over the
Qwen3-30B-A3B widths (d_model 2048, expert ffn 768, 128 experts top-8, 4 KV heads x 128,
KV length 4096), NVFP4 and MXFP4, W4A16 and W4A4, GQA groups 1 / 4 / 8. Inputs are
ShapeDtypeStructs: nothing is allocated or run. A regression in GPU lowering fails here.

Each dimension's every value meets every kernel and format; the full cross product is not
taken (60 lowerings, about 30 s on 2 cores). The slow test at the end also compiles one
lowering of each kernel to a cubin for sm_90 without a GPU (`kernels.cuda_lowering`), where
an interpreter with the `triton` package is available:
  TRACE_JAX_TRITON_PYTHON=/work/venv-triton/bin/python pytest -m slow -n 0 \
      tests/kernels/test_cuda_lowering.py
"""

import jax
import jax.numpy as jnp
import pytest

from trace_jax import fp4, kernels
from trace_jax.kernels import cuda_lowering, decode_attention_lib, dispatch

S = jax.ShapeDtypeStruct
D_MODEL, FFN, EXPERTS, TOP_K, KV_HEADS, HEAD_DIM, KV_LEN = 2048, 768, 128, 8, 4, 128, 4096
BATCHES = (1, 32, 256)
FORMATS = ("nvfp4", "mxfp4")


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


def _lower_one(fn, *args):
  """Lower for CUDA; return the one Triton kernel inside."""
  [call] = cuda_lowering.triton_calls(cuda_lowering.lower(fn, *args))
  return call


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activations", ["w4a16", "w4a4"])
@pytest.mark.parametrize(
  "batch, k, n", [(1, D_MODEL, FFN), (32, FFN, D_MODEL), (256, D_MODEL, FFN)]
)
def test_fp4_matmul_lowers(fmt, activations, batch, k, n):
  w = _qarray((k, n), fmt, 0, (1, 1))
  x = (
    S((batch, k), jnp.bfloat16)
    if activations == "w4a16"
    else _qarray((batch, k), fmt, 1, (batch, 1))
  )
  call = _lower_one(
    lambda x, w: kernels.fp4_matmul(x, w, out_dtype=jnp.bfloat16, interpret=False), x, w
  )
  expected = kernels.fp4_matmul_lib.tiling(batch, n, k)
  assert call.name == "fp4_matmul"
  assert (call.num_warps, call.num_stages) == (expected["num_warps"], expected["num_stages"])
  block_m = dispatch.row_tiling(batch)[0]
  assert call.grid == (-(-batch // block_m), n // expected["block_n"], expected["k_splits"])
  if batch <= 64:  # decode: K split until the GPU has enough programs (or K is used up)
    assert call.grid[0] * call.grid[1] * call.grid[2] >= min(
      kernels.fp4_matmul_lib.TARGET_PROGRAMS, call.grid[0] * call.grid[1] * k // 256
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("projection", ["gate", "down"])
def test_moe_gmm_lowers(fmt, batch, projection):
  k, n = (D_MODEL, FFN) if projection == "gate" else (FFN, D_MODEL)
  w = _qarray((EXPERTS, k, n), fmt, 1, (EXPERTS, 1, 1))
  rows = batch * TOP_K  # every token's top-8 experts, sorted by expert
  call = _lower_one(
    lambda x, w, sizes: kernels.moe_gmm(x, w, sizes, interpret=False),
    S((rows, k), jnp.bfloat16),
    w,
    S((EXPERTS,), jnp.int32),
  )
  assert call.name == "moe_gmm" and call.grid[0] * call.grid[1] * call.grid[2] >= 96


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("groups", [1, 4, 8])
def test_decode_attention_lowers(fmt, batch, groups):
  cache = _qarray((batch, KV_LEN, KV_HEADS, HEAD_DIM), fmt, 3, (batch, KV_LEN, KV_HEADS, 1))
  q = S((batch, KV_HEADS * groups, HEAD_DIM), jnp.bfloat16)
  call = _lower_one(
    lambda q, k, v, lengths, valid: kernels.decode_attention(
      q, k, v, lengths, valid, interpret=False
    ),
    q,
    cache,
    cache,
    S((batch,), jnp.int32),
    S((batch, KV_LEN), bool),
  )
  assert call.name == "decode_attention" and call.grid == (batch, KV_HEADS, 8)
  assert (call.num_warps, call.num_stages) == (8, 2)  # 128-slot chunks


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("width", [D_MODEL, FFN, 32 * HEAD_DIM])  # moe_in, moe_mid, attn_out
def test_fused_quantize_lowers(fmt, batch, width):
  call = _lower_one(
    lambda x: kernels.quantize(x, fmt, interpret=False), S((batch, width), jnp.bfloat16)
  )
  padded = 1 << (width - 1).bit_length()
  expected = kernels.quantize_lib.tiling(padded)
  assert call.name == "fp4_quantize" and call.num_stages == 1
  assert call.grid[0] == -(-batch // expected["block_m"])


def test_fused_quantize_divides_exactly_when_compiled():
  """Triton's float32 `/` is div.full.f32 (about 2 ulp), which would move exact ties; the
  compiled kernel must carry correctly rounded divisions only (inline div.rn.f32)."""
  call = _lower_one(
    lambda x: kernels.quantize(x, "nvfp4", interpret=False), S((4, FFN), jnp.bfloat16)
  )
  text = call.ttir_text()
  # global scale, block scale, step, v = x / step: fp4.numerics.true_divide's inline
  # div.rn.f32 (which no compiler flag rewrites).
  assert text.count("div.rn.f32 $0, $1, $2;") >= 4
  tensor_divisions = [
    line for line in text.splitlines() if "arith.divf" in line and "tensor<" in line
  ]
  assert not tensor_divisions, tensor_divisions[:3]


def test_format_math_divides_only_through_true_divide():
  """The fused kernel relies on every array division of the format math being
  `fp4.numerics.true_divide` (precise in Triton): a plain float32 division of arrays in
  its jaxpr would compile to the approximate div.full.f32 and move exact ties."""
  x = jax.random.normal(jax.random.key(7), (8, 64)).astype(jnp.bfloat16)
  for fmt in ("nvfp4", "mxfp4"):
    jaxpr = jax.make_jaxpr(lambda v: fp4.tiles.quantize_rows(v, fmt))(x)
    eqns = list(jaxpr.jaxpr.eqns)
    plain, exact = 0, 0
    while eqns:
      eqn = eqns.pop()
      for p in eqn.params.values():
        inner = getattr(p, "jaxpr", p)
        if hasattr(inner, "eqns"):
          eqns.extend(inner.eqns)
      if eqn.primitive is jax.lax.div_p and eqn.outvars[0].aval.shape:
        plain += 1
      exact += eqn.primitive.name == "fp4_ieee_div"
    assert plain == 0 and exact >= (3 if fmt == "nvfp4" else 1), (fmt, plain, exact)


def test_triton_params_are_checked():
  with pytest.raises(ValueError, match="num_warps=3"):
    dispatch.triton_params(3, 2, "fp4_matmul")
  with pytest.raises(ValueError, match="num_stages=0"):
    dispatch.triton_params(4, 0, "fp4_matmul")
  w = _qarray((64, 32), "nvfp4", 0, (1, 1))
  with pytest.raises(ValueError, match="num_warps=6"):
    cuda_lowering.lower(
      lambda x, w: kernels.fp4_matmul(x, w, interpret=False, num_warps=6),
      S((2, 64), jnp.bfloat16),
      w,
    )
  # An explicit choice reaches the kernel.
  call = _lower_one(
    lambda x, w: kernels.fp4_matmul(x, w, interpret=False, num_warps=2, num_stages=5),
    S((2, 64), jnp.bfloat16),
    w,
  )
  assert (call.num_warps, call.num_stages) == (2, 5)


@pytest.mark.slow
def test_each_kernel_compiles_to_a_cubin_without_a_gpu():
  if cuda_lowering.triton_python() is None:
    pytest.skip("no interpreter with `triton`: set TRACE_JAX_TRITON_PYTHON")
  fmt, batch = "nvfp4", 32
  w = _qarray((D_MODEL, FFN), fmt, 0, (1, 1))
  cache = _qarray((batch, KV_LEN, KV_HEADS, HEAD_DIM), fmt, 3, (batch, KV_LEN, KV_HEADS, 1))
  lowerings = [
    (lambda x, w: kernels.fp4_matmul(x, w, interpret=False), S((batch, D_MODEL), jnp.bfloat16), w),
    (
      lambda x, w, s: kernels.moe_gmm(x, w, s, interpret=False),
      S((batch * TOP_K, D_MODEL), jnp.bfloat16),
      _qarray((EXPERTS, D_MODEL, FFN), fmt, 1, (EXPERTS, 1, 1)),
      S((EXPERTS,), jnp.int32),
    ),
    (
      lambda q, k, v, n: decode_attention_lib.decode_attention(q, k, v, n, interpret=False),
      S((batch, KV_HEADS * 4, HEAD_DIM), jnp.bfloat16),
      cache,
      cache,
      S((batch,), jnp.int32),
    ),
    (lambda x: kernels.quantize(x, "mxfp4", interpret=False), S((batch, FFN), jnp.bfloat16)),
  ]
  for fn, *args in lowerings:
    compiled = cuda_lowering.compile_triton(_lower_one(fn, *args))
    assert 0 < compiled.shared_bytes <= cuda_lowering.HOPPER_SHARED_MEMORY, compiled
    assert 0 < compiled.registers <= 255, compiled
    if compiled.name == "fp4_quantize":
      assert compiled.ptx_divisions["div.rn.f32"] > 0, compiled
      assert compiled.ptx_divisions["div.full.f32"] == 0, compiled


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the script runs for real")
def test_gpu_check_without_a_gpu_says_so_and_exits_cleanly():
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  script = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "gpu_check.py")
  result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "needs a GPU" in result.stdout and "nothing ran" in result.stdout
