#!/usr/bin/env bash
# The GPU tests and the three budgets of bench/ on a GPU node in one go, as root, from the repo root:
#   OUT=/tmp/pvegpu-gpu bash bench/gpu_batch.sh
# PARTS="tests gate reset audit" (the default: all) runs only the sections named, e.g. in two calls of a 10-minute limit;
# GATE_PROFILE=1 adds one gate run under -X importtime and one under cProfile (gate-*.txt); AUDIT_PROFILE=1 the same
# for the audit at each size (audit-<size>-*.txt).
# Each budget writes OUT/<date>-<budget>.md; copy them into bench/results/.
# On a machine without a package registry, put the wheels in .whl/ first (BENCHMARKS.md says how).
set -u
OUT=${OUT:-/tmp/pvegpu-gpu}
PARTS=" ${PARTS:-tests gate reset audit} "
want() { case "$PARTS" in *" $1 "*) return 0;; esac; return 1; }
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the commit, for the reports (a copy of the tree may come without .git)
export PVEGPU_COMMIT=${PVEGPU_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
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
PVEGPU=${PVEGPU:-$( [ -x "$VENV/bin/pvegpu" ] && echo "$VENV/bin/pvegpu" )}
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
if want gate; then echo "== gate beside nvidia-smi"; date +%s
timeout "${T_GATE:-120}" $PY bench/gate.py --node gpu --rounds "${GATE_N:-40}" ${PVEGPU:+--pvegpu "$PVEGPU"} --out "$OUT" \
  ${GATE_PROFILE:+--profile "$OUT"} 2>&1 | tail -20
fi
if want reset; then echo "== reset against the floor and the manual routine"; date +%s
timeout "${T_RESET:-300}" $PY bench/reset.py --node gpu --reps "${RESET_REPS:-5}" --scenarios "${RESET_SCENARIOS:-hold-20,ignore-term,two-cts}" \
  --scale "${RESET_SCALE:-1.0}" ${PVEGPU:+--pvegpu "$PVEGPU"} --raw "$OUT/reset-raw.json" --out "$OUT" 2>&1 | grep -v '^|' | tail -60
fi
if want audit; then echo "== audit against fuser -v"; date +%s
timeout "${T_AUDIT:-240}" $PY bench/audit.py --node gpu --sizes "${AUDIT_SIZES:-2000,20000}" --rounds "${AUDIT_N:-9}" ${PVEGPU:+--pvegpu "$PVEGPU"} \
  --out "$OUT" ${AUDIT_PROFILE:+--profile "$OUT"} 2>&1 | tail -20
fi
date +%s
