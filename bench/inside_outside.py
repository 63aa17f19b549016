"""Whole-process wall time of the hook's check vs the time measured inside the process (median of 20)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import pvelike  # noqa: E402

tmp = tempfile.mkdtemp()
root = pvelike.etc_pve(os.path.join(tmp, "pve"), "bench", {129: "dev0: /dev/nvidia0,gid=44\n"})
cfg = os.path.join(tmp, "c.toml")
open(cfg, "w").write(f'pve_root = "{root}"\n')
env = {"PATH": pvelike.PVE_PATH, "LC_ALL": "C", "PVEGPU_CONFIG": cfg}
code = ("import time; t0 = time.perf_counter(); import sys; sys.path[:0] = [sys.argv.pop(1)]; "
        "from pvegpu import wiring; from pvegpu.gate import evaluate; t1 = time.perf_counter(); "
        "s = wiring.settings(wiring.GlobalOptions()); r = evaluate(129, wiring.gate_ports(s), wiring.gate_policy(s)); t2 = time.perf_counter(); "
        "print(f'{(t1 - t0) * 1000:.1f} {(t2 - t1) * 1000:.1f}')")
argv = [sys.executable, "-I", "-S", "-c", code, pvelike.REPO]
subprocess.run(argv, env=env, capture_output=True)
walls, imps, checks = [], [], []
for _ in range(20):
    t = time.perf_counter()
    out = subprocess.run(argv, env=env, capture_output=True, text=True).stdout.split()
    walls.append((time.perf_counter() - t) * 1000)
    imps.append(float(out[0]))
    checks.append(float(out[1]))
m = statistics.median
print(f"process wall {m(walls):.1f} ms = imports {m(imps):.1f} + check {m(checks):.1f} + start/exit {m(walls) - m(imps) - m(checks):.1f}")
