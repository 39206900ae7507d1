"""Load a large MoE checkpoint sharded across processes: what each process holds and reads,
the sharded model's logits, and RL steps on the mesh from the loaded policy.

  python experiments/scale_check.py --params_b=0.5 --processes=2 --devices_per_process=4 \
      --mesh=2,2,2
  python experiments/scale_check.py --params_b=0.5 --d_model=1024 --moe_ffn_dim=1024 \
      --dtype=float32 --processes=4 --devices_per_process=2 --mesh=1,8,1 --rl_steps=2
  python experiments/scale_check.py --num_layers=2 --d_model=128 --processes=2 \
      --devices_per_process=2 --mesh=2,2,1 --verify --json_out=/tmp/scale.json   # tiny

Writes a synthetic checkpoint in the Qwen3-MoE layout (config.json, bf16 *.safetensors
shards and their index, procedurally generated in blocks of rows and never held whole:
`trace_jax/export/synthetic.py`; the tiny Qwen3-MoE fixture's 96-id tokenizer and ChatML
template, whose ids are the embedding's first rows), unless --checkpoint_dir already holds
one, then loads it in --dtype with `from_hf(..., mesh=)` on --processes processes of
--devices_per_process CPU devices each (`jax.distributed` with a 127.0.0.1 coordinator, one
subprocess per process). Per process it prints:
  rss rise   the peak resident set during the load over the one before it (VmHWM, reset
             just before the load through /proc/self/clear_refs where the kernel allows it),
             beside the bound 2 x held + 0.4 GB;
  held       the bytes its devices hold (addressable shards of every parameter), beside
             what the sharding rules say they hold (`expected_device_bytes`);
  experts    the routed experts whose weights its devices hold (slices of the expert
             dimension); they span processes when no process holds them all;
  logits     the relative L2 distance of the sharded model's logits on a fixed token batch
             (gathered to every host) from those of a single-process, unsharded
             `from_hf(path, dtype)` load, made in its own process after the workers end (out
             of their measured windows);
  load GB/s  the checkpoint's bytes on disk over the load's time, beside a plain read of the
             same files (every byte once, in 64 MiB reads, timed after the load; both from a
             warm page cache when the files were just written); "held GB/s" is the bytes
             its devices hold over the load's time less the abstract model's construction
             (`nnx.eval_shape`, timed apart twice before the load: cold, then warm, as the
             load then finds it; it is spent whether the load is sharded or not).
--verify then also compares every shard with the whole-tensor load (`from_hf` without a
mesh, on one device). --rl_steps=N then runs N GRPO steps of --arm on the task `arith` on
the same mesh in every process, through the `Trainer` with `hf_checkpoint=` the checkpoint:
it reads the checkpoint again through the same sharded load (the measured policy is freed
first), and its starting weights are checked equal, shard by shard, to the measured load's.
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

from absl import app, flags, logging

from trace_jax.rl.config import RLConfig
from trace_jax.utils import flags as config_flags

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
_DTYPE = flags.DEFINE_enum(
  "dtype", "bfloat16", ["bfloat16", "float32"], "Parameter dtype of the loads (bf16 on disk)."
)
_VERIFY = flags.DEFINE_bool("verify", False, "Compare every shard with the whole-tensor load.")
_LOGITS = flags.DEFINE_bool(
  "logits", True, "Compare the sharded model's logits with a one-process unsharded load's."
)
_RL_STEPS = flags.DEFINE_integer(
  "rl_steps", 0, "RL steps on the mesh from the loaded checkpoint after the load; 0: none."
)
_RL = config_flags.define_flags(RLConfig, only=("arm",))  # --arm: the RL steps' arm
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the per-process figures here.")
_WORKER = flags.DEFINE_string(
  "worker", None, "(internal) process_id,port of a worker process, or 'reference'."
)
_OUT_DIR = flags.DEFINE_string("out_dir", None, "(internal) where workers leave logits and runs.")

GB = 1e9
RSS_SLACK = 0.4 * GB  # the bound on a process's peak RSS rise: 2 x what its devices hold + this
# The tiny Qwen3-MoE fixture's tokenizer: a 96-id BPE with ChatML special tokens and template.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_FILES = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3_moe")
# Each step's metrics reported (global values: every process's the same), then its seconds.
RL_VALUES = ("step", "loss", "rewards/mean", "mismatch/k3_kl", "mismatch/logp_abs_diff")
PROBE_TOKENS = 16  # positions of each row of the logits check's fixed token batch


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


def layers_for(params_b: float) -> int:
  """The number of layers whose model is nearest `params_b` billion parameters (>= 1)."""
  from trace_jax.model.accounting import param_count

  one, two = param_count(model_config(1)), param_count(model_config(2))
  per_layer = two - one
  return max(1, round((params_b * 1e9 - (one - per_layer)) / per_layer))


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
  from trace_jax.model import accounting, sharding

  mesh = type("Shape", (), {"shape": mesh_shape})()  # the rules read only the axis sizes
  total = 0
  for path, variable in accounting.abstract_variables(cfg).items():
    spec = sharding.param_spec(variable, mesh, what="/".join(map(str, path)))
    splits = math.prod(mesh_shape[a] for a in spec if a is not None)
    total += math.prod(variable.get_value().shape) * itemsize // splits
  return total


def _say(text: str) -> None:
  """A progress line on stderr (the figures come on stdout at the end)."""
  print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def write_tokenizer(directory: str) -> None:
  """The tiny Qwen3-MoE fixture's tokenizer.json, tokenizer_config.json (ChatML template)
  and generation_config.json (stop ids) into `directory`: its 96 ids are the embedding's
  first rows (a sampled id past them decodes to nothing)."""
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(os.path.join(TOKENIZER_FILES, name), os.path.join(directory, name))


def probe_tokens(vocab_size: int, data: int):
  """The logits check's fixed token batch, int32 [2 x data, PROBE_TOKENS]."""
  import numpy as np

  rng = np.random.default_rng(0)
  return rng.integers(0, vocab_size, (2 * data, PROBE_TOKENS)).astype(np.int32)


