"""What an export may replace, read and leave behind: only a folder it wrote is replaced
(never a downloaded checkpoint), a symbolic link as the output is refused, a source file
that links outside the source folder is refused by name, a killed export's staging folder
is removed by the next one (a live one's never), and the files follow the umask. The run
export checks its output folder and flags before loading or calibrating anything."""

import json
import os
import signal
import subprocess
import sys

import pytest
from flax import nnx

from trace_jax import model as M
from trace_jax.export import export_compressed_tensors, hf_config
from trace_jax.export import run as run_lib
from trace_jax.rl.config import RLConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IO_PY = os.path.join(ROOT, "trace_jax", "utils", "io.py")


@pytest.fixture(scope="module")
def tiny_policy():
  return M.Transformer(M.tiny(), rngs=nnx.Rngs(11))


def _tree(folder) -> dict:
  """Every file under `folder` (links not followed) -> its bytes, or the link's target."""
  out = {}
  for d, dirs, names in os.walk(folder):
    for n in names + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
      path = os.path.join(d, n)
      rel = os.path.relpath(path, folder)
      out[rel] = ("link", os.readlink(path)) if os.path.islink(path) else open(path, "rb").read()
  return out


def _downloaded_nvfp4(folder) -> None:
  """What a quantized model downloaded from a hub looks like: config.json with a
  compressed-tensors quantization_config, shards, a README and eval results."""
  folder.mkdir(parents=True)
  config = {"model_type": "qwen3_moe", "quantization_config": {"format": "nvfp4-pack-quantized"}}
  (folder / "config.json").write_text(json.dumps(config))
  (folder / "model.safetensors").write_bytes(os.urandom(256))
  (folder / "README.md").write_text("# A model someone else quantized\n")
  (folder / "eval_results.json").write_text('{"gsm8k": 0.81}')


def test_a_quantized_checkpoint_this_tool_did_not_write_is_never_replaced(tiny_policy, tmp_path):
  downloaded = tmp_path / "Qwen3-30B-A3B-NVFP4"
  _downloaded_nvfp4(downloaded)
  before = _tree(downloaded)
  with pytest.raises(ValueError, match="holds files but no earlier export of this tool"):
    export_compressed_tensors(tiny_policy, str(downloaded))
  assert _tree(downloaded) == before
  # Only its weights and config (nothing else to tell it from an export): still refused.
  for name in ("README.md", "eval_results.json"):
    (downloaded / name).unlink()
  before = _tree(downloaded)
  with pytest.raises(ValueError, match="no export_summary.json in it"):
    export_compressed_tensors(tiny_policy, str(downloaded), summary_extra={})
  assert _tree(downloaded) == before
  assert sorted(os.listdir(tmp_path)) == ["Qwen3-30B-A3B-NVFP4"]  # no staging left either


def test_an_earlier_export_is_replaced_but_not_one_holding_other_files(tiny_policy, tmp_path):
  out = tmp_path / "export"
  export_compressed_tensors(tiny_policy, str(out), summary_extra={"step": 1})
  first = _tree(out)
  (out / "model-00002-of-00002.safetensors").write_bytes(b"an earlier, larger export")
  export_compressed_tensors(tiny_policy, str(out), summary_extra={"step": 1})
  assert _tree(out) == first  # replaced whole, the same bytes again
  (out / "NOTES.md").write_text("my notes on this export")
  (out / "evals").mkdir()
  with pytest.raises(ValueError, match=r"also holds \['NOTES.md', 'evals'\], which no export"):
    export_compressed_tensors(tiny_policy, str(out), summary_extra={"step": 2})
  assert (out / "NOTES.md").read_text() == "my notes on this export"


