"""Rollout throughput bf16 vs FP4 (XLA path), cache and weight bytes, guidance bytes and cost.

  python experiments/bench_rollout.py                               # tiny + small, batch 8/64, 32/256 tokens
  python experiments/bench_rollout.py --presets=tiny --batches=8 --lengths=16 --repeats=1   # smoke

Every row is measured in one run: tokens/s is generated tokens (batch x new tokens, no stop
tokens) over the median wall time of a jitted generate after compilation. On CPU, FP4 is
emulated (dequantize then matmul), so it is slower than bf16 here; what FP4 buys is bytes,
which the second table shows and which is what bounds decode on a GPU.
"""

from absl import app, flags
import jax
from flax import nnx

from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.model import accounting
from trace_jax.rollout.accounting import guidance_bytes_per_token
from trace_jax.utils import markdown_table, time_jitted

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "Presets.")
_BATCHES = flags.DEFINE_list("batches", ["8", "64"], "Batch sizes.")
_LENGTHS = flags.DEFINE_list("lengths", ["32", "256"], "New tokens per sequence.")
_PROMPT = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (median).")

ARMS = {
  "bf16": dict(precision="bf16", guidance="none", record_routing=False),
  "fp4": dict(precision="fp4", guidance="none", record_routing=False),
  "fp4+compact": dict(precision="fp4", guidance="compact"),
}


def main(argv):
  del argv
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
