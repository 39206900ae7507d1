"""Rollout throughput bf16 vs FP4 (XLA path), cache and weight bytes, guidance bytes and cost.

  python experiments/bench_rollout.py                               # tiny + small, batch 8/64, 32/256 tokens
  python experiments/bench_rollout.py --presets=tiny --batches=8 --lengths=16 --repeats=1   # smoke
  python experiments/bench_rollout.py --mix=longtail --json=longtail.json   # slot pool vs waves

`--mix=longtail` (`longtail`, below): 256 sequences in groups of 8, response budgets long-tailed;
the static engine in waves of `--slots` sequences (the same KV memory as the pool) against a pool
of `--slots` decode slots, FP4 and bf16 each; peak_bytes is XLA's memory analysis of each
engine's programs (arguments, outputs, temporaries) plus the output rows both keep.

Every row is measured in one run: tokens/s is generated tokens (batch x new tokens, no stop
tokens) over the median wall time of a jitted generate after compilation. On CPU, FP4 is
emulated (dequantize then matmul), so it is slower than bf16 here; what FP4 buys is bytes,
which the second table shows and which is what bounds decode on a GPU.
"""

import json
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.model import accounting
from trace_jax.rollout import pool as pool_lib
from trace_jax.rollout.accounting import guidance_bytes_per_token
from trace_jax.rollout.decode import generate_program
from trace_jax.rollout.engine import _pad_left
from trace_jax.utils import markdown_table, round_up, time_jitted

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "Presets.")
_BATCHES = flags.DEFINE_list("batches", ["8", "64"], "Batch sizes.")
_LENGTHS = flags.DEFINE_list("lengths", ["32", "256"], "New tokens per sequence.")
_PROMPT = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (median).")
_MIX = flags.DEFINE_enum(
  "mix", "grid", ["grid", "longtail"], "grid: the tables above; longtail: pool vs static waves."
)
_JSON = flags.DEFINE_string("json", None, "longtail: write its rows here (a JSON list).")
_SEQUENCES = flags.DEFINE_integer("sequences", 256, "longtail: sequences per rollout.")
_GROUP = flags.DEFINE_integer("group", 8, "longtail: samples per prompt (a GRPO group).")
_CAP = flags.DEFINE_integer("cap", 256, "longtail: the response budget's cap (max_new_tokens).")
_SLOTS = flags.DEFINE_integer("slots", 16, "longtail: decode slots (and the static waves' size).")
_MEAN = flags.DEFINE_float("mean_frac", 0.3, "longtail: mean budget as a fraction of the cap.")
_CHECK = flags.DEFINE_integer(
  "stop_check_every",
  None,
  "longtail: decode steps between stop checks (default: the pool refills every 8; the static "
  "waves check every step on CPU, every 8 on GPU).",
)

ARMS = {
  "bf16": dict(precision="bf16", guidance="none", record_routing=False),
  "fp4": dict(precision="fp4", guidance="none", record_routing=False),
  "fp4+compact": dict(precision="fp4", guidance="compact"),
}


def longtail_budgets(rng: np.random.Generator, n: int, cap: int, mean_frac: float) -> np.ndarray:
  """n budgets in [1, cap]: cap * min(1, lognormal(mu, 1)), mu set (by bisection) so that the
  capped mean is `mean_frac` of the cap: many short responses, a few at the cap."""
  normal = np.random.default_rng(0).standard_normal(100_000)
  lo, hi = -10.0, 10.0
  for _ in range(60):
    mu = (lo + hi) / 2
    lo, hi = (mu, hi) if np.minimum(1.0, np.exp(mu + normal)).mean() < mean_frac else (lo, mu)
  draws = np.minimum(1.0, np.exp(mu + rng.standard_normal(n)))
  return np.clip(np.round(draws * cap), 1, cap).astype(np.int32)


def _program_bytes(lowered) -> int:
  """A program's device bytes by XLA's memory analysis: its arguments, outputs and
  temporaries, less the donated inputs its outputs reuse."""
  m = lowered.compile().memory_analysis()
  used = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
  return int(used - m.alias_size_in_bytes)


