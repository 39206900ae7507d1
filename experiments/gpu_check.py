"""One prepared command for a GPU (H100/H200): everything compiled, nothing interpreted.

  python experiments/gpu_check.py                          # every section, about 10 minutes
  python experiments/gpu_check.py --sections=probe,kernels  # some of them
  python experiments/gpu_check.py --peak_gbps=3350          # an H100 SXM's roofline

On a machine without a GPU it says so and exits 0 (nothing to check there: the CUDA
lowering of every kernel is checked by tests/kernels/test_cuda_lowering.py on any machine).

Sections, each a markdown table; every figure is measured in this run, every ratio is
between rows of this run, and "roofline" is bytes moved / --peak_gbps (4.8 TB/s, H200):
  probe     kernels="auto" must pick Pallas: the probe's verdict, and why not if not.
  tests     pytest tests/kernels (compiled: kernels default to interpret=False on a GPU).
  kernels   experiments/bench_kernels.py at Qwen3-30B-A3B decode shapes (batch 1/32/256).
  decode    rollout decode tokens/s, bf16 vs FP4 (Pallas and XLA), a few layers of the real
            Qwen3-30B-A3B geometry, at 4K / 32K / 128K context and growing batch, cache
            filled with random entries (a decode step costs the same whatever they hold);
            rows whose cache and weights do not fit --memory_fraction of the GPU are skipped.
  mismatch  the mismatch study with the FP4 rollout on kernels="pallas" and on "xla": the
            kernels keep c * s_b exact and apply global scales after accumulating, while
            the training path rounds dequantized weights to bf16; how much mismatch that
            adds, and whether guidance removes it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import kernels as kernels_lib
from trace_jax import model as M
from trace_jax.model import accounting
from trace_jax.model.cache import init_cache
from trace_jax.studies.mismatch import StudyConfig, run_study
from trace_jax.rollout.params import quantize_params_jit
from trace_jax.utils import markdown_table

SECTIONS = ("probe", "tests", "kernels", "decode", "mismatch")
_SECTIONS = flags.DEFINE_list("sections", list(SECTIONS), f"Which of {SECTIONS} to run.")
_PEAK = flags.DEFINE_float("peak_gbps", 4800.0, "HBM bandwidth of the roofline, GB/s.")
_PRESET = flags.DEFINE_string("decode_preset", "qwen3_30b_a3b", "Model geometry of `decode`.")
_LAYERS = flags.DEFINE_integer("decode_layers", 4, "Layers of that geometry in `decode`.")
_CONTEXTS = flags.DEFINE_list("contexts", ["4096", "32768", "131072"], "Decode contexts.")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32", "128"], "Decode batch sizes.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed decode steps per row (after 3 warm-up).")
_MEMORY = flags.DEFINE_float("memory_fraction", 0.8, "Of the GPU's memory a row may use.")
_STUDY_PRESET = flags.DEFINE_string("study_preset", "small", "Model preset of `mismatch`.")
_ANY_BACKEND = flags.DEFINE_bool(
  "any_backend",
  False,
  "Run even without a GPU (kernels in interpret mode: checks the script, measures nothing).",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  return result.returncode, result.stdout + result.stderr


def probe_section() -> bool:
  implementation, reason = kernels_lib.resolve_with_reason("auto")
  print(
    markdown_table(["kernels='auto' picks", "fallback reason"], [(implementation, reason or "-")])
  )
  return implementation == "pallas"


def tests_section() -> bool:
  code, output = _run(
    [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", "tests/kernels"],
    timeout=1800,
  )
  print("```\n" + "\n".join(output.strip().splitlines()[-15:]) + "\n```")
  return code == 0


def kernels_section() -> bool:
  code, output = _run(
    [
      sys.executable,
      os.path.join(ROOT, "experiments", "bench_kernels.py"),
      "--batches=1,32,256",
      f"--peak_gbps={_PEAK.value}",
    ],
    timeout=1800,
  )
  print(output[output.find("\n| kernel") :].strip() if code == 0 else output[-4000:])
  return code == 0


def _random_cache(cfg, batch: int, slots: int, quant, key):
  """A cache with every slot written: random codes, finite E4M3 scales, unit global scales
  (or random bf16 entries); the next write goes to the last slot."""
  cache = init_cache(cfg, batch, slots, quant, dtype=jnp.bfloat16)
  leaves, tree = jax.tree.flatten(cache)
  keys = jax.random.split(key, len(leaves))

  def fill(leaf, k):
    if leaf.dtype == jnp.uint8:  # codes, or E4M3 scale bits in [0x20, 0x40): 2^-3 .. 2
      value = jax.random.randint(k, leaf.shape, 0, 256, jnp.int32)
      return (
        value.astype(jnp.uint8)
        if leaf.shape[-1] == cfg.head_dim // 2
        else (0x20 + value % 0x20).astype(jnp.uint8)
      )
    if leaf.dtype == jnp.bfloat16:
      return jax.random.normal(k, leaf.shape, jnp.bfloat16)
    if leaf.dtype == jnp.bool_:
      return jnp.ones(leaf.shape, bool)
    if leaf.ndim == 0:  # the write index
      return jnp.asarray(slots - 1, leaf.dtype)
    return leaf  # global scales: ones

  return jax.tree.unflatten(tree, [fill(leaf, k) for leaf, k in zip(leaves, keys)])


def _decode_bytes(cfg, params, batch: int, context: int, quant) -> float:
  """Bytes a decode step must read: the weights (of the routed experts only those the
  batch's tokens touch, expected count at uniform routing; of the embedding one row a
  token) and the KV cache."""
  touched = 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch if cfg.num_experts else 1
  total = 0.0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    names = {str(getattr(p, "key", getattr(p, "name", ""))) for p in path}
    nbytes = leaf.size * leaf.dtype.itemsize
    if "embed" in names:
      nbytes *= batch / cfg.vocab_size
    elif names & {"w_gate", "w_up", "w_down"} and "shared" not in names and leaf.ndim >= 3:
      nbytes *= touched  # stacked routed experts [E, ...]
    total += nbytes
  return total + batch * context * accounting.kv_bytes_per_token(cfg, quant)


def _decode_rate(policy, cfg, batch, context, precision, kernels, key):
  """(tokens/s, bytes read per step, seconds per step) of decode at `context` cached
  tokens: every step decodes the batch's next token at the same cache position."""
  quant = M.QuantConfig() if precision == "fp4" else None
  params = quantize_params_jit(nnx.state(policy), quant, dtype=jnp.bfloat16)
  graphdef = nnx.graphdef(policy)
  cache = _random_cache(cfg, batch, context + 1, quant, key)
  tokens = jax.random.randint(key, (batch, 1), 0, cfg.vocab_size)

  @functools.partial(jax.jit, donate_argnums=1)  # the cache is updated in place
  def step(params, cache, tokens):
    out = nnx.merge(graphdef, params)(
      tokens, cache=cache, quant=M.call_config(quant, compute_dtype="bfloat16", kernels=kernels)
    )
    return jnp.argmax(out.logits[:, -1], -1), dataclasses.replace(out.cache, index=cache.index)

  for _ in range(3):
    token, cache = step(params, cache, tokens)
  jax.block_until_ready(token)
  start = time.perf_counter()
  for _ in range(_STEPS.value):
    token, cache = step(params, cache, tokens)
  jax.block_until_ready(token)
  seconds = (time.perf_counter() - start) / _STEPS.value
  return batch / seconds, _decode_bytes(cfg, params, batch, context, quant), seconds


