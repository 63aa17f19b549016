"""Cost of the host scan (``ProcHost.holdings()`` over every process) with hostile co-tenants.

Usage (root with CAP_SYS_RESOURCE, to raise RLIMIT_NOFILE for 400,000 fds): python3 bench/bench_scan.py [N]
Scenarios: a plain node; plus a co-tenant with 65,000 mappings of a file with a ~4000-character path;
plus a co-tenant with 400,000 open fds. Each is scanned with the default per-process budget and with
no effective budget (what an unbounded scan costs). Prints a table of median wall times over N scans
and what the scan says about the co-tenant (``via``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pvegpu.adapters.procfs import DeviceTable, ProcHost, ScanBudget  # noqa: E402

FULL = os.stat("/dev/full").st_rdev
TABLE = DeviceTable({(os.major(FULL), os.minor(FULL)): 0})
UNBOUNDED = ScanBudget(fds=10**9, map_lines=10**9, map_bytes=10**12, seconds=3600.0)

MAPPER = r"""
import ctypes, os, sys
n, path = int(sys.argv[1]), sys.argv[2]
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open(path, os.O_RDONLY)
for i in range(n):  # offset 0 each time: neighbouring mappings never merge into one
    if libc.mmap(None, 4096, 1, 2, fd, 0) in (None, 2**64 - 1):
        break
os.close(fd)
print('ok', flush=True)
sys.stdin.read()
"""

FDS = r"""
import os, resource, sys
n = int(sys.argv[1])
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, n + 64))
except (ValueError, OSError):  # no CAP_SYS_RESOURCE: as many as the hard limit allows
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    n = min(n, hard - 64)
fd = os.open('/dev/null', os.O_RDONLY)
for _ in range(n - 1):
    os.dup(fd)
print('ok', n, flush=True)
sys.stdin.read()
"""


def long_path(top: str) -> str:
    """A regular file whose absolute path is close to PATH_MAX (nested 200-character directory names)."""
    d = top
    while len(d) < 3800:
        d = os.path.join(d, "d" * 200)
    os.makedirs(d)
    path = os.path.join(d, "weights.bin")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    return path


def co_tenant(code: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    line = p.stdout.readline().split() if p.stdout is not None else []
    assert line[:1] == [b"ok"], "co-tenant did not start"
    return p, (line[1].decode() if len(line) > 1 else "")


def scan(budget: ScanBudget, n: int, watch: int | None) -> tuple[float, float, str, int]:
    times = []
    seen = "-"
    count = 0
    for _ in range(n):
        host = ProcHost(TABLE, budget=budget)
        t = time.perf_counter()
        held = host.holdings()
        times.append(time.perf_counter() - t)
        count = len(host.all_pids())
        if watch is not None:
            seen = "+".join(sorted(held[watch].via)) if watch in held else "holds nothing"
    return statistics.median(times), max(times), seen, count


def fake_fd_rows(top: str, n: int) -> list[tuple[str, str, float, float, str, int]]:
    """Scan one process of a /proc-like tree whose fd directory holds 400,000 links (a stand-in when
    RLIMIT_NOFILE cannot be raised). Only that process is scanned, so compare with the row above it."""
    pid = 4_000_000
    fd_dir = os.path.join(top, "proc", str(pid), "fd")
    os.makedirs(fd_dir)
    for i in range(400_000):
        os.symlink("/dev/null", os.path.join(fd_dir, str(i)))
    with open(os.path.join(top, "proc", str(pid), "maps"), "w"):
        pass
    rows = []
    for label, budget in (("default", ScanBudget()), ("unbounded", UNBOUNDED)):
        times, seen = [], "-"
        for _ in range(n):
            host = ProcHost(TABLE, proc=os.path.join(top, "proc"), budget=budget)
            t = time.perf_counter()
            held = host.holdings([pid])
            times.append(time.perf_counter() - t)
            seen = "+".join(sorted(held[pid].via)) if pid in held else "holds nothing"
        rows.append(("400,000 fd links (one pid)", label, statistics.median(times), max(times), seen, 1))
    return rows


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    top = tempfile.mkdtemp(prefix="pvegpu-bench-scan-")
    rows: list[tuple[str, str, float, float, str, int]] = []
    try:
        for label, budget in (("default", ScanBudget()), ("unbounded", UNBOUNDED)):
            rows.append(("plain node", label, *scan(budget, n, None)))
        mapper, _ = co_tenant(MAPPER, "65000", long_path(top))
        try:
            with open(f"/proc/{mapper.pid}/maps", "rb") as f:
                lines = sum(1 for _ in f)
            print(f"co-tenant {mapper.pid}: {lines} mappings", file=sys.stderr)
            for label, budget in (("default", ScanBudget()), ("unbounded", UNBOUNDED)):
                rows.append(("+ 65,000 long-path mappings", label, *scan(budget, n, mapper.pid)))
        finally:
            mapper.kill()
            mapper.wait()
        fds, opened = co_tenant(FDS, "400000")
        try:  # 400,000 needs CAP_SYS_RESOURCE to raise the hard limit; fewer are opened (and named) without it
            for label, budget in (("default", ScanBudget()), ("unbounded", UNBOUNDED)):
                rows.append((f"+ {int(opened):,} open fds", label, *scan(budget, n, fds.pid)))
        finally:
            fds.kill()
            fds.wait()
        if int(opened) < 400_000:  # the same fd directory, as a /proc tree of 400,000 fd links to /dev/null
            rows += fake_fd_rows(top, n)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    print(f"{'scenario':30} {'budget':10} {'median s':>9} {'max s':>7}  {'procs':>5}  co-tenant seen as")
    for scen, label, med, mx, seen, count in rows:
        print(f"{scen:30} {label:10} {med:9.3f} {mx:7.3f}  {count:5d}  {seen}")
    b = ScanBudget()
    print(f"default budget per process: {b.fds} fds, {b.map_lines} maps lines, {b.map_bytes >> 20} MiB of maps, {b.seconds} s")


if __name__ == "__main__":
    main()