def forward_logits(policy, tokens, mesh=None):
  """float32 [B, T, V] logits of `policy` on `tokens`, whole on this host; with `mesh`, run
  on it with the batch split over `data` and gathered from every process."""
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from trace_jax.utils import distributed

  forward = nnx.jit(lambda model, ids: model(ids).logits.astype(np.float32))
  if mesh is None:
    return np.asarray(forward(policy, tokens))
  ids = distributed.global_array(tokens, NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    return distributed.host_array(forward(policy, ids))


def experts_held(params) -> list[int]:
  """The routed experts some shard on this process's devices holds: the slices of the
  expert dimension (split over the mesh's `expert` axis) of every expert parameter."""
  held = set()
  for array in params:
    spec = tuple(array.sharding.spec)
    axes = [i for i, a in enumerate(spec) if a == "expert" or "expert" in (a or ())]
    for shard in array.addressable_shards:
      for axis in axes:
        held |= set(range(array.shape[axis])[shard.index[axis]])
  return sorted(held)


def shard_fingerprints(module) -> dict[str, int]:
  """{parameter path @ device id: crc32 of that shard as float32}, this process's shards."""
  import numpy as np
  from flax import nnx

  out = {}
  for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param)):
    for shard in variable.get_value().addressable_shards:
      data = np.ascontiguousarray(np.asarray(shard.data, np.float32))
      out[f"{'/'.join(map(str, path))}@{shard.device.id}"] = zlib.crc32(data.tobytes())
  return out