def decode_section() -> bool:
  cfg = M.get_preset(_PRESET.value, num_layers=_LAYERS.value)
  policy = M.Transformer(cfg, rngs=nnx.Rngs(0))
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0) * _MEMORY.value
  rows, key = [], jax.random.key(0)
  for context in map(int, _CONTEXTS.value):
    for batch in map(int, _BATCHES.value):
      rates = {}
      for arm, precision, kernels in (
        ("bf16", "bf16", "xla"),
        ("fp4 pallas", "fp4", "pallas"),
        ("fp4 xla", "fp4", "xla"),
      ):
        quant = M.QuantConfig() if precision == "fp4" else None
        cache_bytes = batch * (context + 1) * accounting.kv_bytes_per_token(cfg, quant)
        if limit and cache_bytes * 2 + accounting.weight_bytes(cfg) * 2 > limit:
          rows.append((context, batch, arm, "does not fit", "-", "-", "-"))
          continue
        try:
          rate, nbytes, seconds = _decode_rate(policy, cfg, batch, context, precision, kernels, key)
        except Exception as error:  # noqa: BLE001 (report the row, keep measuring)
          rows.append(
            (
              context,
              batch,
              arm,
              f"failed: {type(error).__name__}: {str(error)[:120]}",
              "-",
              "-",
              "-",
            )
          )
          continue
        rates[arm] = rate
        roofline = nbytes / (_PEAK.value * 1e9)
        rows.append(
          (
            context,
            batch,
            arm,
            f"{rate:.0f}",
            f"{nbytes / 2**20:.1f}",
            f"{roofline / seconds:.0%}",
            f"{rate / rates['bf16']:.2f}x" if "bf16" in rates else "-",
          )
        )
  print(
    f"{cfg.num_layers} layers of {cfg.name} (plus embedding and LM head), bf16 compute; "
    f"FP4: NVFP4 weights, activations and KV cache\n"
  )
  print(
    markdown_table(
      ["context", "batch", "rollout", "tokens/s", "MiB read / step", "of roofline", "vs bf16"], rows
    )
  )
  return True


