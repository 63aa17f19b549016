"""Where the start gate's time goes, layer by layer, as whole processes next to ``nvidia-smi`` (root, GPU node).

    python3 bench/gate_parts.py [N] [--compare DIR]

Each row is a whole process, run N times interleaved with the others (so all see the same machine), median in ms.
The rows add one layer at a time: the interpreter, ctypes, loading libnvidia-ml, ``nvmlInit_v2``, the gate's NVML
reads, pvegpu's imports, the hook without its shell, the hookscript as PVE runs it. Then one ``-X importtime``
run of the hook (the slowest modules by their own time). The hook rows read the settings as an installed node
does: ``/etc/pvegpu/pvegpu.toml`` (made for the run when absent, removed after), through its snapshot.
``--compare DIR``: the hook rows also from another checkout (e.g. ``git archive`` of an older commit), same run.
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


def guard_for(tmp: str, tree: str, name: str) -> str:
    """The hookscript with its fast path pointing at checkout ``tree``."""
    path = pvelike.guard(tmp, pvelike.launcher(tmp))
    with open(path) as f:
        text = f.read().replace(f"PVEGPU_PYTHONPATH={REPO}", f"PVEGPU_PYTHONPATH={tree}")
    out = os.path.join(tmp, name)
    with open(out, "w") as f:
        f.write(text)
    os.chmod(out, 0o755)
    return out


def main() -> None:
    args = sys.argv[1:]
    trees = {"this": REPO}
    if "--compare" in args:
        i = args.index("--compare")
        trees["other"] = os.path.abspath(args[i + 1])
        del args[i:i + 2]
    n = int(args[0]) if args else 25
    tmp = tempfile.mkdtemp()
    conf = "arch: amd64\ndev0: /dev/nvidia0,gid=44\ndev1: /dev/nvidiactl,gid=44\nhostname: bench\n"
    root = pvelike.etc_pve(os.path.join(tmp, "pve"), "bench", {129: conf})
    cfg = os.path.join(tmp, "pvegpu.toml")
    text = f'pve_root = "{root}"\n[reset]\nlock_dir = "{tmp}/locks"\n[gate]\noverride_dir = "{tmp}/allow"\n'
    with open(cfg, "w") as f:
        f.write(text)
    default = "/etc/pvegpu/pvegpu.toml"
    made_default = not os.path.exists(default) and os.geteuid() == 0
    if made_default:
        os.makedirs(os.path.dirname(default), exist_ok=True)
        with open(default, "w") as f:
            f.write(text)
        os.chmod(default, 0o644)
        time.sleep(2.1)  # a file changed in the last 2 s gets no snapshot (adapters/settingsfile)
    env = {"PATH": pvelike.PVE_PATH, "LC_ALL": "C"} | ({} if made_default or os.path.exists(default) else {"PVEGPU_CONFIG": cfg})
    env_cfg = {"PATH": pvelike.PVE_PATH, "LC_ALL": "C", "PVEGPU_CONFIG": cfg}
    imports = "import os, sys; sys.path[:0] = [%r]; " % REPO + "; ".join(f"import {m}" for m in GATE_MODULES) + "; os._exit(0)"
    rows: dict[str, tuple[list[str], dict[str, str]]] = {
        "nvidia-smi --query-gpu=index,memory.used": (["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"], env),
        "python -I -S -c pass": ([PY, "-I", "-S", "-c", "pass"], env),
        "python -I -S -c 'import os; os._exit(0)'": ([PY, "-I", "-S", "-c", "import os; os._exit(0)"], env),
        "/bin/sh -c 'exec python -I -S -c pass'": (["/bin/sh", "-c", f"exec {PY} -I -S -c pass"], env),
        "+ import ctypes": ([PY, "-I", "-S", "-c", "import ctypes, os; os._exit(0)"], env),
        "+ CDLL(libnvidia-ml.so.1)": ([PY, "-I", "-S", "-c", "import ctypes, os; ctypes.CDLL('libnvidia-ml.so.1'); os._exit(0)"], env),
        "+ nvmlInit_v2": ([PY, "-I", "-S", "-c", "import ctypes, os; ctypes.CDLL('libnvidia-ml.so.1').nvmlInit_v2(); os._exit(0)"], env),
        "+ the gate's NVML reads (every GPU)": ([PY, "-I", "-S", "-c", NVML_READS], env),
        "pvegpu's gate imports only": ([PY, "-I", "-S", "-c", imports], env),
    }
    for label, tree in trees.items():
        rows[f"hook 129 pre-start, no shell [{label}]"] = ([PY, "-I", "-S", "-c", GUARD, tree, "hook", "129", "pre-start"], env)
        rows[f"the hookscript as PVE runs it [{label}]"] = ([guard_for(tmp, tree, f"guard-{label}"), "129", "pre-start"], env)
    rows["the hookscript, PVEGPU_CONFIG=FILE [this]"] = ([guard_for(tmp, REPO, "guard-cfg"), "129", "pre-start"], env_cfg)
    try:
        _run(rows, n)
    finally:
        if made_default:
            os.unlink(default)


def _run(rows: dict[str, tuple[list[str], dict[str, str]]], n: int) -> None:
    if not shutil.which("nvidia-smi"):  # no GPU here: only the rows without NVML (the ratio is then to the bare interpreter)
        rows = {k: v for k, v in rows.items() if "nvidia-smi" not in k and "CDLL" not in k and "nvml" not in k.lower()}
    for argv, env in rows.values():  # warm the page cache (and write the settings snapshots)
        timed(argv, env)
    got: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(n):
        for name, (argv, env) in rows.items():
            ms, rc, err = timed(argv, env)
            if rc != 0:
                print(f"{name}: exit {rc}: {err.strip()[:300]}", file=sys.stderr)
            got[name].append(ms)
    smi = statistics.median(got[next(iter(rows))])
    print(f"{'whole process (median of %d, interleaved)' % n:52s} {'ms':>7s} {'min':>7s} {'÷ smi':>6s}")
    for name, v in got.items():
        med = statistics.median(v)
        print(f"{name:52s} {med:7.1f} {min(v):7.1f} {med / smi:6.2f}")
    argv, env = rows["hook 129 pre-start, no shell [this]"]
    _, _, err = timed([PY, "-I", "-S", "-X", "importtime", *argv[3:]], env)
    mods = []
    for line in err.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[0].strip().isdigit():
            mods.append((int(parts[0]), int(parts[1]), parts[2].rstrip()))
    print(f"\n-X importtime of the hook (before its fork and after, not its child's): {len(mods)} modules, {sum(m[0] for m in mods) / 1000:.1f} ms in all (own time); the slowest:")
    for own, cum, name in sorted(mods, reverse=True)[:25]:
        print(f"  {own / 1000:6.2f} ms own {cum / 1000:7.2f} ms cumulative  {name.strip()}")


if __name__ == "__main__":
    main()
