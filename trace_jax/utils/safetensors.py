"""The safetensors format's dtype codes, read by the checkpoint loader and the export.

A .safetensors file is a JSON header ({name: {"dtype": code, "shape", "data_offsets"}})
followed by the raw little-endian bytes; the codes are the format's own names.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# safetensors dtype code -> the NumPy dtype its bytes are.
DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "BOOL": np.bool_,
  "F8_E4M3": ml_dtypes.float8_e4m3fn,
}


def codes_of(codes) -> dict[np.dtype, str]:
  """{NumPy dtype: safetensors code} for the given codes (a writer's supported subset)."""
  return {np.dtype(DTYPES[code]): code for code in codes}
