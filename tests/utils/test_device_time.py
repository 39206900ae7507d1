"""Device time read from a profile: the kernels of the GPU's streams, per kernel (names
without XLA's numbering) and as the device's busy time (overlaps counted once)."""

import jax
import pytest

from trace_jax.utils import device_time

# Two calls' worth: fp4_gemm_3 on [1000, 6000) ns and loop_fusion.2 on [4000, 8000) ns on
# one stream, fp4_gemm_4 on [9000, 10000) on another; XLA's op line repeats one of them.
PROFILE = """
planes {
  id: 1
  name: "/device:GPU:0"
  lines {
    id: 1
    name: "Stream #13(compute)"
    timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 }
    events { metadata_id: 2 offset_ps: 3000000 duration_ps: 4000000 }
  }
  lines {
    id: 2
    name: "Stream #14(compute)"
    timestamp_ns: 9000
    events { metadata_id: 3 offset_ps: 0 duration_ps: 1000000 }
  }
  lines {
    id: 3
    name: "XLA Ops"
    timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 }
  }
  event_metadata { key: 1 value { id: 1 name: "fp4_gemm_3" } }
  event_metadata { key: 2 value { id: 2 name: "loop_fusion.2" } }
  event_metadata { key: 3 value { id: 3 name: "fp4_gemm_4" } }
}
planes { id: 2 name: "/host:CPU" }
"""


def test_summary_of_a_profile_reads_the_device_streams():
  data = jax.profiler.ProfileData.from_text_proto(PROFILE)
  t = device_time.summarize(data, calls=2, wall=1.0)
  assert t.source == "device streams"
  assert t.kernels == pytest.approx({"fp4_gemm": 3e-6, "loop_fusion": 2e-6})
  assert t.busy == pytest.approx(8e-9 / 2 * 1000)  # [1000, 8000) + [9000, 10000) ns, per call
  assert t.matching("fp4_gemm") == pytest.approx(3e-6)


def test_no_profile_falls_back_to_wall_time():
  t = device_time.summarize(None, calls=3, wall=0.25)
  assert (t.busy, t.source, t.kernels) == (0.25, "none: wall", {})


@pytest.mark.slow
def test_profiling_a_function_on_this_backend_gives_a_time():
  """A real profile on this backend (slow: on CPU, `jax.profiler` once hung for the 15-minute
  limit inside the profiled calls in a worker that had run other tests; alone it takes a
  second)."""
  t = device_time.device_time(jax.jit(lambda x: x * 2), jax.numpy.ones(8), calls=2, warmup=1)
  assert t.busy > 0 and t.wall > 0
