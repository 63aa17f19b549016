"""Start-up side by side, whole processes, same run (issue 20): a bare interpreter, the gate, check, a reset dry run,
a full reset, next to `pvegpu reset 129 --json` on a machine that is not a PVE node.

Usage (from the repo root; no root, no GPU): python3 bench/startup_sbs.py [ROUNDS] [--out DIR]

Each round runs every case once, interleaved (so a busy machine slows all of them alike); the table gives the median
and min over the rounds and the ratio to ``python3 -I -S -c pass`` in the same run. The gate, check and reset cases
run against a simulated node (``--simulate DIR``, ``pvegpu/sim``): NVML is the driver model, the holder a real
process on a stand-in device, so what is measured is pvegpu's own start-up and work, not a driver's. The full reset
gets a fresh node each round (built outside the timing) with one holder in CT 129; CT 140 is stopped and granted the
same GPU, so the gate (``hook 140 pre-start``) and ``check 140`` decide a real start.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PY = sys.executable
GPU = {"minor": 0, "index": 0, "name": "Simulated H200", "total_mib": 143771, "stand_in": "/dev/full"}
NODE = {"node": "pve-sim", "gpus": [GPU], "containers": [
    {"vmid": 129, "name": "llm129", "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 2048}]},
    {"vmid": 140, "name": "next140", "status": "stopped", "gpus": [0], "workloads": []}]}


def cases(root: str) -> dict[str, list[str]]:
    sim = [PY, "-m", "pvegpu", "--simulate", root]
    return {
        "`python3 -I -S -c pass` (bare interpreter)": [PY, "-I", "-S", "-c", "pass"],
        "`pvegpu reset 129 --json`, not a PVE node (exits at once)": [PY, "-m", "pvegpu", "reset", "129", "--json"],
        "gate: `pvegpu hook 140 pre-start`": [*sim, "hook", "140", "pre-start"],
        "`pvegpu check 140`": [*sim, "check", "140"],
        "`pvegpu reset 129 --dry-run --json`": [*sim, "reset", "129", "--dry-run", "--json"],
    }


FULL = "full reset: `pvegpu reset 129 --json` (one holder, SIGTERM, settle)"


def run(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    t = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, env=env, cwd=REPO, timeout=120)
    return time.perf_counter() - t, r.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rounds", nargs="?", type=int, default=9)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    from pvegpu.sim import scenario as sc

    tmp = tempfile.mkdtemp(prefix="pvegpu-bench-startup-")
    env = dict(os.environ, PYTHONPATH=REPO, PVEGPU_PVE_ROOT=os.path.join(tmp, "no-pve"))
    times: dict[str, list[float]] = {}
    codes: dict[str, set[int]] = {}
    node = sc.build(NODE, os.path.join(tmp, "node"))
    try:
        for argv in cases(node.root).values():  # warm the page cache
            run(argv, env)
        for r in range(a.rounds):
            for name, argv in cases(node.root).items():
                dt, rc = run(argv, env)
                times.setdefault(name, []).append(dt)
                codes.setdefault(name, set()).add(rc)
            fresh = sc.build(NODE, os.path.join(tmp, f"reset{r}"))
            try:
                dt, rc = run([PY, "-m", "pvegpu", "--simulate", fresh.root, "reset", "129", "--json"], env)
                times.setdefault(FULL, []).append(dt)
                codes.setdefault(FULL, set()).add(rc)
            finally:
                fresh.teardown()
    finally:
        node.teardown()
    when = datetime.datetime.now(datetime.UTC)
    bare = statistics.median(times[next(iter(times))])
    lines = [f"{when:%Y-%m-%d %H:%M} UTC, {platform.node()}: {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
             f"{sys.version.split()[0]}, load {', '.join(f'{x:.1f}' for x in os.getloadavg())}; {a.rounds} rounds", "",
             "| whole process | median | min | ÷ bare interpreter | exit |", "|---|---|---|---|---|"]
    for name, ts in times.items():
        m = statistics.median(ts)
        lines.append(f"| {name} | {m * 1000:.0f} ms | {min(ts) * 1000:.0f} ms | {m / bare:.1f}× | "
                     f"{','.join(map(str, sorted(codes[name])))} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"startup_sbs-{when:%Y-%m-%d-%H%M}.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
