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
