"""Optional: the export read back by the format's own implementation (compressed-tensors).

Skipped unless `compressed-tensors` (it pulls torch) is importable: `pip install -e .[export]`.
Its `QuantizationConfig` validates our quantization_config, the checkpoint loads strictly
(every tensor name and shape the compressor expects, nothing else) into Linear modules
named as in Hugging Face, and its `ModelCompressor` decompresses them to the weights our
rollout multiplies with.
"""

import json
import os

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip(
  "torch", reason="compressed-tensors needs torch: pip install -e .[export]"
)
ct = pytest.importorskip(
  "compressed_tensors", reason="compressed-tensors is not installed: pip install -e .[export]"
)
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from trace_jax import fp4  # noqa: E402
from trace_jax import model as M  # noqa: E402
from trace_jax import rollout as R  # noqa: E402
from trace_jax.export import calibrate_input_scales, export_compressed_tensors  # noqa: E402
from trace_jax.export import names as names_lib  # noqa: E402


def _skeleton(tensors, ignore):
  """torch Linear modules under the checkpoint's module names."""
  root = torch.nn.Module()
  shapes = {}
  for name, value in tensors.items():
    module, field = name.rsplit(".", 1)
    if field == "weight_packed":
      shapes[module] = (value.shape[0], value.shape[1] * 2)
    elif field == "weight" and module in ignore:
      shapes[module] = tuple(value.shape)
  for module, (out, inp) in shapes.items():
    node = root
    *parents, leaf = module.split(".")
    for part in parents:
      if not hasattr(node, part):
        node.add_module(part, torch.nn.Module())
      node = getattr(node, part)
    node.add_module(leaf, torch.nn.Linear(inp, out, bias=False, dtype=torch.bfloat16))
  return root, shapes


@pytest.mark.parametrize(
  "fmt,activations", [("nvfp4", "none"), ("nvfp4", "nvfp4"), ("mxfp4", "none")]
)
def test_compressed_tensors_decompresses_the_export_to_our_weights(fmt, activations, tmp_path):
  policy = M.Transformer(M.tiny(), rngs=nnx.Rngs(7))
  quant = M.QuantConfig(fmt=fmt)
  scales = None
  if activations == "nvfp4":
    tokens = np.random.default_rng(0).integers(0, policy.cfg.vocab_size, (2, 8))
    scales = calibrate_input_scales(policy, quant, tokens)
  out = str(tmp_path / fmt)
  export_compressed_tensors(policy, out, fmt=fmt, activations=activations, input_scales=scales)
  config = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
  qconfig = QuantizationConfig.model_validate(config)
  tensors = load_file(os.path.join(out, "model.safetensors"))
  model, shapes = _skeleton(tensors, config["ignore"])
  apply_quantization_config(model, qconfig)
  compressor = ModelCompressor(quantization_config=qconfig)
  compressor.compress_model(model)  # the parameter layout a compressed checkpoint loads into
  wanted = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] in shapes}
  missing, unexpected = model.load_state_dict(wanted, strict=False)
  assert not missing and not unexpected
  compressor.decompress_model(model)

  packed = R.quantize_params(nnx.state(policy), quant)
  checked = 0
  for path, variable in nnx.to_flat_state(packed):
    value = variable.get_value()
    if not isinstance(value, fp4.QArray):
      continue
    ours = np.asarray(fp4.dequantize(value))
    for target in names_lib.targets(policy.cfg, path):
      theirs = model.get_submodule(target.module).weight.detach().float().numpy()
      want = names_lib.hf_array(ours, target)
      # compressed-tensors decompresses to bf16: equal to ours up to that one rounding.
      np.testing.assert_allclose(theirs, want, rtol=2.0**-8, atol=0, err_msg=target.module)
      checked += 1
  assert checked == policy.cfg.num_layers * (4 + 3 * policy.cfg.num_experts)
  for module in config["ignore"]:  # the router and LM head stay unquantized Linear modules
    assert not hasattr(model.get_submodule(module), "weight_packed")