def rl_steps(path: str, mesh_shape: list[int], workdir: str, loaded: dict[str, int]) -> dict:
  """`--rl_steps` GRPO steps of `--arm` on task arith, on the mesh, through the Trainer with
  `hf_checkpoint=path` (it reads the checkpoint onto the mesh itself); `loaded`: the measured
  load's `shard_fingerprints`, which the Trainer's starting weights must equal."""
  import jax

  from trace_jax.run.trainer import Trainer

  data = mesh_shape[0]
  config = RLConfig.from_flat(
    arm=_RL["arm"].value,
    task="arith",
    hf_checkpoint=path,
    mesh=tuple(mesh_shape),
    steps=_RL_STEPS.value,
    prompts_per_step=max(2, data),
    group_size=2,
    minibatches=1,
    max_new_tokens=4,
    eval_every=0,
    eval_size=0,
    checkpoint_every=0,
    compute_dtype=_DTYPE.value,
  )
  start = time.perf_counter()
  trainer = Trainer(config, workdir, progress=False)
  setup_seconds = time.perf_counter() - start
  _say(f"process {jax.process_index()}: Trainer ready in {setup_seconds:.1f} s")
  start_equals_load = shard_fingerprints(trainer.policy) == loaded
  start = time.perf_counter()
  history = trainer.run()
  seconds = time.perf_counter() - start
  trainer.close()
  keep = (*RL_VALUES, "rollout_seconds", "train_seconds")
  return dict(
    arm=config.arm,
    start_equals_load=start_equals_load,
    setup_seconds=setup_seconds,
    seconds=seconds,
    steps=[{k: m[k] for k in keep} for m in history],
  )


def worker(process_id: int, port: int, path: str, out_dir: str) -> dict:
  """One process of the load: its figures (then the logits and the RL steps)."""
  from trace_jax.utils import distributed

  logging.set_verbosity(logging.WARNING)  # jax.distributed and orbax log at INFO
  processes = _PROCESSES.value
  if processes > 1:
    distributed.initialize(f"127.0.0.1:{port}", processes, process_id)
  import gc

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from trace_jax.model import accounting, hf, sharding

  data, expert, model = (int(x) for x in _MESH.value)
  mesh = sharding.make_mesh(data, expert, model)
  dtype = jnp.dtype(_DTYPE.value)
  cfg, _ = hf.read_config(os.path.join(path, "config.json"), dtype)
  abstract_seconds = []
  for _ in range(2):  # what the load spends building the abstract model: cold, then warm
    start = time.perf_counter()
    accounting.abstract_variables(cfg)
    abstract_seconds.append(time.perf_counter() - start)
  rss_before = _status_kib("VmRSS")
  reset = _reset_peak()
  start = time.perf_counter()
  policy = hf.from_hf(path, dtype, mesh=mesh)
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
  held = sum(per_device.values())
  out = dict(
    process=jax.process_index(),
    devices=len(per_device),
    dtype=dtype.name,
    rss_before_bytes=rss_before * 1024,
    rss_rise_bytes=(peak - rss_before) * 1024,
    rss_bound_bytes=2 * held + RSS_SLACK,
    rss_within_bound=(peak - rss_before) * 1024 <= 2 * held + RSS_SLACK,
    peak_reset=reset,
    held_bytes=held,
    device_bytes=per_device,
    expected_device_bytes=expected_device_bytes(policy.cfg, shape, dtype.itemsize),
    model_bytes=sum(int(a.nbytes) for a in params),
    checkpoint_bytes=disk,
    num_experts=policy.cfg.num_experts,
    experts_held=experts_held(params),
    load_seconds=seconds,
    load_gb_s=disk / seconds / GB,
    abstract_cold_seconds=abstract_seconds[0],
    abstract_seconds=abstract_seconds[1],
    # (None when the warm abstract model alone took longer than the whole load: noise)
    held_gb_s=held / (seconds - abstract_seconds[1]) / GB
    if seconds > abstract_seconds[1]
    else None,
    read_bytes=read_bytes,
    read_seconds=read_seconds,
    read_gb_s=read_bytes / read_seconds / GB,
  )
  _say(f"process {out['process']}: loaded in {seconds:.1f} s")
  if _VERIFY.value:
    whole = hf.from_hf(path, dtype)
    wants = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(whole))]
    mismatched = 0
    for got, want in zip(params, wants):
      want = np.asarray(want)
      for shard in got.addressable_shards:
        mismatched += np.asarray(shard.data).tobytes() != want[shard.index].tobytes()
    out["verified_shards_mismatched"] = mismatched
    del whole, wants
  if _LOGITS.value:
    logits = forward_logits(policy, probe_tokens(policy.cfg.vocab_size, data), mesh)
    np.save(os.path.join(out_dir, f"logits_{out['process']}.npy"), logits)
    _say(f"process {out['process']}: logits of the sharded model gathered")
  if _RL_STEPS.value:
    loaded = shard_fingerprints(policy)
    del policy, params
    gc.collect()  # the Trainer reads the checkpoint again: one copy at a time
    out["rl"] = rl_steps(path, [data, expert, model], os.path.join(out_dir, "rl"), loaded)
  return out


