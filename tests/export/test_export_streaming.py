"""The export writes tensor by tensor: its files are, byte for byte, an all-at-once
serialization of the same tensors (an independent writer here), and the host never holds
more than one fetched tensor at a time (a spy on each fetch from the devices)."""

import json
import os
import weakref

import numpy as np
import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax.export import compressed_tensors as ct

_CODES = {
  np.dtype(np.float32): "F32",
  np.dtype(np.uint8): "U8",
  np.dtype("bfloat16"): "BF16",
  np.dtype("float8_e4m3fn"): "F8_E4M3",
}


def _reference_file(tensors: dict) -> bytes:
  """A safetensors file of `tensors` (all on the host), by the format's definition."""
  header, body, offset = {"__metadata__": {"format": "pt"}}, b"", 0
  for name in sorted(tensors):
    raw = np.ascontiguousarray(tensors[name]).tobytes()
    header[name] = {
      "dtype": _CODES[tensors[name].dtype],
      "shape": list(tensors[name].shape),
      "data_offsets": [offset, offset + len(raw)],
    }
    body, offset = body + raw, offset + len(raw)
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  return len(text).to_bytes(8, "little") + text + body


@pytest.fixture(scope="module")
def policy():
  return M.Transformer(M.tiny(), rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 16))))


@pytest.mark.parametrize(
  "options",
  [{}, {"fmt": "mxfp4", "max_shard_bytes": 20_000}, {"quant": M.QuantConfig(sites="experts+kv")}],
)
def test_files_equal_an_all_at_once_write_and_one_tensor_is_fetched_at_a_time(
  policy, options, tmp_path, monkeypatch
):
  fmt = options.get("fmt", "nvfp4")
  config = ct.ExportConfig(fmt=fmt, max_shard_bytes=options.get("max_shard_bytes", 4 << 30))
  whole, _ = ct.hf_tensors(policy, config, quant=options.get("quant"))

  live: dict[int, int] = {}  # fetched host arrays still alive: id -> bytes
  fetched = []
  fetch = ct._to_numpy

  def spy(value):
    assert not live, f"a fetch while {len(live)} fetched arrays are alive"
    array = fetch(value)
    key = id(array)
    live[key] = array.nbytes
    weakref.finalize(array, live.pop, key, None)
    fetched.append(array.nbytes)
    return array

  monkeypatch.setattr(ct, "_to_numpy", spy)
  out = str(tmp_path / "export")
  ct.export_compressed_tensors(policy, out, **options)
  # Every HF tensor fetched once, and each fetch is one tensor's bytes at most (float32
  # master values before the bf16 cast: at most twice the tensor as written).
  assert len(fetched) == sum(1 for n in whole if not n.endswith("input_global_scale"))
  assert max(fetched) <= 2 * max(a.nbytes for a in whole.values())

  index = os.path.join(out, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
  else:
    weight_map = dict.fromkeys(whole, "model.safetensors")
  files = sorted(set(weight_map.values()))
  assert (len(files) > 1) == ("max_shard_bytes" in options)
  for name in files:
    part = {n: whole[n] for n, file in weight_map.items() if file == name}
    with open(os.path.join(out, name), "rb") as f:
      assert f.read() == _reference_file(part), name