def mismatch_section() -> bool:
  results = {}
  for kernels in ("pallas", "xla"):
    results[kernels] = run_study(
      StudyConfig(preset=_STUDY_PRESET.value, kernels=kernels), progress=False
    ).to_json()
  rows = []
  for mode in ("none", "compact", "full"):
    pallas, xla = (results[k]["modes"][mode] for k in ("pallas", "xla"))
    rows.append(
      (
        mode,
        f"{xla['k3_kl']:.3e}",
        f"{pallas['k3_kl']:.3e}",
        f"{pallas['k3_kl'] / max(xla['k3_kl'], 1e-30):.2f}x",
        f"{xla['code_disagree_frac']:.4%}",
        f"{pallas['code_disagree_frac']:.4%}",
      )
    )
  ran = {k: results[k]["kernels"]["rollout"] for k in results}
  print(f"{_STUDY_PRESET.value}: FP4 rollout on {ran}; training path identical\n")
  print(
    markdown_table(
      [
        "guidance",
        "k3_kl rollout xla",
        "k3_kl rollout pallas",
        "pallas / xla",
        "codes differ (xla)",
        "codes differ (pallas)",
      ],
      rows,
    )
  )
  return all(v == k for k, v in ran.items())


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  backend = jax.default_backend()
  if backend != "gpu" and not _ANY_BACKEND.value:
    print(
      f"gpu_check needs a GPU; the backend here is {backend!r}, so nothing ran. "
      "(tests/kernels/test_cuda_lowering.py checks the kernels' CUDA lowering anywhere.)"
    )
    return
  bad = [s for s in _SECTIONS.value if s not in SECTIONS]
  if bad:
    raise ValueError(f"--sections={bad} is not allowed; use some of {SECTIONS}")
  device = jax.devices()[0]
  print(
    f"# gpu_check on {device.device_kind} ({jax.device_count()} device(s)), jax "
    f"{jax.__version__}, roofline {_PEAK.value:.0f} GB/s\n"
  )
  verdicts = {}
  for section in _SECTIONS.value:
    print(f"\n## {section}\n")
    start = time.time()
    try:
      verdicts[section] = globals()[f"{section}_section"]()
    except Exception as error:  # noqa: BLE001 (one section's failure must not hide the rest)
      print(f"{section} failed: {type(error).__name__}: {error}")
      verdicts[section] = False
    print(f"\n({section}: {time.time() - start:.0f} s)")
  print("\n## verdict\n")
  print(markdown_table(["section", "ok"], [(s, "yes" if v else "NO") for s, v in verdicts.items()]))
  if not all(verdicts.values()):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