def reference(path: str, out_dir: str) -> None:
  """The logits of a one-process, one-device, unsharded load (`from_hf(path, dtype)`)."""
  import jax.numpy as jnp
  import numpy as np

  from trace_jax.model import hf

  policy = hf.from_hf(path, jnp.dtype(_DTYPE.value))
  tokens = probe_tokens(policy.cfg.vocab_size, int(_MESH.value[0]))
  np.save(os.path.join(out_dir, "logits_reference.npy"), forward_logits(policy, tokens))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _ranges(ids: list[int]) -> str:
  """0-3,6 for [0, 1, 2, 3, 6]."""
  out, run = [], []
  for i in ids:
    if run and i != run[-1] + 1:
      out.append(run)
      run = []
    run.append(i)
  out += [run] if run else []
  return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in out) or "none"


def experts_span(rows: list[dict]) -> bool:
  """Whether the expert weights span processes: together the processes hold every expert
  and none holds them all."""
  every = set(range(rows[0]["num_experts"]))
  held = [set(r["experts_held"]) for r in rows]
  return set().union(*held) == every and all(h != every for h in held)


def relative_l2(got, want) -> float:
  import numpy as np

  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


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
      "2 x held + 0.4 GB, MiB",
      "experts held",
      "logits rel L2",
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
        mib(r["rss_bound_bytes"]) + ("" if r["rss_within_bound"] else " (exceeded)"),
        _ranges(r["experts_held"]),
        f"{r['logits_rel_l2']:.1e}" if "logits_rel_l2" in r else "n/a",
        f"{r['load_seconds']:.2f}",
        f"{r['load_gb_s']:.3f}",
        f"{r['abstract_seconds']:.2f} ({r['abstract_cold_seconds']:.2f})",
        "n/a" if r["held_gb_s"] is None else f"{r['held_gb_s']:.3f}",
        f"{r['read_gb_s']:.3f}",
      ]
      for r in rows
    ],
  )


def _rl_table(rl: dict) -> str:
  from trace_jax.utils import markdown_table

  return markdown_table(
    [*RL_VALUES, "rollout s", "train s"],
    [
      [
        m["step"],
        f"{m['loss']:.4g}",
        f"{m['rewards/mean']:.3f}",
        f"{m['mismatch/k3_kl']:.3g}",
        f"{m['mismatch/logp_abs_diff']:.3g}",
        f"{m['rollout_seconds']:.1f}",
        f"{m['train_seconds']:.1f}",
      ]
      for m in rl["steps"]
    ],
  )


