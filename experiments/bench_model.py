"""Model cost: forward / train-step time bf16 vs FP4 fake quantization, and bytes per preset.

  python experiments/bench_model.py                       # tiny and small, all presets' bytes
  python experiments/bench_model.py --presets=tiny --batch=4 --seq=64 --repeats=3   # quick
  python experiments/bench_model.py --presets=qwen3_5_tiny --batch=4 --seq=64  # hybrid model

Times are medians of jitted calls measured in one run, so the fp4/bf16 ratio is what to
read (these machines are noisy). Bytes come from jax.eval_shape: nothing is materialised.
"""

from absl import app, flags
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trace_jax import model as M
from trace_jax.model import accounting
from trace_jax.utils import markdown_table, time_jitted

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small", "qwen3_5_tiny"], "Presets to time.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per batch.")
_SEQ = flags.DEFINE_integer("seq", 128, "Tokens per sequence.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions (median).")

FP4 = M.QuantConfig()
SCOPE = M.QuantConfig(sites="experts+kv")  # the method's own FP4 scope


def _step_fns(quant):
  @nnx.jit
  def forward(model, tokens):
    return model(tokens, quant=quant).logits

  @nnx.jit
  def train_step(model, opt, tokens):
    def loss_fn(model):
      out = model(tokens[:, :-1], quant=quant)
      logp = jax.nn.log_softmax(out.logits)
      nll = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
      return nll + model.cfg.router_aux_loss_coef * out.lb_loss

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  return forward, train_step


def main(argv):
  del argv
  rows = []
  for name in _PRESETS.value:
    cfg = M.get_preset(name, dtype="bfloat16")
    tokens = jax.random.randint(
      jax.random.key(0), (_BATCH.value, _SEQ.value + 1), 0, cfg.vocab_size
    )
    times = {}
    for label, quant in (("bf16", None), ("fp4", FP4), ("fp4 experts+kv", SCOPE)):
      model = M.Transformer(cfg, rngs=nnx.Rngs(0))
      opt = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
      forward, train_step = _step_fns(quant)
      times[label] = (
        time_jitted(forward, model, tokens[:, :-1], repeats=_REPEATS.value),
        time_jitted(train_step, model, opt, tokens, repeats=_REPEATS.value),
      )
    for i, what in enumerate(("forward", "train step")):
      bf16, fp4, scope = times["bf16"][i], times["fp4"][i], times["fp4 experts+kv"][i]
      rows.append(
        (
          name,
          what,
          f"{bf16 * 1e3:.1f}",
          f"{fp4 * 1e3:.1f}",
          f"{fp4 / bf16:.2f}x",
          f"{scope * 1e3:.1f}",
          f"{scope / bf16:.2f}x",
        )
      )
  print(
    f"\nbatch {_BATCH.value} x {_SEQ.value} tokens, compute bf16, backend {jax.default_backend()}\n"
  )
  print(
    markdown_table(
      [
        "preset",
        "op",
        "bf16 ms",
        "fp4 (all) ms",
        "fp4 / bf16",
        "fp4 experts+kv ms",
        "experts+kv / bf16",
      ],
      rows,
    )
  )

  rows = []
  for name in M.PRESETS:
    cfg = M.get_preset(name)
    bf16, nvfp4 = accounting.weight_bytes(cfg), accounting.weight_bytes(cfg, "nvfp4")
    scope = accounting.weight_bytes(cfg, "nvfp4", sites="experts+kv")
    kv_bf16 = accounting.kv_bytes_per_token(cfg)
    kv_fp4 = accounting.kv_bytes_per_token(cfg, FP4)
    state = accounting.state_bytes_per_sequence(cfg)
    rows.append(
      (
        name,
        f"{accounting.param_count(cfg) / 1e9:.4g}B",
        f"{bf16 / 2**30:.4g}",
        f"{nvfp4 / 2**30:.4g}",
        f"{bf16 / nvfp4:.2f}x",
        f"{scope / 2**30:.4g}",
        f"{kv_bf16 / 1024:.4g}",
        f"{kv_fp4 / 1024:.4g}",
        f"{kv_bf16 / kv_fp4:.2f}x",
        f"{state / 2**20:.4g}",
      )
    )
  print()
  print(
    markdown_table(
      [
        "preset",
        "params",
        "weights bf16 GiB",
        "weights NVFP4 GiB",
        "ratio",
        "NVFP4 experts+kv GiB",
        "KV bf16 KiB/token",
        "KV FP4 KiB/token",
        "ratio",
        "linear-attn state MiB/seq",
      ],
      rows,
    )
  )
  print(
    "\nNVFP4 weights: linear layers packed (4.5 bits + f32 scale per matrix/expert); "
    "embedding, LM head, router and norms stay bf16."
  )


if __name__ == "__main__":
  app.run(main)
