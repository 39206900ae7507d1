"""Pallas kernels for the FP4 hot path (DESIGN.md section 7).

Each module holds a kernel and its `reference()` (the same math in plain XLA); every kernel
takes `interpret=` (default: interpret mode unless on a GPU) and `poison=` (tests). Without
kernels the model dequantizes and runs XLA dots (`experiments/bench_kernels.py` times both).

  fp4_matmul        x [M, K] (bf16, or FP4 per token) @ FP4 weight [K, N]
  moe_gmm           grouped matmul over FP4 expert weights (ragged_dot semantics)
  decode_attention  one query token over the FP4 KV cache, flash-decoding splits
  quantize          fused per-token NVFP4/MXFP4 quantization + compact guidance bits

`dispatch.resolve("auto" | "pallas" | "xla")` picks the implementation (`resolve_with_reason`
also says why "auto" fell back to XLA); the model and the rollout engine take it as
`kernels=`. On a GPU the kernels compile through Pallas' Triton backend; `cuda_lowering`
lowers them for CUDA, and compiles them to sm_90 cubins, on a machine without a GPU.
"""

from trace_jax.kernels import decode_attention as decode_attention_lib
from trace_jax.kernels import fp4_matmul as fp4_matmul_lib
from trace_jax.kernels import moe_gmm as moe_gmm_lib
from trace_jax.kernels import quantize as quantize_lib
from trace_jax.kernels.decode_attention import decode_attention
from trace_jax.kernels.dispatch import KERNEL_MODES, check_mode, resolve, resolve_with_reason
from trace_jax.kernels.fp4_matmul import fp4_matmul
from trace_jax.kernels.moe_gmm import moe_gmm
from trace_jax.kernels.quantize import quantize
