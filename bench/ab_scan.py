"""The holder scan of this checkout against an older release's, in one process, interleaved (issue 20).

Usage (root): python3 bench/ab_scan.py BASE_CHECKOUT [--sizes 2000,20000] [--rounds 9]

BASE_CHECKOUT's ``pvegpu`` package is imported as ``pvegpu_base`` (its imports are relative), so both scans read the
same node in the same process, round after round: the old scan (serial), the new one serial (``workers=1``), the new one over
forked workers (the default). The node is bench_audit_sbs's: 100 container cgroups of sleeping processes, 4 holders of
a stand-in device in each of 25 of them. Reported: wall time (median, min) and this process's CPU time for the
serial scans (less moved by other work on the machine than wall time), and whether every answer was the same.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench.bench_audit_sbs import STAND_INS, spawn_node  # noqa: E402
from pvegpu.adapters.procfs import DeviceTable, ProcHost  # noqa: E402
from tests import pvelike  # noqa: E402


def load_base(checkout: str):  # noqa: ANN201 - the older release's procfs module
    top = tempfile.mkdtemp(prefix="pvegpu-ab-")
    os.symlink(os.path.join(os.path.abspath(checkout), "pvegpu"), os.path.join(top, "pvegpu_base"))
    sys.path.insert(0, top)
    return importlib.import_module("pvegpu_base.adapters.procfs")


def _serial_host(mod, numbers):  # noqa: ANN001, ANN202 - the base release's serial ProcHost (older ones have no workers)
    try:
        return mod.ProcHost(mod.DeviceTable(numbers), workers=1)
    except TypeError:
        return mod.ProcHost(mod.DeviceTable(numbers))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base")
    ap.add_argument("--sizes", default="2000,20000")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    old = load_base(a.base)
    numbers = {(os.major(os.stat(d).st_rdev), os.minor(os.stat(d).st_rdev)): m for m, d in enumerate(STAND_INS)}
    print("| processes | scan | wall median | wall min | CPU median (this process) | same answer |\n|---|---|---|---|---|---|")
    for size in (int(x) for x in a.sizes.split(",") if x):
        base = 620000 + (os.getpid() % 1000) * 100
        pids, _owners, vmids = [], {}, [base + i for i in range(100)]
        try:
            pids, _owners, vmids = spawn_node(size, base)
            time.sleep(1.0)
            variants = {"base, serial": lambda: _serial_host(old, numbers).holdings(),
                        "this, serial": lambda: ProcHost(DeviceTable(numbers), workers=1).holdings(),
                        "this, forked workers": lambda: ProcHost(DeviceTable(numbers)).holdings()}
            wall: dict[str, list[float]] = {k: [] for k in variants}
            cpu: dict[str, list[float]] = {k: [] for k in variants}
            same = True
            for _ in range(a.rounds):
                answers = {}
                for name, fn in variants.items():
                    t, c = time.perf_counter(), time.process_time()
                    held = fn()
                    wall[name].append(time.perf_counter() - t)
                    cpu[name].append(time.process_time() - c)
                    answers[name] = {p: (sorted(h.minors), sorted(h.via)) for p, h in held.items() if p in set(pids)}
                same = same and len({repr(sorted(v.items())) for v in answers.values()}) == 1
            nprocs = len([n for n in os.listdir("/proc") if n.isdigit()])
            for name in variants:
                print(f"| {nprocs:,} | {name} | {statistics.median(wall[name]) * 1000:.0f} ms | {min(wall[name]) * 1000:.0f} ms | "
                      f"{statistics.median(cpu[name]) * 1000:.0f} ms | {'yes' if same else 'NO'} |", flush=True)
        finally:
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in pids:
                try:
                    os.waitpid(p, 0)
                except ChildProcessError:
                    pass
            for v in vmids:
                pvelike.destroy_ct(v)
    print(f"\nload {', '.join(f'{x:.1f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
