"""Training-step time: bf16, FP4 QAT (nearest), TRACE compact and TRACE full, as ratios to bf16.

  python experiments/bench_train.py                           # tiny and small, batch 8 x 128 slots
  python experiments/bench_train.py --presets=tiny --repeats=2  # quick

One rollout batch (FP4, full guidance on every layer, routing) feeds all four; each step is a
jitted forward + backward of a policy-gradient surrogate over the response tokens plus an
Adam update. Every arm is compiled and warmed up first, and its guidance is already on the
device, so a timed call is the update alone; the arms are then timed round robin (each
round calls every arm once, `utils.time_interleaved`), so a load that comes and goes on a
shared machine falls on every arm alike, and each ratio is the median of the per-round
ratios. A second table: the recording cost of the trainer's pi_old forward (every site's FP4
outcome returned beside the log-probabilities), timed the same way.
"""

import functools
import statistics

from absl import app, flags
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.model.quant import resolve_layers
from trace_jax.training import training_forward
from trace_jax.utils import markdown_table, median_ratio, time_interleaved

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "Presets.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step.")
_NEW = flags.DEFINE_integer("new_tokens", 112, "Generated tokens per sequence (prompt 16).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions (median).")


_BF16 = M.CallOptions(compute_dtype="bfloat16")  # the trainer's compute dtype


def _recording_cost(name, policy, rollout, guidance):
  """The trainer's pi_old forward (guided, full guidance, every layer) with and without
  recording every site's outcome (what the per-layer disagreement metrics read)."""
  calls = {}
  for record in (False, True):
    quant = M.QuantConfig(rounding="guided", guided_layers="all")
    options = M.CallOptions(
      compute_dtype="bfloat16", recording=M.Recording(form="full" if record else "none")
    )

    @nnx.jit
    def forward(model, r, guidance, quant=quant, options=options):
      logp, out = training_forward(
        model,
        r.tokens,
        r.positions,
        r.mask,
        quant=quant,
        guidance=guidance,
        routing_replay=True,
        options=options,
      )
      return logp, out.sites

    calls[record] = functools.partial(forward, policy, rollout, guidance)
  samples = time_interleaved(calls, repeats=_REPEATS.value)
  return (
    name,
    f"{statistics.median(samples[False]) * 1e3:.1f}",
    f"{statistics.median(samples[True]) * 1e3:.1f}",
    f"{median_ratio(samples, True, False):.2f}x",
  )


def main(argv):
  del argv
  rows, record_rows = [], []
  for name in _PRESETS.value:
    policy = M.Transformer(M.get_preset(name), rngs=nnx.Rngs(0))
    config = R.RolloutConfig(
      guidance="full",
      guided_layers="all",
      max_len=16 + _NEW.value,
      sampling=R.SamplingConfig(max_new_tokens=_NEW.value),
    )
    prompts = [[1 + (i * 5 + j) % 90 for j in range(16)] for i in range(_BATCH.value)]
    rollout = R.RolloutEngine(policy, config).generate(prompts, jax.random.key(0)).without_cache()
    half = resolve_layers("last_half", policy.cfg.num_layers)
    arms = {
      "bf16": (None, None, False),
      "fp4-qat": (M.QuantConfig(), None, False),
      "trace compact": (
        M.QuantConfig(rounding="guided"),
        rollout.guidance.to_compact().select_layers(half),
        True,
      ),
      "trace full": (M.QuantConfig(rounding="guided", guided_layers="all"), rollout.guidance, True),
    }
    calls, bytes_per_token = {}, {}
    for arm, (quant, guidance, replay) in arms.items():
      model = M.Transformer(policy.cfg, rngs=nnx.Rngs(0))
      opt = nnx.Optimizer(model, optax.adam(1e-5), wrt=nnx.Param)

      @nnx.jit
      def step(model, opt, r, guidance, quant=quant, replay=replay):
        def loss_fn(model):
          logp, _ = training_forward(
            model,
            r.tokens,
            r.positions,
            r.mask,
            quant=quant,
            guidance=guidance,
            routing_replay=replay,
            options=_BF16,
          )
          return -jnp.sum(logp * r.response_mask) / jnp.maximum(jnp.sum(r.response_mask), 1)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

      calls[arm] = functools.partial(step, model, opt, rollout, guidance)
      bytes_per_token[arm] = 0 if guidance is None else guidance.bytes_per_token()
    samples = time_interleaved(calls, repeats=_REPEATS.value)
    for arm in arms:
      rows.append(
        (
          name,
          arm,
          f"{statistics.median(samples[arm]) * 1e3:.1f}",
          f"{median_ratio(samples, arm, 'bf16'):.2f}x",
          f"{median_ratio(samples, arm, 'fp4-qat'):.2f}x",
          f"{bytes_per_token[arm]:.0f}",
        )
      )
    record_rows.append(_recording_cost(name, policy, rollout, rollout.guidance))
  print(
    f"\nbatch {_BATCH.value} x {16 + _NEW.value} slots, bf16 compute, backend "
    f"{jax.default_backend()}\n"
  )
  headers = ["preset", "arm", "step ms (median)", "vs bf16", "vs fp4-qat", "guidance bytes/token"]
  print(markdown_table(headers, rows))
  print()
  print(
    markdown_table(
      ["preset", "pi_old forward ms (trace full)", "+ record every site ms", "recording cost"],
      record_rows,
    )
  )


if __name__ == "__main__":
  app.run(main)
