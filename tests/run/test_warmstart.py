"""The SFT warm start's batch on a mesh (trace_jax/run/warmstart.py): padded to the data axis
with rows that change no loss. (That each device holds its rows is checked on 8 fake
devices in tests/model/test_sharding.py.)"""

import chex
import jax
import numpy as np
from flax import nnx

from trace_jax import model as M
from trace_jax.run import warmstart
from trace_jax.training.sft import sft_batch, sft_loss


def test_padding_rows_change_no_loss():
  rng = np.random.default_rng(16)
  pairs = [
    (
      rng.integers(1, 128, rng.integers(2, 6)).tolist(),
      rng.integers(1, 128, rng.integers(1, 5)).tolist(),
    )
    for _ in range(3)
  ]
  batch = sft_batch(pairs, 12, pad_id=0)
  padded = warmstart.pad_rows(batch, 4)
  assert [a.shape[0] for a in padded] == [4, 4, 4]
  chex.assert_trees_all_equal([a[:3] for a in padded], [np.asarray(a) for a in batch])
  assert not padded[1][3:].any() and not padded[2][3:].any()
  assert all(a.shape[0] == 3 for a in warmstart.pad_rows(batch, 3))  # already a multiple
  model = M.Transformer(M.tiny(), rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  loss = jax.jit(lambda t, l, v: sft_loss(model, t, l, v))
  want, got = loss(*batch), loss(*padded)
  assert float(want[1]) > 0
  chex.assert_trees_all_close(got, want, rtol=1e-6)
