"""Model and quantization configs: validation, presets, published parameter counts."""

import math

import jax
import pytest
from flax import nnx

from trace_jax import model as M


@pytest.mark.parametrize(
  "preset, published_billions",
  [("qwen3_30b_a3b", 30.5), ("mixtral_8x7b", 46.7), ("olmoe_1b_7b", 6.9)],
)
def test_published_geometries_match_published_parameter_counts(preset, published_billions):
  cfg = M.get_preset(preset)
  abstract = nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0)))
  count = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(abstract)))
  assert abs(count / 1e9 - published_billions) < 0.05 * published_billions


@pytest.mark.parametrize(
  "overrides, match",
  [
    (dict(num_kv_heads=3), "num_kv_heads=3"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(qk_norm="layer"), "qk_norm='layer'"),
    (dict(dtype="float16"), "dtype='float16'"),
    (dict(dispatch="sparse"), "dispatch='sparse'"),
    (dict(dense_layers=(5,)), "dense_layers"),
    (dict(d_model=0), "d_model=0"),
    (dict(arch="llama"), "arch='llama'"),
  ],
)
def test_model_config_rejects_bad_fields(overrides, match):
  with pytest.raises(ValueError, match=match):
    M.tiny(**overrides)


def test_unknown_preset_lists_presets():
  with pytest.raises(ValueError, match="tiny"):
    M.get_preset("huge")


def test_quant_config_validation_and_guided_layers():
  with pytest.raises(ValueError, match="precision='fp8'"):
    M.QuantConfig(precision="fp8")
  with pytest.raises(ValueError, match="fmt='int4'"):
    M.QuantConfig(fmt="int4")
  with pytest.raises(ValueError, match="unknown sites"):
    M.QuantConfig(sites=("attn_in", "logits"))
  with pytest.raises(ValueError, match="guided_layers='middle'"):
    M.QuantConfig(guided_layers="middle")
  assert M.resolve_layers("last_half", 40) == tuple(range(20, 40))
  assert M.resolve_layers("last_half", 3) == (1, 2)  # the top ceil(3 / 2)
  assert M.resolve_layers("all", 3) == (0, 1, 2)
  assert M.resolve_layers("none", 3) == ()
  assert M.resolve_layers(2, 5) == (3, 4)
  assert M.resolve_layers([4, 0], 5) == (0, 4)
  with pytest.raises(ValueError, match="outside"):
    M.resolve_layers([7], 5)
  with pytest.raises(ValueError, match=r"\[0, 5\]"):
    M.resolve_layers(6, 5)
  assert not M.QuantConfig(precision="bf16").enabled


def test_last_half_is_the_top_ceil_half_and_never_empty():
  """The deeper half of n layers is the top ceil(n / 2): a 1-layer model used
  to guide nothing (range(1, 1)), silently; odd n now guide the middle layer too."""
  for n in range(0, 42):
    want = tuple(range(n - math.ceil(n / 2), n))  # counted from the top, rounded up
    got = M.resolve_layers("last_half", n)
    assert got == want, n
    assert len(got) >= 1 or n == 0
    assert len(got) >= n - len(got)  # at least as many guided as unguided
  assert M.resolve_layers("last_half", 1) == (0,)
  assert M.resolve_layers("last_half", 5) == (2, 3, 4)
  for n in (2, 4, 16, 32, 40, 48):  # even counts (every preset's) are as before: n // 2 up
    assert M.resolve_layers("last_half", n) == tuple(range(n // 2, n))
