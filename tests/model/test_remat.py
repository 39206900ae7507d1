"""ModelConfig.remat: the same loss and gradients as the unrolled model, fewer kept residuals,
also when the forward records its sites."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax.extend

from trace_jax import guidance as G
from trace_jax import model as M
from trace_jax.model.quant import CallOptions, QuantConfig, Recording
from trace_jax.plan import _dependent_residual_bytes
from trace_jax.training.forward import training_forward


def _loss(model, tokens, quant):
  aux = model(tokens[:, :-1], quant=quant)
  logp = jax.nn.log_softmax(aux.logits)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)) + 0.01 * aux.lb_loss


@pytest.mark.parametrize(
  "preset", [pytest.param(p, marks=pytest.mark.slow) for p in ("tiny", "qwen3_5_tiny")]
)
def test_remat_matches_unrolled(preset):
  quant = QuantConfig()  # FP4 QAT: the straight-through quantizers run under remat too
  tokens = jax.random.randint(jax.random.key(1), (2, 13), 0, 128)
  results = []
  for remat in (False, True):
    model = M.Transformer(M.get_preset(preset, remat=remat), rngs=nnx.Rngs(0))
    loss, grads = jax.jit(lambda m, t: nnx.value_and_grad(_loss)(m, t, quant))(model, tokens)
    results.append((loss, nnx.to_pure_dict(grads)))
  (loss, grads), (remat_loss, remat_grads) = results
  assert float(jnp.abs(loss)) > 0 and np.isfinite(float(loss))
  chex.assert_trees_all_close(remat_loss, loss, rtol=1e-6)
  chex.assert_trees_all_close(
    remat_grads, grads, rtol=1e-4, atol=1e-6
  )  # recompute: fused differently


def test_remat_keeps_fewer_activations():
  quant = QuantConfig()
  tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)

  def kept(remat):
    model = nnx.eval_shape(lambda: M.Transformer(M.tiny(remat=remat), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    fn = lambda s, t: _loss(nnx.merge(graphdef, s), t, quant)
    return _dependent_residual_bytes(fn, (state, tokens), {1})

  assert kept(True) < kept(False) / 2


def _remat_prims(jaxpr, only_in_scan=False) -> int:
  """How many remat (jax.checkpoint) equations a jaxpr holds, nested ones included; with
  `only_in_scan`, only those inside a scan's body (which run once per scanned layer)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name in ("remat2", "checkpoint") and not only_in_scan
    still_outside = only_in_scan and eqn.primitive.name != "scan"
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          count += _remat_prims(sub, still_outside)
  return count


def _scan_lengths(jaxpr) -> list[int]:
  """The lengths of the scans a jaxpr holds outside any scan, nested calls included."""
  lengths = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      lengths.append(eqn.params["length"])
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        sub = sub.jaxpr if isinstance(sub, jax.extend.core.ClosedJaxpr) else sub
        if isinstance(sub, jax.extend.core.Jaxpr):
          lengths += _scan_lengths(sub)
  return lengths


def _batch(cfg, seed, b=2, t=12):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  weights = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)  # any cotangent will do
  return tokens, positions, jnp.ones((b, t), bool), weights


def _objective(model, batch, quant, guidance=None, options=None):
  """(a scalar of the training path's log-probs, its ModelOutput) of `training_forward`."""
  tokens, positions, mask, weights = batch
  logp, out = training_forward(
    model,
    tokens,
    positions,
    mask,
    quant=quant,
    guidance=guidance,
    routing_replay=guidance is not None,
    options=options,
  )
  return jnp.sum(logp * weights) + 0.01 * out.lb_loss, out


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("form", ["none", "compact", "full"])
def test_remat_runs_when_sites_are_recorded(form, scan):
  """The gradient of a recording training forward rematerialises its blocks, as a forward
  that records nothing does (a recording forward once dropped remat silently): one remat per
  block unrolled, and under a scan one remat in the scan's body, which runs once per layer."""
  cfg = M.tiny(remat=True, scan_layers=scan)
  model = nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  options = CallOptions(recording=Recording(form=form))
  batch = _batch(cfg, 0)
  grad = lambda s: nnx.grad(_objective, has_aux=True)(  # noqa: E731
    nnx.merge(graphdef, s), batch, QuantConfig(), None, options
  )
  jaxpr = jax.make_jaxpr(grad)(state).jaxpr
  if scan:  # scans over every layer (the forward and its transpose), the body's remat the only one
    assert set(_scan_lengths(jaxpr)) == {cfg.num_layers}
    assert _remat_prims(jaxpr, only_in_scan=True) == _remat_prims(jaxpr) == 1
  else:
    assert _remat_prims(jaxpr) == cfg.num_layers


