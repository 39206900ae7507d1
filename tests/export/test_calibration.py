"""W4A4 export: static input global scales calibrated on rollout activations."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import model as M
from trace_jax.export import calibrate_input_scales, export_compressed_tensors, input_scale_distance
from trace_jax.export.compressed_tensors import tensor_listing


def test_calibrated_scales_cover_the_largest_token_and_export_as_w4a4(tmp_path):
  policy = M.Transformer(M.tiny(), rngs=nnx.Rngs(5))
  quant = M.QuantConfig()
  tokens = jax.random.randint(jax.random.key(0), (3, 12), 0, policy.cfg.vocab_size)
  mask = np.ones((3, 12), bool)
  mask[0, 9:] = False  # padding must not count
  scales = calibrate_input_scales(policy, quant, tokens, mask, dtype=jnp.float32)
  assert {site for _, site in scales} == {"attn_in", "attn_out", "moe_in", "moe_mid"}
  # Independently: 448 * 6 / (largest |x| over valid tokens) of the site inputs.
  graphdef, state = nnx.split(policy)
  from trace_jax.rollout import quantize_params

  aux = nnx.merge(graphdef, quantize_params(state, quant))(
    tokens,
    mask=jnp.asarray(mask),
    quant=quant,
    options=M.CallOptions(compute_dtype="float32", recording=M.Recording(inputs=True)),
  )
  for key, gs in scales.items():
    x = np.abs(np.asarray(aux.site_inputs[key]))
    x = x.reshape(3, 12, -1)[mask]
    np.testing.assert_allclose(gs, 448 * 6 / x.max(), rtol=1e-6, err_msg=str(key))
  distance = input_scale_distance(policy, quant, scales, tokens, mask, dtype=jnp.float32)
  assert distance["saturated_frac"] == 0.0  # calibrated on these very tokens
  assert 0.0 < distance["rel_l2"] < 0.5 and 0.0 < distance["value_diff_frac"] < 1.0
  assert 0.0 < distance["code_diff_frac"] <= distance["value_diff_frac"]
  assert distance["err_static"] >= distance["err_token"] * 0.9
  out = str(tmp_path / "w4a4")
  export_compressed_tensors(policy, out, activations="nvfp4", input_scales=scales)
  rows = {n: (d, s) for n, d, s in tensor_listing(out)}
  name = "model.layers.1.self_attn.{}.input_global_scale"
  assert rows[name.format("q_proj")] == ("F32", (1,))
  qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
  inputs = qc["config_groups"]["group_0"]["input_activations"]
  assert (inputs["strategy"], inputs["dynamic"], inputs["group_size"]) == (
    "tensor_group",
    "local",
    16,
  )
