"""Softmax attention (model.attention.attend): masked slots never leak, NaN stays visible."""

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.model.attention import attend


def _inputs(seed=0, b=2, t=5, s=9, h=4, hkv=2, dh=8):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, t, h, dh))
  k = jax.random.normal(kk, (b, s, hkv, dh))
  v = jax.random.normal(kv, (b, s, hkv, dh))
  # Query t sees slots [0, 5 + t) except slot 2 (a stale slot); row 1 of batch 1 is padding.
  slots = np.arange(s)[None, None, :]
  mask = (slots < 5 + np.arange(t)[None, :, None]) & (slots != 2)
  mask = np.broadcast_to(mask, (b, t, s)).copy()
  mask[1, 1] = False
  return q, k, v, jnp.asarray(mask)


def _reference(q, k, v, mask):
  """Attention over the visible slots only, in float64 NumPy."""
  q, k, v, mask = (
    np.asarray(a, np.float64) if a.dtype != bool else np.asarray(a) for a in (q, k, v, mask)
  )
  b, t, h, dh = q.shape
  group = h // k.shape[2]
  out = np.zeros((b, t, h, dh))
  for bi in range(b):
    for ti in range(t):
      seen = np.flatnonzero(mask[bi, ti])
      for hi in range(h):
        if not len(seen):
          continue
        kv = hi // group
        scores = k[bi, seen, kv] @ q[bi, ti, hi] / np.sqrt(dh)
        p = np.exp(scores - scores.max())
        out[bi, ti, hi] = (p / p.sum()) @ v[bi, seen, kv]
  return out


def test_nan_in_masked_slots_does_not_leak():
  q, k, v, mask = _inputs()
  clean = attend(q, k, v, mask)
  # Slot 2 is masked for every query; slot 8 is masked for all but the last query.
  poisoned_v = v.at[:, 2].set(jnp.nan).at[0, 8, 1].set(jnp.inf)
  poisoned_k = k.at[:, 2].set(jnp.nan)
  out = np.asarray(attend(q, poisoned_k, poisoned_v, mask))
  # Queries 0..3 never see slot 8: exactly the clean output; query 4 of batch 0 sees the
  # Inf in slot 8 (KV head 1 = query heads 2, 3) and must show it as NaN.
  valid_rows = np.asarray(mask).any(-1)  # all but the padding query [1, 1]
  np.testing.assert_array_equal(
    out[:, :4][valid_rows[:, :4]], np.asarray(clean)[:, :4][valid_rows[:, :4]]
  )
  np.testing.assert_array_equal(out[1, 4], np.asarray(clean)[1, 4])
  assert np.isnan(out[0, 4, 2:]).all() and np.isfinite(out[0, 4, :2]).all()
  np.testing.assert_allclose(
    out[:, :4][valid_rows[:, :4]],
    _reference(q, k, v, mask)[:, :4][valid_rows[:, :4]],
    rtol=1e-5,
    atol=1e-6,
  )


def test_fully_masked_padding_row_stays_finite():
  q, k, v, mask = _inputs(seed=1)
  v = v.at[:, 2].set(jnp.nan)
  out = np.asarray(jax.jit(attend)(q, k, v, mask))
  assert np.isfinite(out[1, 1]).all()  # the padding query, uniform over all slots


def _decode_inputs(seed):
  """One query per sequence over 11 slots: sequence 0 sees slots [0, 7), sequence 1
  slots [0, 3) and 5, sequence 2 none (a padding row)."""
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (3, 1, 4, 8))
  k = jax.random.normal(kk, (3, 11, 2, 8))
  v = jax.random.normal(kv, (3, 11, 2, 8))
  mask = np.zeros((3, 1, 11), bool)
  mask[0, 0, :7] = True
  mask[1, 0, [0, 1, 2, 5]] = True
  return q, k, v, jnp.asarray(mask)


def test_a_decode_step_matches_the_reference_and_hides_masked_nan():
  q, k, v, mask = _decode_inputs(seed=3)
  out = np.asarray(jax.jit(attend)(q, k, v, mask))
  np.testing.assert_allclose(out[:2], _reference(q, k, v, mask)[:2], rtol=1e-5, atol=1e-6)
  # The same query attended as one of several (the general path): the same bits.
  wide_mask = jnp.concatenate([mask, mask], axis=1)
  wide = np.asarray(attend(jnp.concatenate([q, q], axis=1), k, v, wide_mask))
  np.testing.assert_array_equal(out[:, 0], wide[:, 0])
  # NaN and Inf in slots a sequence does not see change nothing; in a seen slot, NaN.
  bad_v = v.at[0, 9].set(jnp.nan).at[1, 4, 0].set(jnp.inf).at[1, 5, 1, 3].set(jnp.nan)
  got = np.asarray(jax.jit(attend)(q, k, bad_v, mask))
  np.testing.assert_array_equal(got[0], out[0])
  heads = q.shape[2] // k.shape[2]
  np.testing.assert_array_equal(got[1, 0, :heads], out[1, 0, :heads])  # KV head 0 clean
  assert np.isnan(got[1, 0, heads:, 3]).all()  # KV head 1 sees the NaN in slot 5
  assert np.isfinite(out[2]).all()  # the padding row: a uniform mean over every slot
  np.testing.assert_allclose(
    out[2, 0], np.repeat(np.asarray(v[2]).mean(0), heads, axis=0), rtol=1e-5, atol=1e-6
  )


def _ops_on(jaxpr, tainted: set, found: list) -> set:
  """Appends to `found` the primitives applied to values derived from `tainted` (inside
  nested jit calls too), up to and including the products; returns the tainted outputs."""
  tainted = set(tainted)
  for eqn in jaxpr.eqns:
    hits = [i for i, a in enumerate(eqn.invars) if not hasattr(a, "val") and a in tainted]
    if not hits:
      continue
    inner = eqn.params.get("jaxpr")
    if inner is not None:
      inner = getattr(inner, "jaxpr", inner)
      outs = _ops_on(inner, {inner.invars[i] for i in hits}, found)
      tainted.update(o for o, i in zip(eqn.outvars, inner.outvars) if i in outs)
      continue
    found.append(eqn.primitive.name)
    if eqn.primitive.name != "dot_general":  # the product is where V's read ends
      tainted.update(eqn.outvars)
  return tainted


def test_a_decode_step_reads_v_once():
  """Between the cache's V and the product, one elementwise select (the unseen slots
  zeroed, which XLA fuses into the product's operand): no finiteness pass over V."""
  q, k, v, mask = _decode_inputs(seed=4)
  jaxpr = jax.make_jaxpr(attend)(q, k, v, mask).jaxpr
  found: list = []
  _ops_on(jaxpr, {jaxpr.invars[2]}, found)
  assert found == ["select_n", "dot_general"], found
