"""What a ``pvegpu`` process pays before it does its work: interpreter start, imports, settings, NVML init,
next to ``nvidia-smi`` (median of N whole processes each), and the lean core's commands (gate, check, reset) on
a PVE-like tree and a simulated node. Run from the repo root (the GPU rows only where NVML is):

    python3 bench/startup_costs.py [N] [--compare DIR]

``--compare DIR`` runs every pvegpu row also from another checkout (e.g. ``git archive`` of the previous
commit), interleaved in the same run, and prints the ratio ``this / DIR``: same-run ratios, not absolute times.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
GUARD = "import sys; sys.path[:0] = sys.argv.pop(1).split(':'); from pvegpu.__main__ import main; main()"
# the guard as PVE runs it, with the default settings file (and its snapshot directory) moved into the bench's tree:
# the hook reads the default file, the only one with a snapshot (a checkout without one parses the TOML each time)
GUARD_DEFAULT = ("import sys; t, conf, snap = sys.argv[1:4]; del sys.argv[1:4]; sys.path[:0] = [t]; "
                 "import pvegpu.settings as S; S.DEFAULT_PATH = conf\n"
                 "try:\n import pvegpu.adapters.settingsfile as F; F.DEFAULT_PATH = conf; F.SNAPSHOT_DIR = snap\n"
                 "except ImportError:\n pass\n"
                 "from pvegpu.__main__ import main; main()")
TOOLS = {
    "python3 -I -S -c pass": [PY, "-I", "-S", "-c", "pass"],
    "python3 -c pass": [PY, "-c", "pass"],
    "import structlog": [PY, "-c", "import structlog"],
    "import typer": [PY, "-c", "import typer"],
    "import proxmoxer": [PY, "-c", "import proxmoxer"],
}
GPU_TOOLS = {
    "import pynvml; nvmlInit()": [PY, "-c", "import pynvml; pynvml.nvmlInit()"],
    "ctypes nvmlInit_v2 (-I -S)": [PY, "-I", "-S", "-c", "import ctypes; ctypes.CDLL('libnvidia-ml.so.1').nvmlInit_v2()"],
    "nvidia-smi --query-gpu=index,memory.used": ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
}


def pve_tree(root: str) -> str:
    """A PVE-like ``/etc/pve`` with CT 129 granted GPU 0 and a settings file pointing at it; returns the file."""
    pve = os.path.join(root, "pve")
    os.makedirs(os.path.join(pve, "nodes", "bench", "lxc"))
    with open(os.path.join(pve, ".vmlist"), "w") as f:
        json.dump({"version": 1, "ids": {"129": {"node": "bench", "type": "lxc", "version": 1}}}, f)
    os.symlink("nodes/bench", os.path.join(pve, "local"))
    with open(os.path.join(pve, "nodes", "bench", "lxc", "129.conf"), "w") as f:
        f.write("arch: amd64\nhostname: bench129\ndev0: /dev/nvidia0\n")
    conf = os.path.join(root, "pvegpu.toml")
    with open(conf, "w") as f:
        f.write(f'pve_root = "{pve}"\nnode = "bench"\n[reset]\nlock_dir = "{root}/locks"\n[gate]\noverride_dir = "{root}/allow"\n')
    os.chmod(conf, 0o644)
    return conf


def pvegpu_cases(tree: str, conf: str, sim: str) -> dict[str, list[str]]:
    """Whole pvegpu processes from checkout ``tree``: as the guard runs it (-I -S), and as the console script."""
    light = [PY, "-I", "-S", "-c", GUARD, tree]
    mod = [PY, "-m", "pvegpu"]
    snap = os.path.join(os.path.dirname(conf), "snapshot")
    return {
        "gate: guard pre-start, default file (snapshot)": [PY, "-I", "-S", "-c", GUARD_DEFAULT, tree, conf, snap, "hook", "129", "pre-start"],
        "gate: guard pre-start, PVEGPU_CONFIG=FILE (TOML)": ["env", f"PVEGPU_CONFIG={conf}", *light, "hook", "129", "pre-start"],
        "check 129 (python -m pvegpu), no GPU": [*mod, "--config", conf, "check", "129"],
        "reset 129 --json, not a PVE node": [*mod, "reset", "129", "--json"],
        "reset 129 --dry-run --json (simulated)": [*mod, "--simulate", sim, "reset", "129", "--dry-run", "--json"],
    }


def run_ms(argv: list[str], env: dict[str, str]) -> float:
    """One whole process, in the checkout its PYTHONPATH names (``python -m`` puts the working directory first)."""
    t = time.perf_counter()
    subprocess.run(argv, capture_output=True, env=env, check=False, cwd=env.get("PYTHONPATH") or None)
    return (time.perf_counter() - t) * 1000


def full_reset_ms(tree: str, env: dict[str, str], root: str) -> float:
    """One whole simulated ``pvegpu reset 129 --json`` (its workloads killed, NVML's release, the settle window)."""
    sys.path.insert(0, REPO)
    from pvegpu.sim import scenario as sc

    d = tempfile.mkdtemp(dir=root)
    node = sc.build(sc.DEMO, d)
    try:
        return run_ms([PY, "-m", "pvegpu", "--simulate", d, "reset", "129", "--json"], env)
    finally:
        node.teardown()
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    args = sys.argv[1:]
    compare = None
    if "--compare" in args:
        i = args.index("--compare")
        compare = os.path.abspath(args[i + 1])
        del args[i:i + 2]
    n = int(args[0]) if args else 9
    trees = {"this": REPO} | ({"before": compare} if compare else {})
    root = tempfile.mkdtemp(prefix="pvegpu-startup-")
    sys.path.insert(0, REPO)
    from pvegpu.sim import scenario as sc

    conf = pve_tree(root)
    time.sleep(2.1)  # older than the snapshot's racy margin, so the first gate run writes it
    sim = os.path.join(root, "sim")
    node = sc.build(sc.DEMO, sim)
    try:
        tools = dict(TOOLS) | (GPU_TOOLS if shutil.which("nvidia-smi") else {})
        base_env = dict(os.environ)
        for name, argv in tools.items():
            env = dict(base_env, PYTHONPATH=REPO)
            run_ms(argv, env)
            print(f"{name:48s} {statistics.median(run_ms(argv, env) for _ in range(n)):7.1f} ms", flush=True)
        bare = statistics.median(run_ms(TOOLS["python3 -I -S -c pass"], base_env) for _ in range(n))
        rows: dict[str, dict[str, list[float]]] = {}
        for _ in range(n):  # interleaved: both checkouts see the same machine load
            for label, tree in trees.items():
                env = dict(base_env, PYTHONPATH=tree)
                for name, argv in pvegpu_cases(tree, conf, sim).items():
                    rows.setdefault(name, {}).setdefault(label, []).append(run_ms(argv, env))
                rows.setdefault("full simulated reset 129 --json", {}).setdefault(label, []).append(full_reset_ms(tree, env, root))
        print(f"\n{'pvegpu process (median of ' + str(n) + ')':48s} " + "  ".join(f"{t:>9s}" for t in trees)
              + ("     ratio" if compare else "") + "   x bare")
        for name, per in rows.items():
            med = {t: statistics.median(v) for t, v in per.items()}
            line = f"{name:48s} " + "  ".join(f"{med[t]:6.1f} ms" for t in trees)
            if compare:
                line += f"  {med['this'] / med['before']:8.2f}"
            print(line + f"  {med['this'] / bare:7.1f}", flush=True)
        print(f"{'bare interpreter (python3 -I -S -c pass)':48s} {bare:6.1f} ms")
    finally:
        node.teardown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
