"""Reading compressed-tensors FP4 tensors (the from_hf hook): decoding and bad input."""

import jax
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax.model import compressed

NV = {
  "quantization_config": {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "config_groups": {"group_0": {"format": "nvfp4-pack-quantized"}},
  }
}


def _module(w, fmt="nvfp4"):
  q = fp4.quantize(w, fmt, axis=-1)  # HF layout [out, in], quantized along in
  out = {
    "m.weight_packed": np.asarray(q.packed),
    "m.weight_scale": np.asarray(q.scales),
    "norm.weight": np.ones(4, np.float32),
  }
  if fmt == "nvfp4":
    out["m.weight_global_scale"] = np.asarray(q.global_scale).reshape(1)
  return q, out


def test_decompress_gives_the_dequantized_weight_and_leaves_plain_tensors():
  w = jax.random.normal(jax.random.key(0), (8, 64)) * 0.05
  q, tensors = _module(w)
  tensors["m.input_global_scale"] = np.ones(1, np.float32)  # W4A4: read and dropped
  out = compressed.decompress(NV, tensors)
  assert set(out) == {"m.weight", "norm.weight"}
  np.testing.assert_array_equal(out["m.weight"], fp4.dequantize(q))
  mx = {
    "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
  }
  q, tensors = _module(w, "mxfp4")
  np.testing.assert_array_equal(compressed.decompress(mx, tensors)["m.weight"], fp4.dequantize(q))
  assert compressed.decompress({}, {"a": 1}) == {"a": 1}


def test_bad_checkpoints_are_refused_with_the_reason():
  with pytest.raises(ValueError, match="quant_method='gptq'"):
    compressed.quantized_format({"quantization_config": {"quant_method": "gptq"}})
  bad = {"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized"}}
  with pytest.raises(ValueError, match="int-quantized"):
    compressed.quantized_format(bad)
  _, tensors = _module(jax.random.normal(jax.random.key(1), (4, 32)))
  with pytest.raises(ValueError, match="weight_zero_point"):
    compressed.decompress(NV, {**tensors, "m.weight_zero_point": np.zeros(1)})
  tensors["m.weight_scale"] = tensors["m.weight_scale"][:, :1]
  with pytest.raises(ValueError, match="weight_scale has shape"):
    compressed.decompress(NV, tensors)
  with pytest.raises(ValueError, match="no \\*.weight_packed"):
    compressed.decompress(NV, {"norm.weight": np.ones(4)})
