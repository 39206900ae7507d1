"""Export of trained FP4 policies in the formats serving engines load (compressed-tensors), and
synthetic checkpoints of any size in the Hugging Face layout (load and scale checks)."""

from trace_jax.export.calibration import calibrate_input_scales, input_scale_distance
from trace_jax.export.compressed_tensors import (
  ExportConfig,
  export_compressed_tensors,
  quantization_config,
  tensor_listing,
)
from trace_jax.export.names import hf_config
from trace_jax.export.synthetic import write_synthetic_checkpoint
