"""TRACE guidance bytes per token at a preset's geometry, for both FP4 scopes, beside the
method's published figure (about 7.5 KB/token for compact guidance of the last 20 of 40
layers of Qwen3.5-35B-A3B).

  python experiments/guidance_bytes.py                          # qwen3_5_35b_a3b
  python experiments/guidance_bytes.py --preset=qwen3_30b_a3b

Everything comes from `jax.eval_shape` of a one-token forward (nothing is materialised), so
this runs on a laptop; the 35B geometry takes a minute or two to trace on 2 CPU cores.
"""

from absl import app, flags

from trace_jax import model as M
from trace_jax import rollout as R
from trace_jax.model.quant import SITE_SCOPES, layer_sites
from trace_jax.rollout.accounting import guidance_bytes_per_token
from trace_jax.utils import markdown_table

_PRESET = flags.DEFINE_string("preset", "qwen3_5_35b_a3b", f"One of {sorted(M.PRESETS)}.")
METHOD_KB = 7.5  # the method's compact guidance, last 20 of 40 layers, Qwen3.5-35B-A3B


def main(argv):
  del argv
  cfg = M.get_preset(_PRESET.value)
  variants = (
    ("compact", "last_half", False),
    ("compact", "last_half", True),
    ("full", "last_half", False),
    ("full", "all", True),
  )
  rows = []
  for sites in SITE_SCOPES:
    quant = M.QuantConfig(sites=sites)
    guided = quant.guided_layer_ids(cfg.num_layers)
    per_layer = layer_sites(cfg, quant)
    site_names = sorted({s for layer in guided for s in per_layer[layer]})
    for mode, layers, routing in variants:
      config = R.RolloutConfig(guidance=mode, guided_layers=layers, record_routing=routing)
      value = guidance_bytes_per_token(cfg, config, quant)
      rows.append(
        (
          sites,
          mode,
          layers,
          "yes" if routing else "no",
          ", ".join(site_names),
          f"{value:.0f}",
          f"{value / 1000:.2f}",
          f"{value / 1000 / METHOD_KB:.2f}x",
        )
      )
  print(
    f"\n{cfg.name}: {cfg.num_layers} layers ({len(cfg.linear_layers)} Gated DeltaNet), "
    f"{cfg.num_experts} experts top {cfg.num_experts_per_tok}\n"
  )
  print(
    markdown_table(
      [
        "scope",
        "guidance",
        "layers",
        "routing",
        "FP4 sites guided",
        "B/token",
        "KB/token",
        f"vs method's {METHOD_KB} KB",
      ],
      rows,
    )
  )


if __name__ == "__main__":
  app.run(main)
