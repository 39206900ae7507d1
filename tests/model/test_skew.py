"""The skew's hash against an independent MurmurHash3 over bytes, its uniformity, and the
multiply it applies (and leaves out of the program at 0)."""

import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax.model.skew import Skew, murmur3_words, skew_uniform


def murmur3_bytes(data: bytes, seed: int = 0) -> int:
  """MurmurHash3_x86_32 as published (SMHasher), over bytes, in plain Python ints."""
  mask = 0xFFFFFFFF
  rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & mask  # noqa: E731
  c1, c2 = 0xCC9E2D51, 0x1B873593
  h = seed
  full = len(data) // 4 * 4
  for i in range(0, full, 4):
    k = int.from_bytes(data[i : i + 4], "little")
    k = rotl((k * c1) & mask, 15) * c2 & mask
    h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & mask
  tail = data[full:]
  if tail:
    k = int.from_bytes(tail, "little")
    h ^= rotl((k * c1) & mask, 15) * c2 & mask
  h ^= len(data)
  h ^= h >> 16
  h = (h * 0x85EBCA6B) & mask
  h ^= h >> 13
  h = (h * 0xC2B2AE35) & mask
  return h ^ (h >> 16)


def reference_u(words) -> float:
  """u of five counters: the hash of their little-endian bytes, top 24 bits to (-1, 1)."""
  h = murmur3_bytes(struct.pack("<5I", *(int(w) % 2**32 for w in words)))
  return ((h >> 8) * 2 + 1) / 2**24 - 1


@pytest.mark.parametrize(
  "data, seed, expected",  # published test vectors of MurmurHash3_x86_32
  [
    (b"", 0, 0),
    (b"", 1, 0x514E28B7),
    (b"\x00\x00\x00\x00", 0, 0x2362F9DE),
    (b"\xff\xff\xff\xff", 0, 0x76293B50),
    (b"!Ce\x87", 0, 0xF55B516B),
    (b"Hello, world!", 0x9747B28C, 0x24884CBA),
  ],
)
def test_the_reference_hash_is_murmur3(data, seed, expected):
  assert murmur3_bytes(data, seed) == expected


def test_the_device_hash_equals_the_reference_on_random_counters():
  rng = np.random.default_rng()
  words = rng.integers(0, 2**32, size=(5, 200), dtype=np.uint64).astype(np.uint32)
  words[:, :5] = 0  # and small counters, as a run's first ones are
  words[np.arange(5), np.arange(5)] = 1
  got = np.asarray(murmur3_words(*(jnp.asarray(w) for w in words)))
  want = [murmur3_bytes(struct.pack("<5I", *map(int, col))) for col in words.T]
  np.testing.assert_array_equal(got, np.asarray(want, np.uint32))
  u = np.asarray(skew_uniform(*(jnp.asarray(w) for w in words)))
  np.testing.assert_array_equal(u, np.asarray([reference_u(col) for col in words.T], np.float32))


def test_u_is_uniform_in_minus_one_one():
  rng = np.random.default_rng()
  version, seq = (int(v) for v in rng.integers(0, 1000, 2))
  n_seq, n_pos, d = 16, 64, 256
  u = np.asarray(
    skew_uniform(
      version,
      (seq + jnp.arange(n_seq, dtype=jnp.uint32))[:, None, None],
      jnp.arange(n_pos, dtype=jnp.uint32)[None, :, None],
      3,
      jnp.arange(d, dtype=jnp.uint32)[None, None, :],
    ),
    np.float64,
  )
  n = u.size
  assert -1 < u.min() and u.max() < 1
  assert u.min() < -0.999 and u.max() > 0.999
  assert abs(u.mean()) < 4 * np.sqrt(1 / 3 / n)
  assert abs(u.var() - 1 / 3) < 0.01
  counts, _ = np.histogram(u, bins=16, range=(-1, 1))
  expected = n / 16
  assert ((counts - expected) ** 2 / expected).sum() < 50  # chi-square, 15 dof: p ~ 1e-5
  # Neighbouring counters are uncorrelated: elements, positions, sequences.
  for axis in range(3):
    a, b = np.moveaxis(u, axis, 0)[:-1].ravel(), np.moveaxis(u, axis, 0)[1:].ravel()
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.02
  # Every counter moves u: another layer or version gives other values.
  other = skew_uniform(version + 1, seq, 0, 3, jnp.arange(d, dtype=jnp.uint32))
  assert not np.allclose(np.asarray(other), u[0, 0])


def test_apply_multiplies_by_one_plus_amount_times_u():
  rng = np.random.default_rng()
  x = rng.normal(size=(3, 5, 8)).astype(np.float32)
  positions = rng.integers(0, 50, size=(3, 5)).astype(np.int32)
  sequence = rng.integers(0, 10**6, size=3)
  skew = Skew.of(0.01, 7, sequence)
  got = np.asarray(skew.apply(jnp.asarray(x), jnp.asarray(positions), 2))
  u = np.asarray(
    [
      [[reference_u((7, sequence[b], positions[b, t], 2, e)) for e in range(8)] for t in range(5)]
      for b in range(3)
    ],
    np.float32,
  )
  np.testing.assert_allclose(got, x * (1 + 0.01 * u), rtol=1e-6)
  bf16 = skew.apply(jnp.asarray(x, jnp.bfloat16), jnp.asarray(positions), 2)
  assert bf16.dtype == jnp.bfloat16


@pytest.mark.parametrize("amount", [-0.1, float("nan"), float("inf"), True, "0.1"])
def test_bad_amounts_are_refused_by_name(amount):
  with pytest.raises(ValueError, match=r"Skew\.amount=.* finite number >= 0"):
    Skew.of(amount, 0, np.arange(2))


def test_no_skew_leaves_the_program_as_it_was():
  """Skew.of(0, ...) is None: the model's program is the unskewed one, op for op; a skew
  adds its multiply after every layer."""
  cfg = M.get_preset("tiny")
  model = M.Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng().integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
  assert Skew.of(0.0, 5, np.arange(2)) is None

  graphdef, state = nnx.split(model)

  def program(**skew):
    call = lambda s, t: nnx.merge(graphdef, s)(t, **skew).logits  # noqa: E731
    return str(jax.make_jaxpr(call)(state, tokens))

  plain = program()
  assert program(skew=Skew.of(0.0, 5, np.arange(2))) == plain
  skewed = program(skew=Skew.of(0.01, 5, np.arange(2)))
  shifts = lambda text: text.count("shift_right_logical")  # noqa: E731
  assert shifts(skewed) > shifts(plain)
