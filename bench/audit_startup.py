"""What ``pvegpu audit`` pays before its scan, layer by layer, as whole processes, interleaved in one run.

Usage: python3 bench/audit_startup.py [ROUNDS] [--python PY]   (no root, no node needed)

Each round runs, in order: the bare interpreter (``-I -S``), the interpreter as the entry point starts it (site and
the venv's .pth files), then that plus the audit path's pvegpu imports (NVML through the ctypes reader), plus
nvidia-ml-py's import (what the audit paid before it read NVML through the ctypes reader), plus typer's (what the
audit paid before it had its own parser), and ``pvegpu audit --json`` on a machine that is not a PVE node (the
front door, the settings, the world: exit 3 before NVML). Median and min over the rounds, and the step from the row
before: the cost of each layer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUDIT_IMPORTS = ("import pvegpu.frontdoor, pvegpu.auditcmd, pvegpu.wiring, pvegpu.audit, pvegpu.render_audit, "
                 "pvegpu.adapters.procfs, pvegpu.adapters.nodefiles, pvegpu.adapters.etcpve, pvegpu.adapters.users, "
                 "pvegpu.adapters.bounded, pvegpu.adapters.scanpool, pvegpu.adapters.clock, pvegpu.adapters.nvml")


def cases(py: str) -> dict[str, list[str]]:
    pre = f"import sys; sys.path.insert(0, {REPO!r}); "
    return {
        "`python -I -S -c pass` (bare interpreter)": [py, "-I", "-S", "-c", "pass"],
        "`python -c pass` (site, as the entry point starts)": [py, "-c", "pass"],
        "+ the audit path's pvegpu imports": [py, "-c", pre + AUDIT_IMPORTS],
        "+ nvidia-ml-py (`import pynvml`: what `pvegpu audit` imported before round 4)": [py, "-c", pre + AUDIT_IMPORTS + ", pynvml"],
        "+ typer (what `pvegpu audit` imported before its own parser)": [py, "-c", pre + AUDIT_IMPORTS + ", pynvml, typer, pvegpu.cli"],
        "`pvegpu audit --json`, not a PVE node (exit 3 before NVML)": [py, "-c", pre + "import sys; from pvegpu.__main__ import main; "
                                                                        "sys.argv = ['pvegpu', 'audit', '--json']; main()"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rounds", nargs="?", type=int, default=15)
    ap.add_argument("--python", default=sys.executable)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="pvegpu-bench-astart-")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PVEGPU_PVE_ROOT": os.path.join(tmp, "no-pve")}
    subprocess.run([a.python, "-m", "compileall", "-q", os.path.join(REPO, "pvegpu")], capture_output=True)
    times: dict[str, list[float]] = {}
    codes: dict[str, set[int]] = {}
    for _ in range(a.rounds + 1):  # the first round warms the page cache and is dropped
        for name, argv in cases(a.python).items():
            t = time.perf_counter()
            r = subprocess.run(argv, capture_output=True, env=env, cwd=tmp, timeout=60)
            times.setdefault(name, []).append(time.perf_counter() - t)
            codes.setdefault(name, set()).add(r.returncode)
    print(f"{a.rounds} rounds, interpreter {a.python}, load {', '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print("| whole process | median | min | step (medians) | exit |\n|---|---|---|---|---|")
    names = list(times)
    med = {n: statistics.median(times[n][1:]) for n in names}
    steps = {names[1]: names[0], names[2]: names[1], names[3]: names[2], names[4]: names[3], names[5]: names[1]}
    for name in names:
        ref = steps.get(name)
        step = "–" if ref is None else f"{(med[name] - med[ref]) * 1000:+.1f} ms from row {names.index(ref) + 1}"
        print(f"| {name} | {med[name] * 1000:.1f} ms | {min(times[name][1:]) * 1000:.1f} ms | {step} | {sorted(codes[name])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