def _run(remat, batch, quant, options, guidance, compute_dtype):
  model = M.Transformer(M.tiny(remat=remat, dtype=compute_dtype), rngs=nnx.Rngs(4))
  step = nnx.jit(nnx.value_and_grad(_objective, has_aux=True), static_argnums=(2, 4))
  (loss, out), grads = step(model, batch, quant, guidance, options)
  return loss, out, nnx.to_pure_dict(grads)


def _guidance(batch):
  """Compact guidance of every layer and the routing, from a recording forward of the batch."""
  model = M.Transformer(M.tiny(), rngs=nnx.Rngs(9))
  tokens, positions, mask, _ = batch
  out = nnx.jit(
    lambda m: m(tokens, positions=positions, mask=mask, quant=QuantConfig(), options=FULL)
  )(model)
  layers = tuple(range(model.cfg.num_layers))
  return G.Guidance(
    sites=G.from_records(out.sites, "compact", layers),
    routing=out.routing,
    mode="compact",
    layers=layers,
  )


FULL = CallOptions(recording=Recording(form="full"))
_CASES = {
  "compact": (QuantConfig(), Recording(form="compact"), False),
  "full+guided": (
    QuantConfig(rounding="guided", guided_layers="all"),
    Recording(form="full", inputs=True),
    True,
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(_CASES))
def test_remat_with_recording_matches_unrolled(case):
  """Remat with recorded sites computes what the unrolled model computes, in bf16 (the RL
  default): the same loss, logits, routing, records, guidance fallbacks and site inputs,
  bits included. Its gradient is bit for bit the gradient of remat without recording (the
  records leave the rematerialised blocks as outputs; the backward never reads them) and
  close to the unrolled one: the backward recomputes each block in XLA fusions of its own,
  where bf16 values, and with them FP4 codes and per-token scales, may round otherwise. That
  difference is remat's own, the same without recording (measured here: 5.4% relative L2
  for "compact", nearest rounding; much less when guided); float32 compute keeps it at
  1e-6 (`test_remat_matches_unrolled`). Slow: six compiles of a training step (~1.5 min).
  """
  quant, recording, guided = _CASES[case]
  batch = _batch(M.tiny(), 1)
  guidance = _guidance(batch) if guided else None
  options = CallOptions(compute_dtype="bfloat16", recording=recording)
  loss, out, grads = _run(False, batch, quant, options, guidance, "bfloat16")
  remat_loss, remat_out, remat_grads = _run(True, batch, quant, options, guidance, "bfloat16")
  assert out.sites and (out.fallbacks if guided else True)
  for name in ("logits", "routing", "sites", "fallbacks", "site_inputs"):
    chex.assert_trees_all_equal(getattr(remat_out, name), getattr(out, name))
  chex.assert_trees_all_equal(remat_loss, loss)
  plain = options.replace(recording=Recording())
  _, plain_out, plain_grads = _run(True, batch, quant, plain, guidance, "bfloat16")
  assert not plain_out.sites
  chex.assert_trees_all_equal(remat_grads, plain_grads)
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]).astype(np.float64)
  diff = np.linalg.norm(flat(remat_grads) - flat(grads)) / np.linalg.norm(flat(grads))
  assert diff < 0.1, diff
