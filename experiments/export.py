"""Export the trained FP4 policy of an RL run as a compressed-tensors checkpoint (vLLM, SGLang).

  python experiments/rl.py --workdir=runs/trace                      # train first
  python experiments/export.py --workdir=runs/trace --out=runs/trace/export
  python experiments/export.py --workdir=runs/trace --out=DIR --hf_checkpoint=SRC   # HF source
  python experiments/export.py --workdir=runs/trace --out=DIR --activations=none    # W4A16
  vllm serve DIR                                                       # on a GPU machine

Writes the last checkpoint's policy as the run ran it: its FP4 format (--fmt), FP4 scope
(--fp4_sites) and activations come from the run's saved config, and a flag that contradicts
them is refused (leave them unset). A W4A4 run exports W4A4 (NVFP4: static input global
scales calibrated on the run's own rollouts; MXFP4: dynamic); --activations=none exports
weight-only (W4A16), the only export of a W4A8 run. Per quantized linear `weight_packed` /
`weight_scale` / `weight_global_scale` (the rollout's bytes exactly), the rest in bf16,
config.json with quantization_config, and (with --hf_checkpoint, or the run's own) the
source's config, tokenizer and generation files (each must be a file inside the source
folder: a link that leads elsewhere is refused). The run's workdir is only read; --out is
written whole or not at all: it must be new, empty, or an earlier export of this script
(with its export_summary.json), which is replaced whole; any other folder, or a symbolic
link, is refused before any work. Prints one line: what was exported, and for NVFP4 W4A4 how
far the calibrated static activation scales are from the per-token ones the policy trained
with (--verbose: the tensor listing before it).
"""

import sys

from absl import app, flags, logging

from trace_jax.export.compressed_tensors import ACTIVATIONS, FORMATS
from trace_jax.export.run import describe, export_run
from trace_jax.model.quant import SITE_SCOPES
from trace_jax.run.checkpoint import CheckpointError

_WORKDIR = flags.DEFINE_string("workdir", None, "RL run directory (experiments/rl.py --workdir).")
_OUT = flags.DEFINE_string("out", None, "Output checkpoint directory.")
_HF = flags.DEFINE_string(
  "hf_checkpoint", None, "HF checkpoint the run started from (config, tokenizer files)."
)
_FMT = flags.DEFINE_enum("fmt", None, list(FORMATS), "Weight format (default: the run's).")
_SITES = flags.DEFINE_enum("fp4_sites", None, list(SITE_SCOPES), "FP4 scope (default: the run's).")
_ACTS = flags.DEFINE_enum(
  "activations",
  None,
  list(ACTIVATIONS),
  "none: weight-only W4A16; nvfp4 / mxfp4: W4A4 (default: the run's).",
)
_CALIB = flags.DEFINE_integer(
  "calibration_prompts",
  64,
  "Rollouts (>= 1) that calibrate (and, as many again, measure) W4A4 scales.",
)
_VERBOSE = flags.DEFINE_bool("verbose", False, "Also print the tensors, one row each.")
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
      fp4_sites=_SITES.value,
      calibration_prompts=_CALIB.value,
    )
  except (ValueError, OSError, CheckpointError) as e:  # one line: what, where, what to do
    print(f"export.py: error: {_one_line(e)}", file=sys.stderr)
    sys.exit(1)
  print(describe(summary, verbose=_VERBOSE.value))


def _one_line(error: Exception) -> str:
  """The error's message; an OSError's without its "[Errno n]" prefix, with its file."""
  if not isinstance(error, OSError) or not error.strerror:
    return str(error)
  name = error.filename
  return error.strerror if not name or str(name) in error.strerror else f"{error.strerror}: {name}"


if __name__ == "__main__":
  app.run(main)
