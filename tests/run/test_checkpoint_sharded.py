"""Checkpoints of sharded state on 4 fake CPU devices: a save on a (2, 2) mesh restores onto
it bit for bit with every sharding kept, each device reading only its own shard, and the
checksums (`checkpoint.fingerprint`) are the row-major byte sums of an independent flat
definition while moving no array between devices (only their partial sums)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, re, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 " + os.environ.get(
        "XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from trace_jax.run import checkpoint as C

    assert jax.device_count() == 4
    rng = np.random.default_rng()
    mesh = jax.make_mesh((2, 2), ("a", "b"))

    def put(array, spec):
        return jax.device_put(jnp.asarray(array), NamedSharding(mesh, spec))

    def state():
        return {
            "w": put(rng.normal(size=(8, 6)).astype(np.float32), P("a", "b")),
            "e": put(rng.normal(size=(4, 6, 2)).astype(jnp.bfloat16), P("b", None, "a")),
            "codes": put(rng.integers(0, 256, (6, 4), dtype=np.uint8), P(None, "a")),
            "step": put(np.int32(rng.integers(1 << 20)), P()),
            "key": put(jax.random.key(int(rng.integers(1 << 16))), P()),
        }

    def flat_checksum(x):  # the definition: sum_i byte_i * (1 + i mod 65521) mod 2^32
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        data = np.frombuffer(np.ascontiguousarray(np.asarray(x)).tobytes(), np.uint8)
        weights = np.arange(data.size, dtype=np.uint64) % 65521 + 1
        return int((data.astype(np.uint64) * weights).sum() % (1 << 32))

    saved = state()
    sums, nonfinite = C.fingerprint(saved)
    assert not nonfinite
    assert sums == {f"['{k}']": flat_checksum(v) for k, v in saved.items()}, sums

    # The checksum program moves partial sums only: no all-gather, all-to-all or permute.
    text = C._summaries.lower(jax.tree.leaves(saved)).compile().as_text()
    moves = set(re.findall(r"(all-gather|all-to-all|collective-permute)", text))
    assert not moves, moves

    def same_bits(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()

    checkpoints = C.Checkpoints(sys.argv[1])
    checkpoints.save(3, {"state": saved}, {"step": 3})
    like = state()  # other values, the same shardings
    for read_only in (False, True):
        reader = C.Checkpoints(sys.argv[1], read_only=read_only)
        restored = reader.restore(3, {"state": like})["state"]
        for name, want in saved.items():
            got = restored[name]
            if name == "key":
                got, want = jax.random.key_data(got), jax.random.key_data(want)
            assert got.sharding == want.sharding and same_bits(got, want), name
            # Each device holds just its own shard, the one the sharding gives it.
            shard_shape = want.sharding.shard_shape(want.shape)
            assert {s.data.shape for s in got.addressable_shards} == {shard_shape}, name
            for shard in got.addressable_shards:
                assert same_bits(shard.data, np.asarray(want)[shard.index]), name
        print("OK", read_only, flush=True)
""")


def test_sharded_save_and_restore_keep_shards_and_bits(tmp_path):
  result = subprocess.run(
    [sys.executable, "-c", SCRIPT, str(tmp_path / "checkpoints")],
    capture_output=True,
    text=True,
    env=dict(os.environ),
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert result.stdout.count("OK") == 2, result.stdout
