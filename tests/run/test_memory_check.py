"""The compiled update's returned records, the update's and the rollout's MoE sorts and
tiled matmuls, on a mesh of fake CPU devices (a subprocess); and `collective_bytes`."""

import json
import math
import os
import subprocess
import sys
import pytest

from trace_jax.run import memory_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Prints, as SORTS + JSON, the top-k of `cfg` and the shapes of every sort in the compiled
# program `text` (what one device sorts).
_PRINT_SORTS = """
import json, re
shapes = re.findall(r"= \\(?s32\\[([0-9,]*)\\][^ ]*(?:, s32\\[[0-9,]*\\][^ ]*)*\\)? sort\\(", text)
# the values of the experts' tiled matmul (`layers.ragged_matmul`'s "nti,nio->nto"), per device
tiled = re.findall(r"= [a-z0-9]+\\[([0-9,]*)\\][^ ]* [a-z-]+\\([^\\n]*op_name=\\"[^\\"]*nti,nio->nto", text)
print("SORTS" + json.dumps(dict(k=cfg.num_experts_per_tok, sorts=shapes, tiled=tiled)))
"""


def _on_eight_devices(script: str) -> dict:
  """Run `script` on 8 fake CPU devices; {prefix: the JSON it printed after it} for the
  SORTS and JSON lines."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  flag = "--xla_force_host_platform_device_count=8"
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
  result = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env
  )
  assert result.returncode == 0, result.stderr[-3000:]
  printed = {}
  for line in result.stdout.splitlines():
    for prefix in ("SORTS", "JSON"):
      if line.startswith(prefix):
        printed[prefix] = json.loads(line[len(prefix) :])
  return printed


def _sorted_rows(found: dict) -> set[int]:
  """The row counts of the printed sorts."""
  return {math.prod(int(d) for d in shape.split(",")) for shape in found["sorts"]}


# Compiles the trainer's update (tiny preset, 8 sequences of 64 slots, the trace arm: guided,
# routing replay, full records) on a 2 x 4 x 1 mesh and prints, for every returned fallback and
# site-record leaf, its shape, the compiled output's shard shape and the shard shape the
# guidance rule's spec gives; then its sorts.
_SCRIPT = (
  """
import json
import jax
from jax.sharding import NamedSharding
from trace_jax import plan as plan_lib
from trace_jax.model import sharding
from trace_jax.model.config import get_preset
from trace_jax.run import memory_check

mesh_shape = (2, 4, 1)
mesh = sharding.make_mesh(*mesh_shape)
config = plan_lib.PlanConfig(mesh=mesh_shape, batch=8, context=64)
cfg = get_preset("tiny")
compiled = memory_check.update_program(cfg, config, mesh)
# the jitted function's own outputs: the last of (arguments out, keywords out, outputs)
info, out = compiled.compiled.out_info[-1], compiled.compiled.output_shardings[-1]
rows = []
for index, name in ((5, "fallbacks"), (6, "sites")):
  # a ByLayer: one stack [layers, B, S, ...] per site
  specs = sharding.by_layer_site_specs(info[index], mesh)
  for keys, stack, shardings, spec in zip(
    info[index].keys_by_stack, info[index].stacks, out[index].stacks, specs
  ):
    leaves = jax.tree_util.tree_flatten_with_path(stack)[0]
    for (path, a), s, p in zip(leaves, jax.tree.leaves(shardings), jax.tree.leaves(spec)):
      rows.append(dict(
        name=f"{name}[{keys[0][1]}, layers {[k[0] for k in keys]}]" + jax.tree_util.keystr(path),
        shape=list(a.shape),
        shard=list(s.shard_shape(a.shape)),
        rule=list(NamedSharding(mesh, p).shard_shape(a.shape)),
      ))
