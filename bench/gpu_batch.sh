#!/usr/bin/env bash
# Every GPU measurement behind BENCHMARKS.md in one go, as root on an NVIDIA node, from the repo root:
#   OUT=/tmp/pvegpu-gpu bash bench/gpu_batch.sh        (COMPARE=DIR: the timelines also time another checkout)
# PARTS="tests gate timelines sbs" (the default: all) runs only the sections named, e.g. in two calls of a 10-minute limit.
# On a machine without a package registry, put the wheels in .whl/ first (BENCHMARKS.md says how).
set -u
OUT=${OUT:-/tmp/pvegpu-gpu}
PARTS=" ${PARTS:-tests gate timelines sbs} "
want() { case "$PARTS" in *" $1 "*) return 0;; esac; return 1; }
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  $PY -m pip install -q --break-system-packages --no-index --find-links .whl -e '.[test]' >"$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
fi
# pvegpu as a node runs it: its own venv (as the .deb's /opt/pvegpu), not the system Python with every site package
VENV=${VENV:-/tmp/pvegpu-venv}
if [ -d .whl ] && [ ! -x "$VENV/bin/pvegpu" ]; then
  $PY -m venv --without-pip "$VENV" && $PY -m pip --python "$VENV/bin/python" install -q --no-index --find-links .whl . >>"$OUT/pip.log" 2>&1 \
    || tail -5 "$OUT/pip.log"
fi
# ... with the .deb's launcher (packaging/launcher.py: the interpreter -IS, site-packages named), not pip's console script
if [ -x "$VENV/bin/python3" ] && [ -x "$VENV/bin/pvegpu" ] && ! head -1 "$VENV/bin/pvegpu" | grep -q -- ' -IS$'; then
  "$VENV/bin/python3" packaging/launcher.py "$VENV/bin/pvegpu" || echo "gpu_batch: $VENV keeps pip's console script" >&2
fi
SBS_PVEGPU=${SBS_PVEGPU:-$( [ -x "$VENV/bin/pvegpu" ] && echo "$VENV/bin/pvegpu" )}
if [ -d .qga ] && ! command -v qemu-ga >/dev/null; then  # the VM tests' guest agent, from Debian .debs put there
  for d in .qga/*.deb; do dpkg -x "$d" /opt/qga; done
  printf '#!/bin/sh\nLD_LIBRARY_PATH=/opt/qga/usr/lib/x86_64-linux-gnu exec /opt/qga/usr/sbin/qemu-ga "$@"\n' >/usr/local/bin/qemu-ga
  chmod 755 /usr/local/bin/qemu-ga
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
uname -r >>"$OUT/machine.txt"; $PY --version >>"$OUT/machine.txt"
if want tests; then echo "== GPU tests"; date +%s
PVEGPU_RESULTS="$OUT/gpu.jsonl" timeout "${T_TESTS:-300}" $PY -m pytest -q -p no:cacheprovider -rA -m gpu tests/ 2>&1 | tail -40 | tee "$OUT/gpu-tests.log"
fi
if want gate; then echo "== gate vs nvidia-smi"; date +%s
timeout "${T_GATE:-90}" $PY bench/bench_gate.py "${GATE_N:-40}" 2>&1 | tee "$OUT/gate.txt"
fi
if want timelines; then echo "== the gate's and the reset's timelines"; date +%s
timeout "${T_TL:-120}" $PY bench/gate_timeline.py 25 2>&1 | tee "$OUT/gate_timeline.txt"
timeout "${T_TL:-120}" $PY bench/reset_timeline.py 12 2>&1 | tee "$OUT/reset_timeline.txt"
if [ -n "${COMPARE:-}" ]; then
  timeout "${T_TL:-120}" $PY bench/gate_timeline.py 25 --tree "$COMPARE" 2>&1 | tee "$OUT/gate_timeline-compare.txt"
  timeout "${T_TL:-120}" $PY bench/reset_timeline.py 12 --tree "$COMPARE" 2>&1 | tee "$OUT/reset_timeline-compare.txt"
fi
fi
if want sbs; then echo "== side by side"; date +%s
timeout "${T_SBS:-200}" $PY bench/side_by_side.py --out "$OUT" --name "${SBS_NAME:-side_by_side}" --methods manual,pvegpu,floor ${SBS_PVEGPU:+--pvegpu "$SBS_PVEGPU"} \
  --scenarios "${SBS_SCENARIOS:-hold-20,ignore-term,two-cts}" --reps "${SBS_REPS:-3}" 2>&1 | tail -30
fi
date +%s