def test_a_symlinked_out_is_refused_before_any_work(tiny_policy, tmp_path):
  real = tmp_path / "real"
  real.mkdir()
  link = tmp_path / "link"
  link.symlink_to(real)
  for given in (str(link), str(link) + os.sep):
    with pytest.raises(ValueError, match=r"out_dir=.*link.* is a symbolic link .*real"):
      export_compressed_tensors(tiny_policy, given)
  assert os.path.islink(link) and os.listdir(real) == []
  assert sorted(os.listdir(tmp_path)) == ["link", "real"]
  file_out = tmp_path / "file"
  file_out.write_text("x")
  with pytest.raises(ValueError, match="exists and is not a folder"):
    export_compressed_tensors(tiny_policy, str(file_out))


def _source(folder, policy) -> None:
  folder.mkdir(parents=True)
  (folder / "config.json").write_text(json.dumps(hf_config(policy.cfg)))
  (folder / "tokenizer_config.json").write_text('{"model_max_length": 128}')


@pytest.mark.parametrize("name", ["vocab.json", "special_tokens_map.json", "config.json"])
def test_a_source_file_that_links_outside_the_source_is_refused_by_name(
  tiny_policy, tmp_path, name
):
  secret = tmp_path / "elsewhere" / "credentials.json"
  secret.parent.mkdir()
  secret.write_text('{"private_key": "-----BEGIN PRIVATE KEY----- abc"}')
  source = tmp_path / "ckpt"
  _source(source, tiny_policy)
  (source / name).unlink(missing_ok=True)
  (source / name).symlink_to(secret)
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=rf"ckpt/{name} leads to .*credentials.json, outside"):
    export_compressed_tensors(tiny_policy, str(out), source=str(source), summary_extra={})
  assert not out.exists()
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "elsewhere"]


def test_source_links_inside_the_source_or_hub_cache_are_followed(tiny_policy, tmp_path):
  # A folder laid out as the Hugging Face hub cache: snapshot files link to ../../blobs/.
  repo = tmp_path / "models--org--tiny"
  snapshot = repo / "snapshots" / "0123abcd"
  _source(snapshot, tiny_policy)
  (repo / "blobs").mkdir()
  (repo / "blobs" / "9f8e").write_text('{"bos_token": "<s>"}')
  (snapshot / "special_tokens_map.json").symlink_to(os.path.join("..", "..", "blobs", "9f8e"))
  (snapshot / "sub").mkdir()
  (snapshot / "sub" / "merges.txt").write_text("#version: 0.2\na b\n")
  (snapshot / "merges.txt").symlink_to(os.path.join("sub", "merges.txt"))
  out = tmp_path / "out"
  summary = export_compressed_tensors(tiny_policy, str(out), source=str(snapshot))
  assert summary["copied"] == ["tokenizer_config.json", "special_tokens_map.json", "merges.txt"]
  assert (out / "special_tokens_map.json").read_text() == '{"bos_token": "<s>"}'
  assert (out / "merges.txt").read_text() == "#version: 0.2\na b\n"
  assert not os.path.islink(out / "merges.txt")
  # A dangling link (the file it names is gone) is refused, never silently left out.
  (snapshot / "vocab.json").symlink_to("missing.json")
  with pytest.raises(ValueError, match="vocab.json is not a regular file"):
    export_compressed_tensors(tiny_policy, str(tmp_path / "out2"), source=str(snapshot))


_WRITER = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("io_under_test", sys.argv[1])
io = importlib.util.module_from_spec(spec)
spec.loader.exec_module(io)
with io.atomic_directory(sys.argv[2]) as staging:
  open(os.path.join(staging, "model.safetensors"), "wb").write(sys.argv[3].encode())
  print(staging, flush=True)
  if sys.argv[3] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
  sys.stdin.read()  # live: holds its staging folder until told to finish
