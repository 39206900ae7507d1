"""The model's seam (one QuantConfig, one Guidance, a ModelOutput), guarded in a form
that holds bit for bit on any x86 CPU.

The first guard compared every output of today's model with arrays recorded by the code
before the seam (main at 9ce547c) on an AMD EPYC. On an Intel Xeon (AVX-512, AMX) 31 FP4
codes differed: the test pinned what one CPU's code generation decides.

What depends on the CPU, and what does not:
- XLA's CPU code generation depends on the instruction set: dot products (Eigen / oneDNN
  blocking, AMX tiles for bf16), the order of float sum reductions (the vector width),
  contraction of `a * b + c` into one FMA, and its own exp / log / logistic / rsqrt
  approximations. So logits, log-probs, router scores, every activation of the model, and
  the FP4 codes of those activations (FP4 rounding turns an ulp at a rounding boundary into
  a grid step) may differ between CPUs. None of them is compared with stored values here.
- The FP4 functions (`trace_jax.fp4`) are operations that each round once (true
  divisions, one product, products by powers of two, max reductions, comparisons, integer
  arithmetic on float bits): no sum, no product followed by an add (nothing to contract
  into an FMA), no transcendental; subnormals are flushed on every x86 CPU XLA runs on.
  Their output for given input bits is the same on every CPU and at every XLA
  optimisation level.

So the guard now has two parts:
1. Pinned: the site inputs that the pre-seam code recorded (stored float32,
   tests/fixtures/seam/records.npz, taken from the golden arrays of 9ce547c, commit
   f424a89) and its records of them. Today's fp4 functions (the ones every site calls)
   reproduce those records bit for bit.
2. Compared within one process: every record a forward (or a rollout) returns is the FP4
   of the input it returns beside it, bit for bit; the training path guided by a
   rollout's records is the guided FP4 of its own inputs, reuses the rollout's scales and
   routing, and takes the rollout's code (full) or mantissa bit (compact) at every element
   it does not report as a fallback. Both sides of each comparison are fp4 functions of
   the same stored bits, so these hold on any CPU as long as the model hands its quantizer
   the value it stores as the input. With float32 compute it does (where XLA computes the
   value twice, in two fusions, it runs the same instructions on the same CPU). With bf16
   compute XLA may skip the rounding to bf16 inside the quantizing fusion (excess
   precision), so before the fix of the input's rounding the quantizer saw another value
   than the stored one; now every site quantizes and returns one materialised float32
   value (`quantizer.site_input`), so the bf16 cases hold bit for bit too. Two checks have
   tolerances, not bits: guided training falls back at under 1% of the elements, and its
   log-probs stay within 1e-2 of the rollout's on average.
The first guard ran at XLA's default optimisation, in a subprocess, only because its
arrays had been made there. These checks are properties that hold at any level, so they
run at the suite's level (tests/conftest.py). The rollout cases compile two engines and
are marked slow:
  PYTHONPATH=$PWD pytest -n 0 -q -m slow tests/model/test_seam_golden.py
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import fp4
from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.training.forward import training_forward

_RECORDS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "seam", "records.npz")
_QARRAY_FIELDS = ("packed", "scales", "global_scale")
_COMPACT_FIELDS = ("mantissa_bits", "scales", "global_scale")


def _assert_same_bits(got, want, what: str) -> None:
  """Every array field of two fp4 records equal bit for bit (NaN == NaN, -0 != +0)."""
  assert type(got) is type(want), what
  fields = _QARRAY_FIELDS if isinstance(want, fp4.QArray) else _COMPACT_FIELDS
  for field in fields:
    a, b = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
    assert a.dtype == b.dtype and a.shape == b.shape, (what, field, a.shape, b.shape)
    np.testing.assert_array_equal(
      a.view(np.uint8), b.view(np.uint8), err_msg=f"{what} {field}: bits differ"
    )


def _pinned():
  """{(layer, site): (input float32, the pre-seam code's full record of it)}."""
  with np.load(_RECORDS) as data:
    arrays = {name: data[name] for name in data.files}
  keys = sorted({tuple(name.split("/")[1:]) for name in arrays if name.startswith("input/")})
  return {
    (int(layer), site): (
      arrays[f"input/{layer}/{site}"],
      fp4.QArray(
        **{f: arrays[f"{f}/{layer}/{site}"] for f in _QARRAY_FIELDS}, fmt="nvfp4", axis=-1
      ),
    )
    for layer, site in keys
  }


@jax.jit
def _every_site_function(x, record):
  """What each fp4 function a site may call makes of rows x [R, n]: quantize, both record
  forms of fake_quant_record (with their values and fallbacks), and guided quantization by
  the full and the compact record."""
  compact = fp4.compact_guidance(record)
  values, full, full_fell = fp4.fake_quant_record(x, form="full", global_group="row")
  _, compact_record, _ = fp4.fake_quant_record(x, form="compact", global_group="row")
  guided_full = fp4.quantize_with_fallbacks(x, rounding="guided", guidance=record)
  guided_compact = fp4.quantize_with_fallbacks(x, rounding="guided", guidance=compact)
  return dict(
    quantize=(fp4.quantize(x, global_group="row"), record),
    fake_quant_record_full=(full, record),
    fake_quant_record_compact=(compact_record, compact),
    guided_by_full=(guided_full[0], record),
    guided_by_compact=(guided_compact[0], record),
    values=(values, fp4.dequantize(record)),
    fell_back=(full_fell | guided_full[1] | guided_compact[1]),
  )


def _as_rows(x, q: fp4.QArray):
  """Per-row NVFP4 rows are independent: x [..., n] and its record as [R, n] rows."""
  n = x.shape[-1]
  rows = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
  return (
    rows(x),
    fp4.QArray(**{f: rows(getattr(q, f)) for f in _QARRAY_FIELDS}, fmt=q.fmt, axis=-1),
    n,
  )


def test_pre_seam_records_are_reproduced_by_the_fp4_functions():
  """Machine-independent pin: the tiny model's FP4 records (every site of both layers,
  NVFP4, one global scale per row) that the code before the seam made of its own inputs,
  reproduced by every fp4 function a site calls; guided by its own record, an input falls
  back nowhere."""
  pinned = _pinned()
  assert set(pinned) == {
    (layer, site)
    for layer in (0, 1)
    for site in ("attn_in", "attn_out", "k", "v", "moe_in", "moe_mid")
  }
  by_width = {}  # rows of one width, stacked: one compile per width
  for key, (x, q) in sorted(pinned.items()):
    x, q, n = _as_rows(x, q)
    by_width.setdefault(n, []).append((key, x, q))
  assert sorted(by_width) == [16, 64]
  for n, parts in by_width.items():
    x = jnp.asarray(np.concatenate([x for _, x, _ in parts]))
    record = jax.tree.map(lambda *a: np.concatenate(a), *[q for _, _, q in parts])
    results = _every_site_function(x, record)
    assert not np.asarray(results.pop("fell_back")).any()
    got, want = results.pop("values")
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    for what, (got, want) in results.items():
      _assert_same_bits(got, want, f"rows of {n} ({[k for k, _, _ in parts]}): {what}")


def _tokens():
  return jax.random.randint(jax.random.key(0), (2, 12), 0, 128)


_MOE = ("attn_in", "attn_out", "k", "v", "moe_in", "moe_mid")
_DENSE = ("attn_in", "attn_out", "k", "v", "mlp_in", "mlp_mid")
# name: (model config, seed, QuantConfig and CallOptions fields, recording form, the sites each layer
# records: those of the pre-seam golden arrays). Among them: full and compact records, MoE,
# dense and shared-expert sites, a hybrid model's method scope, float32 and bf16 compute.
_FORWARDS = {
  "tiny-full-bf16": (M.tiny(), 0, dict(compute_dtype="bfloat16"), "full", {0: _MOE, 1: _MOE}),
  "dense-shared-expert-full-f32": (
    M.tiny(
      qk_norm="full",
      clip_qkv=0.5,
      tie_embeddings=True,
      shared_expert_dim=32,
      shared_expert_gate=True,
      dense_layers=(0,),
      ffn_dim=64,
      num_layers=3,
    ),
    1,
    {},
    "full",
    {0: _DENSE, 1: _MOE + ("shared_mid",), 2: _MOE + ("shared_mid",)},
  ),
  "hybrid-experts+kv-compact-f32": (
    M.qwen3_5_tiny(),
    2,
    dict(sites="experts+kv"),
    "compact",
    {0: _MOE[4:], 1: _MOE[4:], 2: _MOE[4:], 3: _MOE[2:]},
  ),
}


@pytest.mark.parametrize("name", sorted(_FORWARDS))
def test_forward_records_are_the_fp4_of_the_inputs_it_returns(name):
  """One forward that records every FP4 site and its input: each record (full QArray, or
  compact bits and scales) is `fp4.quantize` of that input, per row, bit for bit."""
  cfg, seed, fields, form, layer_sites = _FORWARDS[name]
  quant = M.QuantConfig(**{k: v for k, v in fields.items() if k != "compute_dtype"})
  options = M.CallOptions(
    recording=M.Recording(form=form, inputs=True), compute_dtype=fields.get("compute_dtype")
  )
  out = nnx.jit(lambda m, t: m(t, quant=quant, options=options))(
    M.Transformer(cfg, rngs=nnx.Rngs(seed)), _tokens()
  )
  expected = {(layer, site) for layer, sites in layer_sites.items() for site in sites}
  assert set(out.sites) == expected and set(out.site_inputs) == expected
  for key in sorted(expected):
    x = out.site_inputs[key]
    assert x.dtype == jnp.float32, key  # as the quantizer read it (quantizer.site_input)
    want = fp4.quantize(x, global_group="row")
    if form == "compact":
      want = fp4.compact_guidance(want)
    _assert_same_bits(out.sites[key], want, f"{name} {key}")


# --- The rollout path and the training path it guides (slow: two engines) ----------------


def _prompts():
  rng = np.random.default_rng(5)
  return [rng.integers(1, 128, rng.integers(3, 9)).tolist() for _ in range(3)]


# name: (model config, seed, rollout guidance, compute dtype, sampling key)
_ROLLOUTS = {
  "tiny-compact-bf16": (M.tiny(), 0, "compact", "bfloat16", 4),
  "hybrid-full-f32": (M.qwen3_5_tiny(), 2, "full", "float32", 6),
}


@pytest.fixture(scope="module")
def rollouts():
  """Each case's (policy, rollout) made once: FP4 rollout, guidance of every layer with
  routing, and the site inputs the rollout quantized."""
  made = {}

  def get(name):
    if name not in made:
      cfg, seed, guidance, dtype, key = _ROLLOUTS[name]
      policy = M.Transformer(cfg, rngs=nnx.Rngs(seed))
      config = R.RolloutConfig(
        precision="fp4",
        max_len=24,
        prompt_bucket=8,
        kernels="xla",
        guidance=guidance,
        guided_layers="all",
        compute_dtype=dtype,
        sampling=R.SamplingConfig(temperature=1.0, max_new_tokens=6),
      )
      engine = R.RolloutEngine(policy, config, capture_inputs=True)
      made[name] = (policy, engine.generate(_prompts(), jax.random.key(key)))
    return made[name]

  return get


def _rows(mask, shape):
  """The [B, S] token mask broadcast over a site's row axes (shape [B, S, ..., n])."""
  mask = np.asarray(mask, bool)
  return np.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - 3)), shape[:-1])