def _run(args: list[str], devices: int) -> subprocess.Popen:
  """This script started with `args` on `devices` CPU devices (and the caller's XLA_FLAGS)."""
  xla_flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags.strip())
  return subprocess.Popen(
    [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=env
  )


def _report(rows: list[dict]) -> None:
  print(_table(rows))
  print(
    f"expert weights span processes: {'yes' if experts_span(rows) else 'no'} ("
    + "; ".join(f"process {r['process']}: {_ranges(r['experts_held'])}" for r in rows)
    + f" of 0-{rows[0]['num_experts'] - 1})"
  )
  if "rl" in rows[0]:
    rl = rows[0]["rl"]
    values = lambda r: [[m[k] for k in RL_VALUES] for m in r["rl"]["steps"]]  # noqa: E731
    same = all(values(r) == values(rows[0]) for r in rows)
    starts = all(r["rl"]["start_equals_load"] for r in rows)
    print(
      f"\n{len(rl['steps'])} RL steps of arm {rl['arm']} on mesh {','.join(_MESH.value)} "
      f"across {len(rows)} process(es), process 0's metrics (every process's "
      f"{'the same' if same else 'NOT the same'}); starting weights equal the measured "
      f"load's on every process: {'yes' if starts else 'no'}; the Trainer's construction "
      f"(it reads the checkpoint again) {rl['setup_seconds']:.1f} s, the steps (compilation "
      f"included) {rl['seconds']:.1f} s"
    )
    print(_rl_table(rl))


def main(argv):
  del argv
  data, expert, model = (int(x) for x in _MESH.value)
  if len(_MESH.value) != 3 or data * expert * model != _PROCESSES.value * _DEVICES.value:
    raise ValueError(
      f"--mesh={','.join(_MESH.value)}: three sizes data,expert,model whose product is "
      f"--processes x --devices_per_process = {_PROCESSES.value * _DEVICES.value}"
    )
  if _WORKER.value == "reference":
    reference(_CHECKPOINT_DIR.value, _OUT_DIR.value)
    return
  if _WORKER.value is not None:
    process_id, port = (int(x) for x in _WORKER.value.split(","))
    out = worker(process_id, port, _CHECKPOINT_DIR.value, _OUT_DIR.value)
    print("RESULT " + json.dumps(out), flush=True)
    return
  made = _CHECKPOINT_DIR.value is None
  path = _CHECKPOINT_DIR.value or tempfile.mkdtemp(prefix="scale_check_")
  out_dir = tempfile.mkdtemp(prefix="scale_check_out_")
  try:
    if not os.path.exists(os.path.join(path, "config.json")):
      from trace_jax.export import synthetic
      from trace_jax.model import accounting

      shard_bytes = int(_SHARD_GB.value * GB)
      layers = _NUM_LAYERS.value if _PARAMS_B.value is None else layers_for(_PARAMS_B.value)
      cfg = model_config(layers)
      start = time.perf_counter()
      total = synthetic.write_synthetic_checkpoint(path, cfg, max_shard_bytes=shard_bytes)
      print(
        f"wrote {path}: {accounting.param_count(cfg) / 1e9:.3f}B parameters, {layers} layers, "
        f"{total / GB:.3f} GB in {time.perf_counter() - start:.1f} s",
        flush=True,
      )
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
      write_tokenizer(path)
    port = _free_port()
    internal = ("--checkpoint_dir", "--json_out", "--out_dir", "--worker")
    passed = [a for a in sys.argv[1:] if not a.startswith(internal)]
    passed += [f"--checkpoint_dir={path}", f"--out_dir={out_dir}"]
    procs = [
      _run([*passed, f"--worker={i},{port}"], _DEVICES.value) for i in range(_PROCESSES.value)
    ]
    rows = []
    for i, proc in enumerate(procs):
      out, _ = proc.communicate()
      if proc.returncode:
        raise RuntimeError(f"process {i} failed (exit {proc.returncode})")
      rows += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    rows.sort(key=lambda r: r["process"])
    if _LOGITS.value:  # after the workers: out of their measured windows, not competing
      proc = _run([*passed, "--worker=reference"], 1)
      proc.communicate()
      if proc.returncode:
        raise RuntimeError(f"the reference load failed (exit {proc.returncode})")
      import numpy as np

      want = np.load(os.path.join(out_dir, "logits_reference.npy"))
      for r in rows:
        got = np.load(os.path.join(out_dir, f"logits_{r['process']}.npy"))
        r["logits_rel_l2"] = relative_l2(got, want)
    _report(rows)
    if _JSON_OUT.value:
      with open(_JSON_OUT.value, "w") as f:
        json.dump(rows, f, indent=1)
  finally:
    shutil.rmtree(out_dir, ignore_errors=True)
    if made:
      shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
