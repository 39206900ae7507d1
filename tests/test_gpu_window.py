"""experiments/gpu_window.sh and the GPU check it runs: every section end to end on smoke
shapes through the same process split and writes, nothing installed, only the GPU image's
packages imported, and the version bounds read as pip reads them."""

import ast
import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet

from tests.scripts import refusal

ROOT = os.path.join(os.path.dirname(__file__), "..")
EXPERIMENTS = os.path.join(ROOT, "experiments")
SCRIPTS = ("gpu_check.py", "gpu_decode.py", "gpu_record.py", "gpu_env.py")


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(EXPERIMENTS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def window(tmp_path_factory):
  """One smoke window (all four sections) with a `pip` on PATH that only leaves a mark."""
  tmp = tmp_path_factory.mktemp("window")
  shim = tmp / "bin"
  shim.mkdir()
  (shim / "pip").write_text(f"#!/bin/sh\ntouch {tmp / 'pip-was-called'}\nexit 1\n")
  (shim / "pip").chmod(0o755)
  out = tmp / "gpu"
  args = ["--smoke", f"--out={out}", "--layers=1", "--calls=1", "--rollout_prompts=2"]
  args += ["--rollout_prompt_len=5", "--rollout_new_tokens=4"]
  env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}")
  result = subprocess.run(
    ["bash", os.path.join(EXPERIMENTS, "gpu_window.sh"), *args],
    capture_output=True,
    text=True,
    timeout=900,
    env=env,
  )
  return result, out, tmp


def test_the_smoke_window_writes_every_section_and_measurement(window):
  result, out, _ = window
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
  results = json.loads((out / "results.json").read_text())
  assert list(results["sections"]) == ["probe", "kernels", "decode", "rollout"]
  assert all(s["status"] == "ok" for s in results["sections"].values()), results["sections"]
  names = {s: [m["name"] for m in ms] for s, ms in results["measurements"].items()}
  # The smoke shapes' measurements (experiments/gpu_check.py SMOKE), each with a status
  assert names["probe"] == ["tie_oracle", "kernels_auto", "copy_bandwidth"]
  bf16 = [f"moe bf16 {k} batch=2" for k in ("grouped", "gather", "ragged_dot", "dense")]
  assert names["kernels"] == [
    "attention B=1 slots=65",
    "fp4_gemm qkv rows=1",
    "moe FP4 batch=2",
    *bf16,
    "fair bf16 MoE batch=2",
  ]
  assert names["decode"] == ["decode step parity", "decode 64/b2"]
  assert names["rollout"] == ["rollout trace", "rollout bf16"]
  recorded = {"name", "status", "seconds"}
  for section in results["measurements"].values():
    for m in section:
      assert m["status"] == "ok" and m.keys() >= recorded, m
  measured = {m["name"]: m for ms in results["measurements"].values() for m in ms}
  assert measured["copy_bandwidth"]["copy_gbps"] > 0
  # shares against the measured copy (probe, an earlier process) and the datasheet
  assert measured["attention B=1 slots=65"]["of_copy"] > 0
  fair = measured["fair bf16 MoE batch=2"]
  assert fair["kind"] == min(fair["device_us"], key=fair["device_us"].get)
  assert measured["decode 64/b2"]["bf16_moe"] == fair["kind"]
  assert measured["rollout bf16"]["bf16_moe"] == fair["kind"]
  for arm in ("trace", "bf16"):
    assert measured[f"rollout {arm}"]["generated_tokens"] == 2 * 4
  assert measured["rollout trace"]["weights_bytes"] < measured["rollout bf16"]["weights_bytes"]
  report = (out / "report.md").read_text()
  for heading in ("## probe", "## kernels", "## decode", "## rollout", "## targets"):
    assert heading in report
  assert "jax " in (out / "window.log").read_text().splitlines()[1]  # versions come first


def test_the_window_installs_nothing(window):
  result, _, tmp = window
  assert result.returncode == 0
  assert not (tmp / "pip-was-called").exists()


