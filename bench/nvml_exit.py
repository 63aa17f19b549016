"""Whole-process cost of NVML start and teardown variants (median of 20): where does the gate's time go?"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

INIT = "import ctypes,os; l=ctypes.CDLL('libnvidia-ml.so.1'); l.nvmlInit_v2()"
ATTACH = "; h=ctypes.c_void_p(); l.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))"
variants = {
    "python -S pass": "pass",
    "init, normal exit": INIT,
    "init, nvmlShutdown, exit": INIT + "; l.nvmlShutdown()",
    "init, os._exit": INIT + "; os._exit(0)",
    "init+attach, normal exit": INIT + ATTACH,
    "init+attach, nvmlShutdown, exit": INIT + ATTACH + "; l.nvmlShutdown()",
    "init+attach, os._exit": INIT + ATTACH + "; os._exit(0)",
}
for name, code in variants.items():
    argv = [sys.executable, "-I", "-S", "-c", code]
    subprocess.run(argv)
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        subprocess.run(argv)
        ts.append(time.perf_counter() - t)
    print(f"{name:34s} {statistics.median(ts) * 1000:7.1f} ms")
t = [0.0] * 20
for i in range(20):
    s = time.perf_counter()
    subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"], capture_output=True)
    t[i] = time.perf_counter() - s
print(f"{'nvidia-smi --query-gpu':34s} {statistics.median(t) * 1000:7.1f} ms")
