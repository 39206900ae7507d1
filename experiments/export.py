"""Export the trained FP4 policy of an RL run as a compressed-tensors checkpoint (vLLM, SGLang).

  python experiments/rl.py --workdir=runs/trace                      # train first
  python experiments/export.py --workdir=runs/trace --out=runs/trace/export
  python experiments/export.py --workdir=runs/trace --out=DIR --hf_checkpoint=SRC   # HF source
  python experiments/export.py --workdir=runs/trace --out=DIR --activations=nvfp4   # W4A4
  vllm serve DIR                                                       # on a GPU machine

Writes the last checkpoint's policy in the run's FP4 scope: `weight_packed` / `weight_scale` /
`weight_global_scale` per quantized linear (the rollout's bytes exactly), the rest in bf16,
config.json with quantization_config, and (with --hf_checkpoint) the source's config,
tokenizer and generation files. Prints the tensor listing and, for W4A4, how far the
calibrated static activation scales are from the per-token ones the policy trained with.
"""

from absl import app, flags, logging

from trace_jax.export.compressed_tensors import ACTIVATIONS, FORMATS, ExportConfig
from trace_jax.export.run import describe, export_run, format_listing

_D = ExportConfig()
_WORKDIR = flags.DEFINE_string("workdir", None, "RL run directory (experiments/rl.py --workdir).")
_OUT = flags.DEFINE_string("out", None, "Output checkpoint directory.")
_HF = flags.DEFINE_string(
  "hf_checkpoint", None, "HF checkpoint the run started from (config, tokenizer files)."
)
_FMT = flags.DEFINE_enum("fmt", _D.fmt, list(FORMATS), "Weight format.")
_ACTS = flags.DEFINE_enum(
  "activations", _D.activations, list(ACTIVATIONS), "none: weight-only W4A16; nvfp4 / mxfp4: W4A4."
)
_CALIB = flags.DEFINE_integer(
  "calibration_prompts", 64, "Rollouts that calibrate (and, as many again, measure) W4A4 scales."
)
_LIST = flags.DEFINE_bool("list", True, "Print the tensor listing.")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  try:
    summary = export_run(
      _WORKDIR.value,
      _OUT.value,
      hf_checkpoint=_HF.value,
      fmt=_FMT.value,
      activations=_ACTS.value,
      calibration_prompts=_CALIB.value,
    )
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if _LIST.value:
    print(format_listing(summary["out_dir"]))
  print(describe(summary))
  if "input_scale_distance" in summary:
    print("static input scales vs per-token:", summary["input_scale_distance"])


if __name__ == "__main__":
  app.run(main)
