"""A/B: the guard (check in a forked child) vs the same check in-process, as whole processes (median of 25)."""

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
guard = pvelike.guard(tmp, pvelike.launcher(tmp))
env = {"PATH": pvelike.PVE_PATH, "LC_ALL": "C", "PVEGPU_CONFIG": cfg}
fast = dict(ln.split("=", 1) for ln in open(guard).read().splitlines() if ln.startswith(("PVEGPU_PYTHON=", "PVEGPU_PYTHONPATH=")))
py, pp = fast["PVEGPU_PYTHON"], fast["PVEGPU_PYTHONPATH"]
inproc = [py, "-I", "-S", "-c", "import sys; sys.path[:0] = sys.argv.pop(1).split(':'); from pvegpu import wiring; from pvegpu.gate import evaluate; "
          "s = wiring.settings(wiring.GlobalOptions()); "
          "sys.exit(0 if evaluate(129, wiring.gate_ports(s), wiring.gate_policy(s)).decision.allow else 10)", pp]
variants = {"guard (forked check)": [guard, "129", "pre-start"], "same check in-process": inproc,
            "python -I -S pass": [py, "-I", "-S", "-c", "pass"], "sh -c true": ["/bin/sh", "-c", "true"]}
for name, argv in variants.items():
    subprocess.run(argv, env=env, capture_output=True)
    ts = []
    for _ in range(25):
        t = time.perf_counter()
        subprocess.run(argv, env=env, capture_output=True)
        ts.append(time.perf_counter() - t)
    print(f"{name:28s} {statistics.median(ts) * 1000:7.1f} ms")