def _real_rows(record, mask):
  """The record's fields at the real tokens' rows (padding slots hold stale bits)."""
  fields = _QARRAY_FIELDS if isinstance(record, fp4.QArray) else _COMPACT_FIELDS
  rows = _rows(mask, record.global_scale.shape[:-1] + (1,))
  return {f: np.asarray(getattr(record, f))[rows] for f in fields}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_ROLLOUTS))
def test_rollout_records_are_the_fp4_of_its_inputs(rollouts, name):
  """Prefill and decode steps: at every real token, each captured record is the FP4 of
  the site input the rollout recorded for it."""
  _, rollout = rollouts(name)
  mask = np.asarray(rollout.mask)
  assert mask[:, 8:].any()  # decode steps were captured
  for key, record in rollout.guidance.sites.items():
    want = fp4.quantize(rollout.site_inputs[key], global_group="row")
    if rollout.guidance.mode == "compact":
      want = fp4.compact_guidance(want)
    got, expected = _real_rows(record, mask), _real_rows(want, mask)
    for field, value in expected.items():
      np.testing.assert_array_equal(
        got[field].view(np.uint8), value.view(np.uint8), err_msg=f"{name} {key} {field}"
      )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_ROLLOUTS))
def test_guided_training_path_reproduces_the_rollout(rollouts, name):
  """The training path over the rollout's trajectories, guided at every layer with routing
  replay (its own activations, its own shapes and kernels), against the rollout:
  - its records are `fp4.quantize(its own input, rounding="guided", guidance=the rollout's
    record)`, fallbacks included, bit for bit;
  - it reuses the rollout's global and block scales, bit for bit;
  - where it does not fall back it takes the rollout's code (full guidance) or the
    rollout's mantissa bit (compact), and almost nowhere does it fall back;
  - it routes every token to the rollout's experts, and its log-probs stay close."""
  policy, rollout = rollouts(name)
  _, _, _, dtype, _ = _ROLLOUTS[name]
  quant = M.QuantConfig(rounding="guided", guided_layers="all")
  options = M.CallOptions(compute_dtype=dtype, recording=M.Recording(form="full", inputs=True))
  logp, out = nnx.jit(
    lambda m, r, g: training_forward(
      m,
      r.tokens,
      r.positions,
      r.mask,
      quant=quant,
      guidance=g,
      routing_replay=True,
      options=options,
    )
  )(policy, rollout.without_cache(), rollout.guidance)
  mask = np.asarray(rollout.mask)
  guidance = rollout.guidance
  assert set(out.sites) == set(guidance.sites) == set(out.fallbacks)
  fell, elements = 0, 0
  for key, record in guidance.sites.items():
    train = out.sites[key]
    want, want_fell = fp4.quantize_with_fallbacks(
      out.site_inputs[key], global_group="row", rounding="guided", guidance=record
    )
    _assert_same_bits(train, want, f"{name} {key} guided record")
    np.testing.assert_array_equal(out.fallbacks[key], want_fell, err_msg=f"{name} {key}")
    real = _real_rows(train, mask)
    recorded = _real_rows(record, mask)
    for field in ("scales", "global_scale"):
      np.testing.assert_array_equal(real[field].view(np.uint8), recorded[field].view(np.uint8))
    rows = _rows(mask, record.shape)
    codes = np.asarray(fp4.codes(train))[rows]
    followed = ~np.asarray(out.fallbacks[key])[rows]
    if isinstance(record, fp4.QArray):
      np.testing.assert_array_equal(codes[followed], np.asarray(fp4.codes(record))[rows][followed])
    else:
      bits = np.asarray(fp4.unpack_bits(record.mantissa_bits))[rows]
      np.testing.assert_array_equal((codes & 1)[followed], bits[followed])
    fell += int((~followed).sum())
    elements += followed.size
  assert elements > 0 and fell <= 0.01 * elements, (fell, elements)
  replayed = np.asarray(out.routing)
  np.testing.assert_array_equal(
    replayed[:, mask], np.asarray(guidance.routing).astype(replayed.dtype)[:, mask]
  )
  response = np.asarray(rollout.response_mask)
  diff = np.abs(np.asarray(logp) - np.asarray(rollout.logprobs))[response]
  assert diff.size and diff.mean() < 1e-2, diff