def test_off_a_gpu_the_window_stops_at_once_with_a_failure(tmp_path):
  result = subprocess.run(
    ["bash", os.path.join(EXPERIMENTS, "gpu_window.sh"), f"--out={tmp_path}"],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 3, result.stdout + result.stderr
  assert "--require_gpu, but the backend is 'cpu'" in result.stdout
  assert not (tmp_path / "results.json").exists()


def _module_imports(path: str, top_level_only: bool) -> set[str]:
  tree = ast.parse(open(path).read())
  nodes = tree.body if top_level_only else list(ast.walk(tree))
  found = set()
  for node in nodes:
    if isinstance(node, ast.Import):
      found |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      found.add(node.module.split(".")[0])
    elif top_level_only and isinstance(node, (ast.If, ast.Try)):
      for sub in ast.walk(node):  # guarded module-level imports run too
        if isinstance(sub, ast.Import):
          found |= {a.name.split(".")[0] for a in sub.names}
        elif isinstance(sub, ast.ImportFrom) and sub.level == 0:
          found.add(sub.module.split(".")[0])
  return found


def test_the_sections_import_only_what_the_gpu_image_has():
  """Every import of the GPU scripts, and every module-level import of the trace_jax
  modules they load (their sections' own imports included), is the standard library,
  trace_jax, a GPU script, or a package of experiments/gpu_image_packages.txt."""
  loader = (
    "import sys; sys.argv = ['x']; sys.path.insert(0, sys.argv[0] and %r);"
    "import gpu_check, gpu_env;"
    "import trace_jax.rl.arms, trace_jax.rollout.decode, trace_jax.rollout.config, trace_jax.plan;"
    "print('\\n'.join(m.__file__ for n, m in sys.modules.items()"
    " if n.startswith('trace_jax') and getattr(m, '__file__', None)))"
  ) % EXPERIMENTS
  result = subprocess.run(
    [sys.executable, "-c", loader], capture_output=True, text=True, timeout=300, cwd=ROOT
  )
  assert result.returncode == 0, result.stderr[-3000:]
  files = result.stdout.split()
  assert len(files) > 20  # the package itself was loaded
  image = {
    line.split()[0]
    for line in open(os.path.join(EXPERIMENTS, "gpu_image_packages.txt"))
    if line.strip() and not line.startswith("#")
  }
  allowed = image | set(sys.stdlib_module_names) | {"trace_jax", "__future__"}
  allowed |= {s[: -len(".py")] for s in SCRIPTS}
  outside = {}
  for path in files:
    for name in _module_imports(path, top_level_only=True) - allowed:
      outside.setdefault(name, []).append(os.path.relpath(path, ROOT))
  for script in SCRIPTS:
    for name in _module_imports(os.path.join(EXPERIMENTS, script), False) - allowed:
      outside.setdefault(name, []).append(script)
  assert not outside, outside


def test_version_bounds_read_as_pip_reads_them():
  gpu_env = _load("gpu_env")
  bounds = gpu_env.bounds()
  assert set(bounds) == {"flax", "orbax-checkpoint"} and all(bounds.values())
  rng = random.Random()
  for _ in range(300):
    version = ".".join(str(rng.randint(0, 14)) for _ in range(rng.choice((2, 3))))
    for name, specifiers in bounds.items():
      want = version in SpecifierSet(",".join(specifiers))
      assert gpu_env.satisfies(version, specifiers) == want, (name, version, specifiers)
  low = {name: "0.1.0" for name in bounds}
  assert gpu_env.out_of_bounds(low, bounds) == list(bounds)
  assert gpu_env.out_of_bounds({n: None for n in bounds}, bounds) == []  # missing: step 1's


def test_bad_flags_are_refused_before_any_work(tmp_path):
  said = refusal("gpu_check", "--smoke", "--rollout_arms=fp8", f"--out={tmp_path / 'o'}")
  assert "--rollout_arms=['fp8'] is not allowed" in said, said
  assert not (tmp_path / "o").exists()


@pytest.fixture
def experiments_path(monkeypatch):
  monkeypatch.syspath_prepend(EXPERIMENTS)


def test_every_measurement_is_written_as_it_finishes(tmp_path, experiments_path):
  """A failure is recorded and the next runs; one that would not fit is skipped; the files
  hold each as soon as it ends; a later section's process reads what earlier ones wrote."""
  import time

  import gpu_record

  header = dict(device="test", jax="x", smoke=True)
  rec = gpu_record.Recorder(str(tmp_path), "probe", deadline=time.time() + 60, header=header)
  seen = []

  def on_disk():
    return json.loads((tmp_path / "results.json").read_text())["measurements"]["probe"]

  def first():
    return dict(copy_gbps=float(random.uniform(1, 9)))

  def second():
    seen.append([m["name"] for m in on_disk()])  # what was on disk when it started
    raise RuntimeError("out of memory")

  values = rec.measure("copy_bandwidth", first)
  assert rec.measure("boom", second) is None
  assert rec.measure("too long", lambda: seen.append("ran"), estimate_s=3600) is None
  rec.measure("after", lambda: dict(value=float("nan")))
  assert seen == [["copy_bandwidth"]]
  names = {m["name"]: m for m in on_disk()}
  assert names["copy_bandwidth"]["copy_gbps"] == values["copy_gbps"]
  assert names["boom"]["status"] == "failed: RuntimeError: out of memory"
  assert names["too long"]["status"].startswith("skipped: needs ~3600 s")
  assert names["after"]["value"] == "nan"  # strict JSON: no bare NaN
  rec.finish("ok")
  later = gpu_record.Recorder(str(tmp_path), "kernels", deadline=time.time() + 60, header=header)
  assert later.earlier("probe", "copy_bandwidth")["copy_gbps"] == values["copy_gbps"]
  assert later.earlier("probe", "boom") is None
  gpu_record.mark_killed(str(tmp_path), "kernels", 150)
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["sections"]["kernels"]["status"] == "killed at its time cap (150 s)"
  assert results["sections"]["probe"]["status"] == "ok"
  assert "## kernels (killed at its time cap (150 s)" in (tmp_path / "report.md").read_text()


def test_the_rollout_depth_is_the_deepest_at_which_both_arms_fit(experiments_path):
  import gpu_decode
  from trace_jax import model as M

  device = random.uniform(40, 70) * 2**30
  batch, context = 16, 1024
  layers, why = gpu_decode.fitting_layers("qwen3_30b_a3b", batch, context, device)
  assert "both arms fit" in why
  cfg = M.get_preset("qwen3_30b_a3b")
  for quant in (None, M.QuantConfig()):
    at = lambda n: gpu_decode._arm_state_bytes(cfg.replace(num_layers=n), quant, batch, context)  # noqa: E731
    assert at(layers) <= 0.85 * device
  bf16_next = gpu_decode._arm_state_bytes(cfg.replace(num_layers=layers + 1), None, batch, context)
  assert bf16_next > 0.85 * device  # bf16, the larger arm, limits the depth


def test_each_block_of_the_random_rollout_weights_compiles_once(experiments_path):
  import gpu_decode
  import jax
  from trace_jax import model as M

  cfg = M.get_preset("tiny", num_layers=3)
  traced = []

  def make_block(block):
    traced.append(1)  # runs once per compilation
    return block

  _, params = gpu_decode.random_rollout_params(cfg, make_block, jax.random.key(0))
  assert len(traced) == 2  # the layer blocks once, the embedding / head / norm once
  layers = {path[1] for path, _ in params.flat_state() if path[0] == "blocks"}
  assert layers == {0, 1, 2}  # each block back under its own index


@pytest.mark.parametrize("kind", ["grouped", "gather", "ragged_dot", "dense"])
def test_the_fair_bf16_decode_computes_the_engines_model(kind, experiments_path):
  """A bf16 decode step with the experts laid out for `kind` and the model's MoE routed
  through it gives the logits of the engine's own bf16 step."""
  import dataclasses

  import gpu_decode
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from trace_jax import model as M
  from trace_jax.rollout.params import quantize_params

  cfg = M.get_preset("tiny", num_layers=1, moe_ffn_dim=32)
  graphdef, state = nnx.split(M.Transformer(cfg, rngs=nnx.Rngs(random.randrange(100))))
  params = quantize_params(state, None, dtype=jnp.bfloat16)
  key = jax.random.key(1)
  cache = gpu_decode._random_cache(cfg, 2, 9, None, key)
  tokens = jax.random.randint(key, (2, 1), 0, cfg.vocab_size)
  options = M.CallOptions(compute_dtype="bfloat16", kernels="xla")

  def logits(p):
    out = nnx.merge(graphdef, p)(tokens, cache=cache, quant=None, options=options)
    return np.asarray(out.logits, np.float32)

  want = logits(params)
  laid_out = gpu_decode.layout_bf16_experts(params, kind)
  with gpu_decode._fair_bf16_layers(kind):
    got = logits(laid_out)
  assert dataclasses.is_dataclass(cache)
  np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())