def _nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def _peak_bytes(engine, name: str, prompts, n: int, slots: int) -> int:
  """The device bytes an engine's rollout of `n` sequences needs at its peak (XLA's memory
  analysis of its programs, the same on every backend): a static wave of `slots` sequences
  (prefill and decode, one program), or the pool's state with its decode program or with a
  prefill of `slots` rows beside it; each plus the n sequences' output rows (no cache)."""
  st, graphdef, params = engine.statics, engine.graphdef, engine.params
  tokens, mask = _pad_left(prompts[:slots], engine.config.prompt_bucket, engine.config.pad_id)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  out = _nbytes(pool_lib.empty_output(graphdef, params, n, st))
  if name == "static":
    ids = jnp.arange(slots, dtype=jnp.uint32)
    budget = jnp.full((slots,), engine.config.sampling.max_new_tokens, jnp.int32)
    key = jax.random.key(0)
    lowered = generate_program.lower(graphdef, params, tokens, mask, key, None, ids, budget, st)
    return out + _program_bytes(lowered)
  state = pool_lib.empty_pool(graphdef, params, slots, st)
  decode = pool_lib.decode_program.lower(
    graphdef, params, state, jax.random.key(0), None, st.stop_every, st
  )
  prefill = pool_lib.prefill_program.lower(graphdef, params, tokens, mask, None, None, None, st)
  return out + max(_program_bytes(decode), _nbytes(state) + _program_bytes(prefill))


def _per_sequence(rollouts) -> list[tuple]:
  """Per sequence (the rows of `rollouts` in order): its real tokens, and at its real slots
  the guidance's packed mantissa bytes and block scales of every compact site."""
  out = []
  for r in rollouts:
    mask, tokens = np.asarray(r.mask), np.asarray(r.tokens)
    sites = [] if r.guidance is None else list(r.guidance.sites.values())
    sites = [g for g in sites if hasattr(g, "mantissa_bits")]  # compact guidance
    bits = [np.asarray(g.mantissa_bits) for g in sites]
    scales = [np.asarray(g.scales) for g in sites]
    for b in range(mask.shape[0]):
      real = mask[b]
      out.append((tokens[b][real], [x[b][real] for x in bits], [x[b][real] for x in scales]))
  return out


def agreement(static, pool) -> dict:
  """How far the pool's rollout is from the static engine's, sequence by sequence: the share
  of sequences with the same tokens, and over those, the share of recorded FP4 mantissa bits
  (the set bits of the packed bytes' XOR) and of block scales that differ."""
  same, bits, scales = 0, [0, 0], [0, 0]
  pool_rows = _per_sequence(pool)
  for (ts, bs, ss), (tp, bp, sp) in zip(_per_sequence(static), pool_rows):
    if not np.array_equal(ts, tp):
      continue
    same += 1
    for a, b in zip(bs, bp):
      bits[0] += int(np.unpackbits(a ^ b).sum())
      bits[1] += 8 * a.size
    for a, b in zip(ss, sp):
      scales[0] += int(np.sum(a != b))
      scales[1] += a.size
  return dict(
    same_tokens_frac=same / len(pool_rows),
    mantissa_bits_differ=bits[0] / bits[1] if bits[1] else None,
    block_scales_differ=scales[0] / scales[1] if scales[1] else None,
    mantissa_bits_compared=bits[1],
  )


