"""Load a large MoE checkpoint sharded across processes: what each process holds and reads.

  python experiments/scale_check.py --params_b=0.5 --processes=2 --devices_per_process=4 \
      --mesh=2,2,2
  python experiments/scale_check.py --num_layers=2 --d_model=128 --processes=2 \
      --devices_per_process=2 --mesh=2,2,1 --verify --json_out=/tmp/scale.json   # tiny

Writes a synthetic checkpoint in the Qwen3-MoE layout (config.json, bf16 *.safetensors
shards and their index; procedurally generated tensor by tensor, never held whole), unless
--checkpoint_dir already holds one, then loads it with `from_hf(..., mesh=)` on
--processes processes of --devices_per_process CPU devices each (`jax.distributed` with a
127.0.0.1 coordinator, one subprocess per process). Per process it prints:
  rss rise   the peak resident set during the load over the one before it (VmHWM, reset
             just before the load through /proc/self/clear_refs where the kernel allows it);
  held       the bytes its devices hold (addressable shards of every parameter), beside
             what the sharding rules say they hold (`expected_device_bytes`);
  load GB/s  the checkpoint's bytes on disk over the load's time, beside a plain read of the
             same files (every byte once, in 64 MiB reads, timed after the load; both from a
             warm page cache when the files were just written); "held GB/s" is the bytes
             its devices hold over the load's time less the abstract model's construction
             (`nnx.eval_shape`, timed apart twice before the load: cold, then warm, as the
             load then finds it; it is spent whether the load is sharded or not).
--verify then also compares every shard with the whole-tensor load (`from_hf` without a
mesh, on one device). Multi-process RL steps from the loaded policy are not done here.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zlib

from absl import app, flags

_PARAMS_B = flags.DEFINE_float(
  "params_b", None, "Target parameter count in billions (sets --num_layers; else the flag)."
)
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 2, "Decoder layers (when --params_b is unset).")
_D_MODEL = flags.DEFINE_integer("d_model", 512, "Hidden size.")
_NUM_EXPERTS = flags.DEFINE_integer("num_experts", 16, "Routed experts per layer.")
_TOP_K = flags.DEFINE_integer("experts_per_tok", 4, "Experts per token.")
_MOE_FFN = flags.DEFINE_integer("moe_ffn_dim", 256, "Width of one expert.")
_HEADS = flags.DEFINE_integer("num_heads", 8, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 4, "Key/value heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head width.")
_VOCAB = flags.DEFINE_integer("vocab_size", 8192, "Vocabulary.")
_SHARD_GB = flags.DEFINE_float("shard_gb", 1.0, "Largest safetensors shard file, in GB.")
_CHECKPOINT_DIR = flags.DEFINE_string(
  "checkpoint_dir",
  None,
  "Where the checkpoint is (reused when it holds one); default: a "
  "temporary folder, removed afterwards.",
)
_PROCESSES = flags.DEFINE_integer("processes", 2, "Processes (jax.distributed).")
_DEVICES = flags.DEFINE_integer("devices_per_process", 2, "CPU devices per process.")
_MESH = flags.DEFINE_list("mesh", ["2", "2", "1"], "data,expert,model (product: all devices).")
_VERIFY = flags.DEFINE_bool("verify", False, "Compare every shard with the whole-tensor load.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the per-process figures here.")
_WORKER = flags.DEFINE_string("worker", None, "(internal) process_id,port of a worker process.")

GB = 1e9


def model_config(num_layers: int):
  """The synthetic Qwen3-MoE ModelConfig of these flags."""
  from trace_jax import model as M

  return M.ModelConfig(
    arch="qwen3_moe",
    name="scale_check",
    vocab_size=_VOCAB.value,
    d_model=_D_MODEL.value,
    num_layers=num_layers,
    num_heads=_HEADS.value,
    num_kv_heads=_KV_HEADS.value,
    head_dim=_HEAD_DIM.value,
    num_experts=_NUM_EXPERTS.value,
    num_experts_per_tok=_TOP_K.value,
    moe_ffn_dim=_MOE_FFN.value,
    qk_norm="head",
    norm_topk_prob=True,
    max_seq_len=256,
    dtype="bfloat16",
  )


def _abstract(cfg):
  from flax import nnx

  from trace_jax import model as M

  return nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0)))


def param_count(cfg) -> int:
  from flax import nnx

  return sum(
    math.prod(v.get_value().shape) for _, v in nnx.to_flat_state(nnx.state(_abstract(cfg)))
  )


def layers_for(params_b: float) -> int:
  """The number of layers whose model is nearest `params_b` billion parameters (>= 1)."""
  one, two = param_count(model_config(1)), param_count(model_config(2))
  per_layer = two - one
  return max(1, round((params_b * 1e9 - (one - per_layer)) / per_layer))


def hf_shapes(cfg) -> dict[str, tuple[tuple[int, ...], str]]:
  """{HF tensor name: (shape, kind)} of the checkpoint, from the name table (no arrays)."""
  import numpy as np
  from flax import nnx

  from trace_jax.export import names as names_lib

  out = {}
  for path, variable in nnx.to_flat_state(nnx.state(_abstract(cfg))):
    shape = variable.get_value().shape
    kind = "norm" if str(path[-1]) == "scale" else "weight"
    for target in names_lib.targets(cfg, path):
      view = names_lib.hf_array(np.broadcast_to(np.zeros((), np.float32), shape), target)
      out[target.name] = (tuple(view.shape), kind)
  return out


def _values(name: str, shape: tuple[int, ...], kind: str, rows: slice):
  """Rows `rows` of tensor `name`, procedurally (seeded by the name), as bf16."""
  import ml_dtypes
  import numpy as np

  rng = np.random.default_rng([zlib.crc32(name.encode()), rows.start])
  block = (rows.stop - rows.start,) + shape[1:]
  x = rng.standard_normal(block, np.float32)
  x = 1.0 + 0.05 * x if kind == "norm" else 0.02 * x
  return x.astype(ml_dtypes.bfloat16)


def write_checkpoint(directory: str, cfg) -> int:
  """Write the synthetic checkpoint (bf16 shards of at most --shard_gb, an index and
  config.json), tensor by tensor in blocks of rows; returns its bytes on disk."""
  from trace_jax.export import names as names_lib

  shapes = hf_shapes(cfg)
  limit = int(_SHARD_GB.value * GB)
  shards, current, size = [], [], 0
  for name in sorted(shapes):
    nbytes = math.prod(shapes[name][0]) * 2
    if current and size + nbytes > limit:
      shards.append(current)
      current, size = [], 0
    current.append(name)
    size += nbytes
  shards.append(current)
  os.makedirs(directory, exist_ok=True)
  weight_map, total = {}, 0
  for i, names in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
      nbytes = math.prod(shapes[name][0]) * 2
      header[name] = {
        "dtype": "BF16",
        "shape": list(shapes[name][0]),
        "data_offsets": [offset, offset + nbytes],
      }
      offset += nbytes
      weight_map[name] = file
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(os.path.join(directory, file + ".tmp"), "wb") as f:
      f.write(len(blob).to_bytes(8, "little") + blob)
      for name in names:
        shape, kind = shapes[name]
        step = max(1, (16 << 20) // max(1, math.prod(shape[1:]) * 4))  # ~16 MiB of float32
        for start in range(0, shape[0], step):
          f.write(_values(name, shape, kind, slice(start, min(shape[0], start + step))).tobytes())
      total += f.tell()
    os.replace(os.path.join(directory, file + ".tmp"), os.path.join(directory, file))
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(names_lib.hf_config(cfg), f)
  return total


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise ValueError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
  """Reset VmHWM to the current resident set (Linux: 5 > /proc/self/clear_refs)."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def plain_read(files: list[str]) -> tuple[int, float]:
  """(bytes, seconds) of reading every byte of `files` once, 64 MiB at a time."""
  buffer = bytearray(64 << 20)
  view, total = memoryview(buffer), 0
  start = time.perf_counter()
  for file in files:
    with open(file, "rb", buffering=0) as f:
      while n := f.readinto(view):
        total += n
  return total, time.perf_counter() - start


