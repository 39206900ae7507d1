#!/usr/bin/env bash
# The one command for a lent GPU (an H100 / H200 with no network): every gpu_check.py section,
# in order of value, each in its own process under its own time cap, into one --out folder.
#
#   bash experiments/gpu_window.sh --out=DIR                     # the window: about 9 minutes
#   bash experiments/gpu_window.sh --out=DIR --sections=rollout --cap=540   # what is left: the
#                                                                # slowest section alone
#   bash experiments/gpu_window.sh --smoke --out=DIR             # CPU, tiny shapes (the tests)
#
# Steps:
#   1. experiments/gpu_env.py prints the Python, jax, jaxlib, flax and orbax versions and the
#      devices; off a GPU (without --smoke) or with a needed package missing it exits non-zero
#      and so does this script, at once.
#   2. Only where flax or orbax-checkpoint lies outside pyproject.toml's bounds: installs the
#      wheels carried in experiments/gpu_wheels/ (ignored by git; carry it to the machine) with
#      `pip install --no-index`, then checks again. Otherwise it installs nothing. To fill it
#      on a machine with a network, for the GPU image's Python (step 1 prints it; 3.12 here):
#        pip download --no-deps --only-binary=:all: --python-version 3.12 \
#          -d experiments/gpu_wheels "flax==0.12.10" "orbax-checkpoint==0.12.8"
#   3. The sections probe, kernels, decode and rollout, each `timeout CAP python
#      experiments/gpu_check.py --sections=S --out=DIR --budget_s=CAP-20`: a section's own
#      measurements stop in time; a section that still overruns is killed, keeps what it
#      wrote, and the next starts. Caps (seconds): probe 60, kernels 150, decode 150,
#      rollout 170 (--cap=S sets every named section's). window.log under DIR has it all.
# Other flags pass on to gpu_check.py (e.g. --rollout_layers=48 --rollout_arms=trace).
# Exit status: 0 when every section finished ok; 1 otherwise; 2 bad flags; 3 or 4 from step 1/2.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

out="" smoke=0 sections="probe,kernels,decode,rollout" cap="" pass=()
for arg in "$@"; do
  case "$arg" in
    --out=*) out="${arg#--out=}" ;;
    --smoke) smoke=1 ;;
    --sections=*) sections="${arg#--sections=}" ;;
    --cap=*) cap="${arg#--cap=}" ;;
    *) pass+=("$arg") ;;
  esac
done
[ -n "$out" ] || { echo "gpu_window.sh: --out=DIR is required" >&2; exit 2; }
case "$cap" in ""|*[!0-9]*) [ -z "$cap" ] || { echo "gpu_window.sh: --cap=$cap must be seconds" >&2; exit 2; } ;; esac
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
log="$out/window.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
wheels="${TRACE_JAX_GPU_WHEELS:-experiments/gpu_wheels}"
started=$(date +%s)
say() { echo "$@" | tee -a "$log"; }

env_flags=()
[ "$smoke" = 1 ] || env_flags+=(--require_gpu)
say "# gpu_window.sh $(date -u +%Y-%m-%dT%H:%M:%SZ), sections $sections, out $out"
python experiments/gpu_env.py "${env_flags[@]}" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 4 ]; then
  shopt -s nullglob
  carried=("$wheels"/*.whl)
  if [ ${#carried[@]} = 0 ]; then
    say "gpu_window.sh: flax / orbax-checkpoint out of bounds and no wheels in $wheels: stop"
    exit 4
  fi
  say "gpu_window.sh: installing the carried wheels: ${carried[*]}"
  pip install --no-index --no-deps "${carried[@]}" 2>&1 | tee -a "$log"
  python experiments/gpu_env.py "${env_flags[@]}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
fi
[ "$rc" = 0 ] || { say "gpu_window.sh: the environment check failed (exit $rc): nothing ran"; exit "$rc"; }

default_cap() {
  case "$1" in probe) echo 60 ;; kernels) echo 150 ;; decode) echo 150 ;; rollout) echo 170 ;; *) echo 60 ;; esac
}
check_flags=()
[ "$smoke" = 1 ] && check_flags+=(--smoke)
status=0
for section in ${sections//,/ }; do
  limit="${cap:-$(default_cap "$section")}"
  [ "$smoke" = 1 ] && [ -z "$cap" ] && limit=600  # CPU interpret mode: caps are the GPU's
  budget=$((limit > 40 ? limit - 20 : limit / 2))
  say "## $section: cap $limit s ($(( $(date +%s) - started )) s into the window)"
  timeout --kill-after=10 "$limit" python experiments/gpu_check.py --sections="$section" \
    --out="$out" --budget_s="$budget" "${check_flags[@]}" "${pass[@]}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    python experiments/gpu_record.py --out="$out" --killed="$section" --cap="$limit"
    say "## $section: killed at its cap of $limit s (what it wrote stays)"
  fi
  [ "$rc" = 0 ] || status=1
done
say "# gpu_window.sh done in $(( $(date +%s) - started )) s, exit $status; results under $out"
exit "$status"