def longtail() -> list[dict]:
  """The static engine in waves of `--slots` sequences against a pool of `--slots` slots,
  on the same prompts, budgets and keys (each timed after a warm-up run that compiles)."""
  cfg = M.get_preset(_PRESETS.value[0])
  policy = M.Transformer(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  n, group, cap, slots = _SEQUENCES.value, _GROUP.value, _CAP.value, _SLOTS.value
  distinct = [
    rng.integers(1, cfg.vocab_size, rng.integers(_PROMPT.value // 2, _PROMPT.value + 1)).tolist()
    for _ in range(-(-n // group))
  ]
  prompts = [p for p in distinct for _ in range(group)][:n]
  budgets = longtail_budgets(rng, n, cap, _MEAN.value)
  key = jax.random.key(0)
  rows = []
  for precision in ("fp4", "bf16"):
    config = R.RolloutConfig(
      precision=precision,
      guidance="compact" if precision == "fp4" else "none",
      max_len=round_up(_PROMPT.value, 16) + cap,
      prompt_bucket=16,
      sampling=R.SamplingConfig(max_new_tokens=cap, stop_check_every=_CHECK.value),
    )
    outputs = {}
    for name, engine_config in (("static", config), ("pool", config.replace(slots=slots))):
      engine = R.RolloutEngine(policy, engine_config)

      def run():
        if name == "pool":
          return [engine.generate(prompts, key, max_new_tokens=budgets)]
        return [  # waves of `slots` sequences: the pool's KV memory
          engine.generate(
            prompts[i : i + slots],
            key,
            sequences=range(i, min(i + slots, n)),
            max_new_tokens=budgets[i : i + slots],
          )
          for i in range(0, n, slots)
        ]

      jax.block_until_ready(run())  # compiles
      engine.take_stats()
      start = time.perf_counter()
      out = jax.block_until_ready(run())
      seconds = time.perf_counter() - start
      out = [r.without_cache() for r in out]
      outputs[name] = out
      stats = engine.take_stats()
      generated = sum(int(np.asarray(r.response_lengths).sum()) for r in out)
      peak = _peak_bytes(engine, name, prompts, n, slots)
      rows.append(
        dict(
          engine=name,
          precision=precision,
          tokens_per_second=generated / seconds,
          slot_utilization=stats.metrics()["rollout/slot_utilization"],
          prefill_shared_frac=stats.metrics()["rollout/prefill_shared_frac"],
          peak_bytes=peak,
          generated=generated,
          seconds=seconds,
        )
      )
    rows[-1].update(agreement(outputs["static"], outputs["pool"]))
    rows[-2].update({key: None for key in rows[-1] if key not in rows[-2]})
  return rows


def main(argv):
  del argv
  if _MIX.value == "longtail":
    rows = longtail()
    print(
      f"\nbackend {jax.default_backend()}, preset {_PRESETS.value[0]}, {_SEQUENCES.value} "
      f"sequences, groups of {_GROUP.value}, budgets capped at {_CAP.value}, {_SLOTS.value} "
      "slots (static: waves of as many)\n"
    )
    keys = list(rows[0])
    print(markdown_table(keys, [[row[k] for k in keys] for row in rows]))
    if _JSON.value:
      with open(_JSON.value, "w") as f:
        json.dump(rows, f, indent=1)
    return
  rows = []
  for name in _PRESETS.value:
    policy = M.Transformer(M.get_preset(name), rngs=nnx.Rngs(0))
    for batch in map(int, _BATCHES.value):
      prompts = [
        [(7 * i + j) % (policy.cfg.vocab_size - 1) + 1 for j in range(_PROMPT.value)]
        for i in range(batch)
      ]
      for length in map(int, _LENGTHS.value):
        seconds = {}
        for arm, kwargs in ARMS.items():
          config = R.RolloutConfig(
            max_len=_PROMPT.value + length,
            prompt_bucket=16,
            sampling=R.SamplingConfig(max_new_tokens=length),
            **kwargs,
          )
          engine = R.RolloutEngine(policy, config)
          seconds[arm] = time_jitted(
            lambda: engine.generate(prompts, jax.random.key(0)), repeats=_REPEATS.value, warmup=1
          )
        tokens = batch * length
        rows.append(
          (
            name,
            batch,
            length,
            *(f"{tokens / seconds[a]:.0f}" for a in ARMS),
            f"{seconds['bf16'] / seconds['fp4']:.2f}x",
            f"{seconds['fp4+compact'] / seconds['fp4']:.2f}x",
          )
        )
  print(f"\nbackend {jax.default_backend()}, prompt {_PROMPT.value} tokens, bf16 compute\n")
  print(
    markdown_table(
      [
        "preset",
        "batch",
        "new tokens",
        "bf16 tok/s",
        "fp4 tok/s",
        "fp4+compact tok/s",
        "fp4 speed vs bf16",
        "capture cost",
      ],
      rows,
    )
  )

  rows = []
  for name in M.PRESETS:
    cfg = M.get_preset(name)
    compact = R.RolloutConfig(guidance="compact")
    rows.append(
      (
        name,
        f"{accounting.weight_bytes(cfg) / 2**20:.4g}",
        f"{accounting.weight_bytes(cfg, 'nvfp4') / 2**20:.4g}",
        f"{accounting.kv_bytes_per_token(cfg):.0f}",
        f"{accounting.kv_bytes_per_token(cfg, M.QuantConfig()):.0f}",
        f"{guidance_bytes_per_token(cfg, compact):.0f}",
        f"{guidance_bytes_per_token(cfg, compact.replace(guided_layers='all')):.0f}",
        f"{guidance_bytes_per_token(cfg, compact.replace(guidance='full')):.0f}",
        f"{guidance_bytes_per_token(cfg, compact.replace(guidance='full', guided_layers='all')):.0f}",
      )
    )
  print()
  print(
    markdown_table(
      [
        "preset",
        "weights bf16 MiB",
        "weights NVFP4 MiB",
        "KV bf16 B/token",
        "KV FP4 B/token",
        "guidance compact half B/token",
        "compact all",
        "full half",
        "full all",
      ],
      rows,
    )
  )
  print("\nguidance bytes include routing (int8/int16 experts of every MoE layer).")


if __name__ == "__main__":
  app.run(main)
