"""Export of an RL run: the run's own format, scope and activations (a
contradicting setting refused, naming both values); nothing written to the run, even while
it runs; the output folder replaced whole.

The run is real but short: an `--fmt=mxfp4` Trainer (MXFP4 needs widths in multiples of 32:
the `small` preset) saving its step-0 checkpoint, without training (an RL step of `small`
compiles for minutes on 2 cores; the slow test at the end runs rl.py, then the export
command rl.py prints).
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from tests.utils.test_lock import _snapshot, held
from trace_jax import fp4
from trace_jax.export import names as names_lib
from trace_jax.export.run import describe, export_run, export_settings
from trace_jax.model.hf import read_safetensors
from trace_jax.rl.config import RLConfig
from trace_jax.run.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MXFP4_RUN = dict(
  arm="trace",
  task="arith",
  preset="small",
  fmt="mxfp4",
  steps=1,
  prompts_per_step=1,
  group_size=2,
  max_new_tokens=4,
  sft_steps=0,
  eval_every=0,
  eval_size=0,
  checkpoint_every=1,
)
EXPORT_FILES = ["config.json", "export_summary.json", "model.safetensors"]


@pytest.fixture(scope="module")
def mxfp4_run(tmp_path_factory):
  """(workdir, model config, the rollout engine's packed weights {path: QArray})."""
  workdir = tmp_path_factory.mktemp("mxfp4") / "run"
  with Trainer(RLConfig.from_flat(**MXFP4_RUN), str(workdir), progress=False) as trainer:
    trainer.save()
    flat = nnx.to_flat_state(trainer.engine.params)
    packed = {p: v.get_value() for p, v in flat if isinstance(v.get_value(), fp4.QArray)}
    return workdir, trainer.model_cfg, packed


def _tensors(out) -> dict:
  tensors = {}
  for name in os.listdir(out):
    if name.endswith(".safetensors"):
      tensors.update(read_safetensors(os.path.join(out, name)))
  return tensors


def test_an_mxfp4_run_exports_mxfp4_its_rollout_bytes_and_replaces_the_folder_whole(
  mxfp4_run, tmp_path
):
  workdir, cfg, packed = mxfp4_run
  out = tmp_path / "export"
  summary = export_run(str(workdir), str(out))  # no format settings: the run's
  qc = json.loads((out / "config.json").read_text())["quantization_config"]
  assert qc["format"] == "mxfp4-pack-quantized" and summary["step"] == 0
  written = json.loads((out / "export_summary.json").read_text())
  assert (written["fmt"], written["activations"], written["fp4_sites"]) == ("mxfp4",) * 2 + ("all",)
  scheme = qc["config_groups"]["group_0"]
  assert (scheme["weights"]["group_size"], scheme["weights"]["scale_dtype"]) == (32, "torch.uint8")
  # The run rolled out W4A4 (activations="fp4"): MXFP4 inputs, dynamic scales.
  assert scheme["input_activations"]["group_size"] == 32 and scheme["input_activations"]["dynamic"]
  tensors = _tensors(out)
  assert not [n for n in tensors if n.endswith("global_scale")]  # MXFP4 has none
  # Every FP4 weight the rollout multiplied with is in the files, byte for byte.
  assert len(packed) > 8 and {q.fmt for q in packed.values()} == {"mxfp4"}
  for path, q in packed.items():
    for target in names_lib.targets(cfg, path):
      codes, scales = (names_lib.hf_array(np.asarray(a), target) for a in (q.packed, q.scales))
      np.testing.assert_array_equal(tensors[f"{target.module}.weight_packed"], codes)
      np.testing.assert_array_equal(tensors[f"{target.module}.weight_scale"], scales)

  # An earlier, larger export left shards and an index there: the next replaces it whole.
  for stale in ("model-00002-of-00002.safetensors", "model.safetensors.index.json"):
    shutil.copyfile(out / "model.safetensors", out / stale)
  export_run(str(workdir), str(out), fmt="mxfp4", fp4_sites="all", activations="mxfp4")
  assert sorted(os.listdir(out)) == EXPORT_FILES
  assert sorted(os.listdir(tmp_path)) == ["export"]  # no staging or old folder beside it
  assert _tensors(out).keys() == tensors.keys()


def test_the_export_prints_one_line_and_the_tensors_only_when_verbose(mxfp4_run, tmp_path):
  workdir, _, _ = mxfp4_run
  summary = export_run(str(workdir), str(tmp_path / "export"))
  line = describe(summary)
  assert "\n" not in line and "{" not in line
  assert line.startswith(
    f"exported step 0 of {workdir} to {tmp_path / 'export'}: mxfp4-pack-quantized, W4A4 "
    f"(mxfp4 activations), fp4_sites=all; {summary['tensors']} tensors ("
  )
  assert re.search(r"modules kept in bf16\), \d+\.\d [KMG]B in 1 file$", line), line
  listing = describe(summary, verbose=True).splitlines()
  assert listing[-1] == line and len(listing) == summary["tensors"] + 3  # header, rule, rows
  with_distance = {**summary, "input_scale_distance": {"rel_l2": 0.0123456, "saturated_frac": 0}}
  assert describe(with_distance).endswith(
    "; static input scales vs per-token: rel_l2 0.0123, saturated_frac 0"
  )


def test_a_setting_that_contradicts_the_run_is_refused_naming_both(mxfp4_run, tmp_path):
  workdir, _, _ = mxfp4_run
  out = tmp_path / "export"
  for settings, message in (
    (dict(fmt="nvfp4"), "--fmt=nvfp4 contradicts the run's fmt='mxfp4'"),
    (
      dict(fp4_sites="experts+kv"),
      "--fp4_sites=experts\\+kv contradicts the run's fp4_sites='all'",
    ),
    (dict(activations="nvfp4"), "--activations=nvfp4 contradicts the run's activations='fp4'"),
  ):
    with pytest.raises(ValueError, match=message):
      export_run(str(workdir), str(out), **settings)
  assert not out.exists()
  (out / "notes").mkdir(parents=True)  # a folder holding something else is never replaced
  with pytest.raises(ValueError, match="holds files but no earlier export"):
    export_run(str(workdir), str(out))
  with pytest.raises(ValueError, match="holds the run's workdir"):
    export_run(str(workdir), str(workdir))
  assert os.listdir(out) == ["notes"]


def test_export_writes_nothing_to_the_run_even_while_it_runs(mxfp4_run, tmp_path, caplog):
  workdir = tmp_path / "run"
  shutil.copytree(mxfp4_run[0], workdir)
  shutil.rmtree(workdir / "warmstart")  # no warm start: exported as saved, never trained
  # Lines past the checkpoint's step (a run that crashed after logging them): a Trainer
  # would cut them on resume, an export must not.
  (workdir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(4)))
  with held(workdir) as run:  # the run is still going
    before = _snapshot(workdir)
    export_run(str(workdir), str(workdir / "export"))  # where rl.py's command puts it
    after = _snapshot(workdir)
  assert {k: v for k, v in after.items() if not k.startswith("export")} == before
  assert sorted(os.listdir(workdir / "export")) == EXPORT_FILES
  assert f"is in use by pid {run.pid} on host" in caplog.text
  assert "exporting its latest finished checkpoint, step 0" in caplog.text


