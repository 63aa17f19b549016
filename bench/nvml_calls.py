"""What each NVML call the start gate makes costs, in a fresh process each round (root, GPU node).

    python3 bench/nvml_calls.py [N]

Each round is ``python -I -S`` loading ``libnvidia-ml.so.1`` through ctypes and timing, with ``perf_counter``,
each call the gate's reader makes, in its order (``adapters/nvml_warm.py``, then ``adapters/nvml_lite.py``): init,
count, the handle of every GPU, then per GPU minor, UUID, name, memory (v2) and the three process lists. Prints
each call's median and minimum over N rounds, in µs.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

ROUND = r"""
import ctypes, time, os
T = time.perf_counter
out = []
def t(name, f, *a):
    s = T(); rc = f(*a); out.append((name, (T() - s) * 1e6, rc))
s = T(); l = ctypes.CDLL('libnvidia-ml.so.1'); out.append(('load', (T() - s) * 1e6, 0))
t('nvmlInit_v2', l.nvmlInit_v2)
n = ctypes.c_uint(); t('GetCount_v2', l.nvmlDeviceGetCount_v2, ctypes.byref(n))
hs = []
for i in range(n.value):
    h = ctypes.c_void_p(); t('GetHandleByIndex_v2[%d]' % i, l.nvmlDeviceGetHandleByIndex_v2, i, ctypes.byref(h)); hs.append(h)
class M(ctypes.Structure): _fields_ = [(k, ctypes.c_ulonglong if k != 'v' else ctypes.c_uint) for k in ('v', 't', 'r', 'f', 'u')]
for i, h in enumerate(hs):
    mi, b = ctypes.c_uint(), ctypes.create_string_buffer(96)
    t('GetMinorNumber[%d]' % i, l.nvmlDeviceGetMinorNumber, h, ctypes.byref(mi))
    t('GetUUID[%d]' % i, l.nvmlDeviceGetUUID, h, b, 96)
    t('GetName[%d]' % i, l.nvmlDeviceGetName, h, b, 96)
    m = M(v=ctypes.sizeof(M) | (2 << 24)); t('GetMemoryInfo_v2[%d]' % i, l.nvmlDeviceGetMemoryInfo_v2, h, ctypes.byref(m))
    for f in ('Compute', 'Graphics', 'MPSCompute'):
        c = ctypes.c_uint(0); t('Get%sRunningProcesses_v3[%d]' % (f, i), getattr(l, 'nvmlDeviceGet%sRunningProcesses_v3' % f), h, ctypes.byref(c), None)
t('nvmlShutdown', l.nvmlShutdown)
os.write(1, repr(out).encode()); os._exit(0)
"""


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    acc: dict[str, list[float]] = {}
    order: list[str] = []
    for _ in range(n):
        p = subprocess.run([sys.executable, "-I", "-S", "-c", ROUND], capture_output=True, text=True, check=True)
        for name, us, _rc in eval(p.stdout):  # noqa: S307 - our own child's repr of (str, float, int) tuples
            if name not in acc:
                order.append(name)
            acc.setdefault(name, []).append(us)
    print(f"NVML calls, {n} fresh processes (µs): median (min)")
    for name in order:
        print(f"  {name:40s} {statistics.median(acc[name]):9.0f} ({min(acc[name]):.0f})")
    print(f"  {'all of them':40s} {statistics.median([sum(v[i] for v in acc.values()) for i in range(n)]):9.0f}")


if __name__ == "__main__":
    main()