text = compiled.as_text()
print("JSON" + json.dumps(rows))
"""
  + _PRINT_SORTS
)


@pytest.mark.slow
def test_update_returns_records_laid_out_by_the_guidance_rule():
  """Every site record and fallback the fused, recording update returns is split as
  `guidance_site_specs` says (batch over "data"), none held whole on every device: without
  the update's constraint XLA kept an unguided layer's moe_mid records replicated on this
  mesh (2 x 4: the experts over 4 devices). And its MoE dispatch sorts each data shard's
  own rows (`CallOptions.moe_blocks`)."""
  printed = _on_eight_devices(_SCRIPT)
  rows = printed["JSON"]
  names = {r["name"] for r in rows}
  assert any("moe_mid" in n and n.startswith("sites") for n in names)
  assert any(n.startswith("fallbacks") for n in names)
  for r in rows:
    assert r["shard"] == r["rule"], r
    assert r["shard"][0] == r["shape"][0], r  # every layer of a stack on each device
    if r["shape"][1] > 1:  # the batch over data = 2: half the rows on each device
      assert r["shard"][1] * 2 == r["shape"][1], r
  # Each device sorts its own data shard's (token, slot) rows for the routed experts: one
  # sequence of 64 slots (the micro-batch's 2 over data = 2), not the micro-batch's.
  found = printed["SORTS"]
  assert _sorted_rows(found) == {64 * found["k"]}, found
  # ... and multiplies its own block's tiles: no value of the tiled matmul holds both data
  # shards' blocks [2, tiles, ...] (GSPMD did, each device summing a d_model slice of both
  # blocks' products, until the blocks were pinned to their shards: `layers.block_axis`).
  shapes = [[int(d) for d in shape.split(",")] for shape in found["tiled"] if shape]
  assert shapes, found
  assert all(len(shape) == 3 or shape[0] == 1 for shape in shapes), shapes


# Compiles the rollout's generate (tiny preset, 8 prompts of 16 tokens decoded to 64 slots,
# the trace arm) on a 2 x 4 x 1 mesh and prints the row counts of every sort in the
# partitioned program.
_ROLLOUT_SCRIPT = (
  """
from trace_jax import plan as plan_lib
from trace_jax.model import sharding
from trace_jax.model.config import get_preset
from trace_jax.run import memory_check

mesh = sharding.make_mesh(2, 4, 1)
config = plan_lib.PlanConfig(mesh=(2, 4, 1), batch=8, context=64)
cfg = get_preset("tiny")
text = memory_check.rollout_program(cfg, config, mesh, 16).as_text()
"""
  + _PRINT_SORTS
)


@pytest.mark.slow
def test_rollout_on_a_mesh_sorts_each_data_shards_own_tokens():
  """The compiled rollout's MoE dispatch sorts, per device, the (token, slot) rows of its
  own "data" shard's sequences only: 4 prompts x 16 prompt tokens x top-k in the prefill,
  4 x 1 x top-k per decode step. One sort over the whole batch made every device sort,
  gather and multiply every shard's rows (at Qwen3-30B-A3B on 8 x 8 x 1: 33 GB more
  temporaries)."""
  found = _on_eight_devices(_ROLLOUT_SCRIPT)["SORTS"]
  assert _sorted_rows(found) == {4 * 16 * found["k"], 4 * 1 * found["k"]}, found


_COLLECTIVES_SCRIPT = """
import json
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from trace_jax.run import memory_check

mesh = Mesh(jax.devices(), ("x",))
rows = NamedSharding(mesh, P("x"))
whole = NamedSharding(mesh, P())
x = jax.ShapeDtypeStruct((8, 256), jnp.float32, sharding=rows)
out = {}
# every device ends with all 8 rows: an all-gather of f32[8, 256]
out["gather"] = memory_check.collective_bytes(
  jax.jit(lambda x: x * 2, out_shardings=whole).trace(x).lower().compile().as_text())
# every device ends with the column sums of all rows: an all-reduce of f32[256]
out["reduce"] = memory_check.collective_bytes(
  jax.jit(lambda x: x.sum(0), out_shardings=whole).trace(x).lower().compile().as_text())
print("JSON" + json.dumps(out))
"""


def test_collective_bytes_are_what_each_device_receives():
  """By hand: replicating a [8, 256] float32 array split over 8 devices all-gathers its
  8 x 256 x 4 bytes on every device; replicating its column sums all-reduces 256 x 4. And
  the text parser alone: a tuple result counts each array, pred one byte, bf16 two, an
  E4M3 one, a token none."""
  found = _on_eight_devices(_COLLECTIVES_SCRIPT)["JSON"]
  assert found["gather"]["all-gather"] == 8 * 256 * 4, found
  assert sum(found["gather"].values()) == 8 * 256 * 4, found
  assert found["reduce"]["all-reduce"] == 256 * 4, found
  assert sum(found["reduce"].values()) == 256 * 4, found
  text = """
  %a = (f32[4,3]{1,0}, bf16[5]{0}) all-reduce(%p, %q), replica_groups={}, to_apply=%sum
  %b = pred[16]{0} all-gather(%r), dimensions={0}
  %c = f32[2,2]{1,0} add(%s, %t)
  %d = s32[7]{0} collective-permute(%u), source_target_pairs={{0,1}}
  %e = (f8e4m3fn[6]{0}, token[]) all-to-all(%v, %w), dimensions={0}
  """
  assert memory_check.collective_bytes(text) == {
    "all-gather": 16,
    "all-reduce": 4 * 3 * 4 + 5 * 2,
    "reduce-scatter": 0,
    "collective-permute": 7 * 4,
    "all-to-all": 6,
  }
