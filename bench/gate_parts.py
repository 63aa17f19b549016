"""Where the start gate's time goes, layer by layer, as whole processes next to ``nvidia-smi`` (root, GPU node).

    python3 bench/gate_parts.py [N]

Each row is a whole process, run N times interleaved with the others (so all see the same machine), median in ms.
The rows add one layer at a time: the interpreter, ctypes, loading libnvidia-ml, ``nvmlInit_v2``, the gate's NVML
reads, pvegpu's imports, the hook without its shell, the hookscript as PVE runs it. Then one ``-X importtime``
run of the hook (the slowest modules by their own time).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests import pvelike  # noqa: E402

PY = sys.executable
NVML_READS = """
import ctypes, os
l = ctypes.CDLL('libnvidia-ml.so.1'); l.nvmlInit_v2()
n = ctypes.c_uint(); l.nvmlDeviceGetCount_v2(ctypes.byref(n))
class M(ctypes.Structure): _fields_ = [(k, ctypes.c_ulonglong if k != 'v' else ctypes.c_uint) for k in ('v', 't', 'r', 'f', 'u')]
for i in range(n.value):
    h = ctypes.c_void_p(); l.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h))
    mi, b = ctypes.c_uint(), ctypes.create_string_buffer(96)
    l.nvmlDeviceGetMinorNumber(h, ctypes.byref(mi)); l.nvmlDeviceGetUUID(h, b, 96); l.nvmlDeviceGetName(h, b, 96)
    m = M(v=ctypes.sizeof(M) | (2 << 24)); l.nvmlDeviceGetMemoryInfo_v2(h, ctypes.byref(m))
    for f in ('Compute', 'Graphics', 'MPSCompute'):
        c = ctypes.c_uint(0); getattr(l, 'nvmlDevice' + 'Get' + f + 'RunningProcesses_v3')(h, ctypes.byref(c), None)
os._exit(0)
"""
GATE_MODULES = ("pvegpu.__main__", "pvegpu.frontdoor", "pvegpu.hook", "pvegpu.vmgate", "pvegpu.adapters.child",
                "pvegpu.adapters.etcpve", "pvegpu.adapters.procfs", "pvegpu.adapters.nvml_lite",
                "pvegpu.adapters.settingsfile", "pvegpu.adapters.override", "pvegpu.adapters.locks")
GUARD = "import sys; sys.path[:0] = sys.argv.pop(1).split(':'); from pvegpu.__main__ import main; main()"


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    t = time.perf_counter()
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    return (time.perf_counter() - t) * 1000, p.returncode, p.stderr


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 25
    tmp = tempfile.mkdtemp()
    conf = "arch: amd64\ndev0: /dev/nvidia0,gid=44\ndev1: /dev/nvidiactl,gid=44\nhostname: bench\n"
    root = pvelike.etc_pve(os.path.join(tmp, "pve"), "bench", {129: conf})
    cfg = os.path.join(tmp, "pvegpu.toml")
    with open(cfg, "w") as f:
        f.write(f'pve_root = "{root}"\n[reset]\nlock_dir = "{tmp}/locks"\n[gate]\noverride_dir = "{tmp}/allow"\n')
    guard = pvelike.guard(tmp, pvelike.launcher(tmp))
    env = {"PATH": pvelike.PVE_PATH, "LC_ALL": "C", "PVEGPU_CONFIG": cfg}
    imports = "import os, sys; sys.path[:0] = [%r]; " % REPO + "; ".join(f"import {m}" for m in GATE_MODULES) + "; os._exit(0)"
    rows = {
        "nvidia-smi --query-gpu=index,memory.used": ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
        "python -I -S -c pass": [PY, "-I", "-S", "-c", "pass"],
        "python -I -S -c 'import os; os._exit(0)'": [PY, "-I", "-S", "-c", "import os; os._exit(0)"],
        "/bin/sh -c 'exec python -I -S -c pass'": ["/bin/sh", "-c", f"exec {PY} -I -S -c pass"],
        "+ import ctypes": [PY, "-I", "-S", "-c", "import ctypes, os; os._exit(0)"],
        "+ CDLL(libnvidia-ml.so.1)": [PY, "-I", "-S", "-c", "import ctypes, os; ctypes.CDLL('libnvidia-ml.so.1'); os._exit(0)"],
        "+ nvmlInit_v2": [PY, "-I", "-S", "-c", "import ctypes, os; ctypes.CDLL('libnvidia-ml.so.1').nvmlInit_v2(); os._exit(0)"],
        "+ the gate's NVML reads (every GPU)": [PY, "-I", "-S", "-c", NVML_READS],
        "pvegpu's gate imports only": [PY, "-I", "-S", "-c", imports],
        "hook 129 pre-start, no shell (TOML parsed)": [PY, "-I", "-S", "-c", GUARD, REPO, "hook", "129", "pre-start"],
        "the hookscript as PVE runs it (TOML parsed)": [guard, "129", "pre-start"],
    }
    if not shutil.which("nvidia-smi"):  # no GPU here: only the rows without NVML (the ratio is then to the bare interpreter)
        rows = {k: v for k, v in rows.items() if "nvidia-smi" not in k and "CDLL" not in k and "nvml" not in k.lower()}
    for argv in rows.values():  # warm the page cache
        timed(argv, env)
    got: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(n):
        for name, argv in rows.items():
            ms, rc, err = timed(argv, env)
            if rc != 0:
                print(f"{name}: exit {rc}: {err.strip()[:300]}", file=sys.stderr)
            got[name].append(ms)
    smi = statistics.median(got[next(iter(rows))])
    print(f"{'whole process (median of %d, interleaved)' % n:52s} {'ms':>7s} {'min':>7s} {'÷ smi':>6s}")
    for name, v in got.items():
        med = statistics.median(v)
        print(f"{name:52s} {med:7.1f} {min(v):7.1f} {med / smi:6.2f}")
    _, _, err = timed([PY, "-I", "-S", "-X", "importtime", "-c", GUARD, REPO, "hook", "129", "pre-start"], env)
    mods = []
    for line in err.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[0].strip().isdigit():
            mods.append((int(parts[0]), int(parts[1]), parts[2].rstrip()))
    print(f"\n-X importtime of the hook: {len(mods)} modules, {sum(m[0] for m in mods) / 1000:.1f} ms in all (own time); the slowest:")
    for own, cum, name in sorted(mods, reverse=True)[:25]:
        print(f"  {own / 1000:6.2f} ms own {cum / 1000:7.2f} ms cumulative  {name.strip()}")


if __name__ == "__main__":
    main()