def expected_device_bytes(cfg, mesh_shape: dict[str, int], itemsize: int) -> int:
  """Bytes one device holds of the parameters by their declared rules (every device holds
  the same on a (data, expert, model) mesh whose axes divide what they split)."""
  from flax import nnx

  from trace_jax.model import sharding

  mesh = type("Shape", (), {"shape": mesh_shape})()  # the rules read only the axis sizes
  total = 0
  for path, variable in nnx.to_flat_state(nnx.state(_abstract(cfg))):
    spec = sharding.param_spec(variable, mesh, what="/".join(map(str, path)))
    splits = math.prod(mesh_shape[a] for a in spec if a is not None)
    total += math.prod(variable.get_value().shape) * itemsize // splits
  return total


def worker(process_id: int, port: int, path: str) -> dict:
  """One process of the load: its figures."""
  from trace_jax.utils import distributed

  processes = _PROCESSES.value
  if processes > 1:
    distributed.initialize(f"127.0.0.1:{port}", processes, process_id)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from trace_jax.model import hf, sharding

  data, expert, model = (int(x) for x in _MESH.value)
  mesh = sharding.make_mesh(data, expert, model)
  cfg, _ = hf.read_config(os.path.join(path, "config.json"), jnp.bfloat16)
  abstract_seconds = []
  for _ in range(2):  # what the load spends building the abstract model: cold, then warm
    start = time.perf_counter()
    _abstract(cfg)
    abstract_seconds.append(time.perf_counter() - start)
  rss_before = _status_kib("VmRSS")
  reset = _reset_peak()
  start = time.perf_counter()
  policy = hf.from_hf(path, jnp.bfloat16, mesh=mesh)
  params = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(policy))]
  jax.block_until_ready(params)
  seconds = time.perf_counter() - start
  peak = _status_kib("VmHWM")
  per_device: dict[str, int] = {}
  for array in params:
    for shard in array.addressable_shards:
      per_device[str(shard.device.id)] = per_device.get(str(shard.device.id), 0) + shard.data.nbytes
  files = hf.shard_files(path)
  disk = sum(os.path.getsize(f) for f in files)
  read_bytes, read_seconds = plain_read(files)
  shape = dict(mesh.shape)
  out = dict(
    process=jax.process_index(),
    devices=len(per_device),
    rss_before_bytes=rss_before * 1024,
    rss_rise_bytes=(peak - rss_before) * 1024,
    peak_reset=reset,
    held_bytes=sum(per_device.values()),
    device_bytes=per_device,
    expected_device_bytes=expected_device_bytes(policy.cfg, shape, 2),
    model_bytes=sum(int(a.nbytes) for a in params),
    checkpoint_bytes=disk,
    load_seconds=seconds,
    load_gb_s=disk / seconds / GB,
    abstract_cold_seconds=abstract_seconds[0],
    abstract_seconds=abstract_seconds[1],
    # (None when the warm abstract model alone took longer than the whole load: noise)
    held_gb_s=sum(per_device.values()) / (seconds - abstract_seconds[1]) / GB
    if seconds > abstract_seconds[1]
    else None,
    read_bytes=read_bytes,
    read_seconds=read_seconds,
    read_gb_s=read_bytes / read_seconds / GB,
  )
  if _VERIFY.value:
    whole = hf.from_hf(path, jnp.bfloat16)
    wants = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(whole))]
    mismatched = 0
    for got, want in zip(params, wants):
      want = np.asarray(want)
      for shard in got.addressable_shards:
        mismatched += not np.array_equal(
          np.asarray(shard.data).view(np.uint16), want[shard.index].view(np.uint16)
        )
    out["verified_shards_mismatched"] = mismatched
  return out


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _table(rows: list[dict]) -> str:
  from trace_jax.utils import markdown_table

  mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
  return markdown_table(
    [
      "process",
      "devices",
      "rss rise MiB",
      "held MiB",
      "rules MiB",
      "load s",
      "load GB/s",
      "abstract model s (cold)",
      "held GB/s",
      "plain read GB/s",
    ],
    [
      [
        r["process"],
        r["devices"],
        mib(r["rss_rise_bytes"]),
        mib(r["held_bytes"]),
        mib(r["expected_device_bytes"] * r["devices"]),
        f"{r['load_seconds']:.2f}",
        f"{r['load_gb_s']:.3f}",
        f"{r['abstract_seconds']:.2f} ({r['abstract_cold_seconds']:.2f})",
        "n/a" if r["held_gb_s"] is None else f"{r['held_gb_s']:.3f}",
        f"{r['read_gb_s']:.3f}",
      ]
      for r in rows
    ],
  )


