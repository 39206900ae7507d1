"""Pallas kernels for the FP4 hot path (DESIGN.md section 7).

Each module holds a kernel and its `reference()` (the same math in plain XLA); every kernel
takes `interpret=` (default: interpret mode unless on a GPU) and `poison=` (tests). Without
kernels the model dequantizes and runs XLA dots (`experiments/bench_kernels.py` times both).

  gemm              the FP4 GEMM: x quantized per token in its prologue (with its guidance
                    record), FP4 weight decoded in registers; dense (q|k|v fused, split-K
                    at decode)
  grouped_gemm      the same kernel body grouped over experts (expert-major, SwiGLU epilogue)
  gemm_body         that shared kernel body, its operand checks, tilings and records
  routing           sort-free expert-major tiles of routed rows (for the grouped GEMM)
  moe               a MoE layer's routed experts: two grouped GEMMs
  moe_bf16          the routed experts on bf16 weights four ways (grouped, gather,
                    ragged_dot, dense): the fair bf16 baselines of the FP4 MoE
  decode_attention  one query token over the FP4 KV cache, flash-decoding for any length
  kv_write          new K/V entries quantized and written into the FP4 cache in place
  quantize          fused per-token NVFP4/MXFP4 quantization + compact guidance bits
  layout            sibling weights fused at weight sync (q|k|v, gate|up) for the kernels
  launch            `pallas_call` on the Triton backend, interpret mode off a GPU (every
                    kernel module imports it; it imports none of them)
  probe             whether the kernels run and match their references here
  dispatch          `resolve("auto" | "pallas" | "xla")`: which implementation runs

`dispatch.resolve` (`resolve_with_reason` also says why "auto" fell back to XLA) is called
once, outside jit, where a run is set up (the rollout engine); the model takes the resolved
implementation as `QuantConfig.kernels`. On a GPU the kernels compile through Pallas' Triton
backend, where `triton_divide` gives `fp4.true_divide` its exact division; `cuda_lowering`
lowers them for CUDA, and compiles them to sm_90 cubins, on a machine without a GPU.

The kernel functions are exported under names of their own (`fp4_gemm`, `fp4_grouped_gemm`,
`moe_experts`, `fp4_decode_attention`, `write_kv`, `fused_quantize`), so that
`trace_jax.kernels.<module>` is always the module.
"""

from trace_jax.kernels import triton_divide  # fp4.true_divide inside kernels: div.rn.f32
from trace_jax.kernels import (
  decode_attention,
  dispatch,
  gemm,
  grouped_gemm,
  kv_write,
  launch,
  layout,
  moe,
  moe_bf16,
  probe,
  quantize,
  routing,
)
from trace_jax.kernels.decode_attention import decode_attention as fp4_decode_attention
from trace_jax.kernels.dispatch import (
  IMPLEMENTATIONS,
  KERNEL_MODES,
  check_mode,
  resolve,
  resolve_with_reason,
)
from trace_jax.kernels.gemm import fp4_gemm
from trace_jax.kernels.grouped_gemm import fp4_grouped_gemm
from trace_jax.kernels.kv_write import write_kv
from trace_jax.kernels.moe import moe_experts
from trace_jax.kernels.quantize import quantize as fused_quantize