"""


def test_a_killed_exports_staging_folder_is_removed_a_live_ones_kept(tmp_path):
  from trace_jax.utils.io import atomic_directory

  out = tmp_path / "export"
  killed = subprocess.run(
    [sys.executable, "-c", _WRITER, IO_PY, str(out), "killed"], capture_output=True, text=True
  )
  assert killed.returncode == -signal.SIGKILL
  killed_staging = killed.stdout.strip()
  assert os.path.isdir(killed_staging) and not out.exists()
  live = subprocess.Popen(
    [sys.executable, "-c", _WRITER, IO_PY, str(out), "live"],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    live_staging = live.stdout.readline().strip()
    with atomic_directory(str(out)) as staging:
      open(os.path.join(staging, "model.safetensors"), "wb").write(b"ours")
    assert not os.path.exists(killed_staging)  # the dead writer's, removed
    assert os.path.isdir(live_staging)  # the live writer's, untouched
    assert sorted(os.listdir(tmp_path)) == sorted(["export", os.path.basename(live_staging)])
  finally:
    live.communicate("", timeout=60)
  assert live.returncode == 0
  assert sorted(os.listdir(tmp_path)) == ["export"]  # the live one then published its own
  assert (out / "model.safetensors").read_bytes() == b"live"


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_exported_files_follow_the_umask_as_copied_ones_do(tiny_policy, tmp_path, umask):
  source = tmp_path / "ckpt"
  _source(source, tiny_policy)
  out = tmp_path / "out"
  previous = os.umask(umask)
  try:
    export_compressed_tensors(
      tiny_policy, str(out), source=str(source), max_shard_bytes=20_000, summary_extra={}
    )
  finally:
    os.umask(previous)
  modes = {name: os.stat(out / name).st_mode & 0o777 for name in os.listdir(out)}
  assert "model.safetensors.index.json" in modes and "tokenizer_config.json" in modes
  assert modes == {name: 0o666 & ~umask for name in modes}


class _SavedRunThatMustNotCalibrate:
  """Stands in for `SavedRun`: an NVFP4 W4A4 run whose rollouts (the calibration) fail the
  test if they are ever asked for."""

  def __init__(self, workdir):
    self.workdir, self.step, self.policy = workdir, 0, None
    self.config = RLConfig.from_flat(preset="tiny", fmt="nvfp4")

  def rollout_tokens(self, seed, count):
    raise AssertionError("calibrated before the export's inputs were checked")


def test_the_run_export_checks_out_and_flags_before_loading_or_calibrating(tmp_path, monkeypatch):
  no_run = str(tmp_path / "no_run")  # loading it would fail: "holds no checkpoint"
  downloaded = tmp_path / "downloaded"
  _downloaded_nvfp4(downloaded)
  with pytest.raises(ValueError, match="downloaded' exists and holds files but no earlier export"):
    run_lib.export_run(no_run, str(downloaded))
  link = tmp_path / "link"
  link.symlink_to(downloaded)
  with pytest.raises(ValueError, match="is a symbolic link"):
    run_lib.export_run(no_run, str(link))
  for bad in (0, -3):
    message = f"calibration_prompts={bad} is not allowed: use a whole number >= 1"
    with pytest.raises(ValueError, match=message):
      run_lib.export_run(no_run, str(tmp_path / "new"), calibration_prompts=bad)

  # Checks that need the run's source are made once it is known, still before calibrating:
  # the source is the earlier export that --out would replace.
  monkeypatch.setattr(run_lib, "SavedRun", _SavedRunThatMustNotCalibrate)
  policy = M.Transformer(M.tiny(), rngs=nnx.Rngs(0))
  out = tmp_path / "out"
  export_compressed_tensors(policy, str(out), summary_extra={})
  with pytest.raises(ValueError, match="holds the source checkpoint"):
    run_lib.export_run(no_run, str(out), hf_checkpoint=str(out))
  secret = tmp_path / "secret.txt"
  secret.write_text("not for sharing")
  source = tmp_path / "ckpt"
  _source(source, policy)
  (source / "vocab.json").symlink_to(secret)
  with pytest.raises(ValueError, match="ckpt/vocab.json leads to .*secret.txt, outside"):
    run_lib.export_run(no_run, str(tmp_path / "out2"), hf_checkpoint=str(source))
  assert not (tmp_path / "out2").exists()


def _can_write_in(folder) -> bool:
  probe = os.path.join(folder, f".probe-{os.getpid()}")
  try:
    open(probe, "w").close()
  except OSError:
    return False
  os.remove(probe)
  return True


@pytest.fixture
def unwritable(tmp_path):
  """A folder no file can be made in: one without write permission, or (for root, whom
  permissions do not stop) a read-only system folder."""
  folder = tmp_path / "read_only"
  folder.mkdir()
  folder.chmod(0o555)
  try:
    for candidate in (str(folder), "/sys", "/proc"):
      if os.path.isdir(candidate) and not _can_write_in(candidate):
        yield candidate
        return
    pytest.skip("no folder here refuses this user's writes")
  finally:
    folder.chmod(0o755)


class _SavedRunThatMustNotLoad:
  def __init__(self, workdir):
    raise AssertionError("the run was loaded before --out was checked")


def test_an_unwritable_out_is_refused_before_loading_the_run(tmp_path, monkeypatch, unwritable):
  """--out in a folder that takes no file (a read-only filesystem) is refused in one line
  naming it, before the run is loaded or calibrated; so is an --out whose nearest existing
  ancestor takes none."""
  monkeypatch.setattr(run_lib, "SavedRun", _SavedRunThatMustNotLoad)
  workdir = tmp_path / "run"
  workdir.mkdir()
  for out in (os.path.join(unwritable, "export"), os.path.join(unwritable, "a", "b", "export")):
    message = rf"out_dir='{out}' cannot be written: making a file in {unwritable} failed \("
    with pytest.raises(ValueError, match=message):
      run_lib.export_run(str(workdir), out)
  assert not os.path.exists(os.path.join(unwritable, "export"))


def test_a_missing_workdir_is_said_not_to_exist(tmp_path):
  with pytest.raises(ValueError, match=r"workdir='.*no_run' does not exist"):
    run_lib.export_run(str(tmp_path / "no_run"), str(tmp_path / "out"))
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ValueError, match=r"workdir='.*a_file' is not a folder"):
    run_lib.export_run(str(tmp_path / "a_file"), str(tmp_path / "out"))


def test_a_failed_write_says_what_failed(tmp_path, monkeypatch):
  """An OSError while the export is written (a full disk) names the export folder, the
  reason and the file, its errno kept; not a bare "[Errno 28] ..." line."""
  import errno

  def full_disk(policy, out_dir, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", os.path.join(out_dir, "x.safetensors"))

  monkeypatch.setattr(run_lib, "SavedRun", _SavedRunThatMustNotCalibrate)
  monkeypatch.setattr(run_lib, "export_compressed_tensors", full_disk)
  out = str(tmp_path / "out")
  with pytest.raises(OSError) as failed:
    run_lib.export_run(str(tmp_path), out, activations="none")  # W4A16: no calibration
  assert failed.value.errno == errno.ENOSPC
  assert failed.value.strerror == (
    f"writing the export to {out} failed: No space left on device ({out}/x.safetensors)"
  )


@pytest.mark.slow
def test_the_cli_names_the_flag_in_one_line(tmp_path):
  """experiments/export.py ends with one line naming the flag (slow: the script imports JAX)."""
  export_py = os.path.join(ROOT, "experiments", "export.py")
  result = subprocess.run(
    [
      sys.executable,
      export_py,
      f"--workdir={tmp_path / 'run'}",
      f"--out={tmp_path / 'out'}",
      "--calibration_prompts=0",
    ],
    capture_output=True,
    text=True,
    env=dict(os.environ, PYTHONPATH=ROOT),
    timeout=300,
  )
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("export.py: error: ")]
  assert lines == [
    "export.py: error: calibration_prompts=0 is not allowed: use a whole number >= 1 (the "
    "rollouts that calibrate the NVFP4 W4A4 input scales, and as many again that measure them)"
  ]