def main(argv):
  del argv
  data, expert, model = (int(x) for x in _MESH.value)
  if len(_MESH.value) != 3 or data * expert * model != _PROCESSES.value * _DEVICES.value:
    raise ValueError(
      f"--mesh={','.join(_MESH.value)}: three sizes data,expert,model whose product is "
      f"--processes x --devices_per_process = {_PROCESSES.value * _DEVICES.value}"
    )
  if _WORKER.value is not None:
    process_id, port = (int(x) for x in _WORKER.value.split(","))
    print("RESULT " + json.dumps(worker(process_id, port, _CHECKPOINT_DIR.value)), flush=True)
    return
  made = _CHECKPOINT_DIR.value is None
  path = _CHECKPOINT_DIR.value or tempfile.mkdtemp(prefix="scale_check_")
  try:
    if not os.path.exists(os.path.join(path, "config.json")):
      layers = _NUM_LAYERS.value if _PARAMS_B.value is None else layers_for(_PARAMS_B.value)
      cfg = model_config(layers)
      start = time.perf_counter()
      total = write_checkpoint(path, cfg)
      print(
        f"wrote {path}: {param_count(cfg) / 1e9:.3f}B parameters, {layers} layers, "
        f"{total / GB:.3f} GB in {time.perf_counter() - start:.1f} s",
        flush=True,
      )
    port = _free_port()
    env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=f"--xla_force_host_platform_device_count={_DEVICES.value}",
    )
    passed = [a for a in sys.argv[1:] if not a.startswith(("--checkpoint_dir", "--json_out"))]
    procs = [
      subprocess.Popen(
        [sys.executable, __file__, *passed, f"--checkpoint_dir={path}", f"--worker={i},{port}"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
      )
      for i in range(_PROCESSES.value)
    ]
    rows = []
    for i, proc in enumerate(procs):
      out, _ = proc.communicate()
      if proc.returncode:
        raise RuntimeError(f"process {i} failed (exit {proc.returncode})")
      rows += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    rows.sort(key=lambda r: r["process"])
    print(_table(rows))
    if _JSON_OUT.value:
      with open(_JSON_OUT.value, "w") as f:
        json.dump(rows, f, indent=1)
  finally:
    if made:
      shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