@pytest.mark.parametrize(
  "run, given, expected",
  [
    (dict(fmt="mxfp4"), {}, ("mxfp4", "mxfp4", "all")),
    (dict(fmt="nvfp4"), {}, ("nvfp4", "nvfp4", "all")),
    (dict(fmt="nvfp4", fp4_sites="experts+kv"), {}, ("nvfp4", "nvfp4", "experts+kv")),
    (dict(fmt="mxfp4"), dict(activations="none"), ("mxfp4", "none", "all")),  # weight-only
    (dict(fmt="mxfp4", activations="fp8"), dict(activations="none"), ("mxfp4", "none", "all")),
    (dict(fmt="mxfp4", activations="fp8"), {}, "activations='fp8' .*--activations=none"),
    (dict(fmt="mxfp4", activations="fp8"), dict(activations="mxfp4"), "contradicts"),
    (dict(fmt="nvfp4"), dict(activations="mxfp4"), "contradicts the run's activations='fp4'"),
    (dict(fmt="nvfp4"), dict(fmt="mxfp4"), "--fmt=mxfp4 contradicts the run's fmt='nvfp4'"),
    (dict(fmt="nvfp4"), dict(fmt="nvfp4", fp4_sites="all"), ("nvfp4", "nvfp4", "all")),
  ],
)
def test_export_settings_follow_the_run(run, given, expected):
  config = RLConfig.from_flat(preset="small", **run)
  if isinstance(expected, str):
    with pytest.raises(ValueError, match=expected):
      export_settings(config, **given)
  else:
    assert export_settings(config, **given) == expected


@pytest.mark.slow
@pytest.mark.timeout(2700)  # a run and an export of up to 20 min each
def test_rl_py_mxfp4_run_and_the_export_command_it_prints(tmp_path):
  """The export end to end (minutes on 2 cores: an RL step of `small` compiles): an
  `rl.py --fmt=mxfp4` run, then the export command it prints, run as printed."""
  workdir = tmp_path / "run"
  flags = [f"--{k}={v}" for k, v in MXFP4_RUN.items()]
  env = dict(os.environ, PYTHONPATH=ROOT)
  run = subprocess.run(
    [sys.executable, os.path.join(ROOT, "experiments", "rl.py"), f"--workdir={workdir}", *flags],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=1200,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert "run.lock" not in os.listdir(workdir)  # released at the end
  (line,) = [line for line in run.stdout.splitlines() if line.startswith("export for vLLM")]
  command = shlex.split(re.search(r"python (experiments/export.py .*)$", line).group(1))
  assert not [f for f in command if f.startswith(("--fmt", "--activations", "--fp4_sites"))]
  export = subprocess.run(
    [sys.executable, *command], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200
  )
  assert export.returncode == 0, export.stderr[-3000:]
  config = json.loads((workdir / "export" / "config.json").read_text())
  assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
  assert json.loads((workdir / "export" / "export_summary.json").read_text())["step"] == 1
