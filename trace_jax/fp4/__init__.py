"""FP4 numerics: NVFP4 and MXFP4 block-scaled quantization (DESIGN.md section 1), and the
MXFP8 E4M3 activations of W4A8 (`fp8`).

All FP4 format math in trace_jax lives in this package.
"""

from trace_jax.fp4.fp8 import FP8_BLOCK_SIZE, fake_quant_fp8, fp8_values
from trace_jax.fp4.numerics import (
  E2M1_GRID,
  E2M1_MAX,
  E4M3_MAX,
  NVFP4_RANGE,
  e2m1_decode,
  e4m3_decode,
  e4m3_encode,
  e8m0_decode,
  e8m0_encode,
  pack_bits,
  pack_codes,
  unpack_bits,
  unpack_codes,
)
from trace_jax.fp4.qarray import (
  FORMATS,
  CompactGuidance,
  Format,
  QArray,
  block_scaled_values,
  codes,
  compact_guidance,
  dequantize,
  get_format,
  mantissa_bits,
)
from trace_jax.fp4.sparse import (
  DEFAULT_DELTA,
  DEFAULT_SCALE_DELTA,
  ENCODINGS,
  SparseGuidance,
  SparseSpec,
  sparse_guidance,
)
from trace_jax.fp4.spec import RECORD_FORMS, ROUNDING_MODES, SCALE_RULES
from trace_jax.fp4.quantize import (
  fake_quant,
  fake_quant_record,
  quantize,
  quantize_with_fallbacks,
)
