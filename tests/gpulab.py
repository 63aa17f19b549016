"""Helpers for the GPU tests: real CUDA workloads (bench/cuda_hold.py: cuInit, a context, cuMemAlloc; stdlib
only, so dozens start in parallel in seconds) in PVE-like containers, and waiting until each one is READY:
its ready file is there (allocated) and, where it should be, NVML lists it with its memory. A workload that
died fails the wait at once, with its exit status, never after the whole deadline.

Nothing here needs a GPU to be imported or unit-tested (tests/test_gpu_helpers.py); the GPU tests use it.
"""

from __future__ import annotations

import json
import os
import selectors
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLDER = os.path.join(REPO, "bench", "cuda_hold.py")
MIB = 1 << 20


def holder_argv(gib: float, ready: str, *flags: str, python: str = sys.executable) -> list[str]:
    """``python3 bench/cuda_hold.py --gib N --ready FILE [flags]``."""
    return [python, HOLDER, "--gib", f"{gib:g}", "--ready", ready, *flags]


def watched_script(argv: list[str], exit_file: str) -> str:
    """A shell line that runs ``argv`` and writes its exit status to ``exit_file`` when it ends (how a test
    learns at once that a workload died). The shell stays as the workload's parent: it holds no GPU fd."""
    return f"{shlex.join(argv)}; echo $? > {shlex.quote(exit_file)}"


def watched_argv(argv: list[str], exit_file: str) -> list[str]:
    """The same as an argv (for ``tests/pvelike.start_ct``)."""
    return ["sh", "-c", '"$@"; echo $? > "$0"', exit_file, *argv]


@dataclass
class Workload:
    """One CUDA workload a test waits for.

    ``pids``: host pids that may be the workload (a container's processes, or the host process); ``listed``:
    whether NVML must list one of them with at least ``0.9 * gib`` (False for a fork-after-init child, whose
    parent NVML lists after it died); ``exit_file``: written with the exit status when the workload ends;
    ``exited``: or a call that gives the exit status once it ended (``Popen.poll`` of a host process).
    """

    name: str
    gib: float
    ready: str
    pids: Callable[[], Iterable[int]]
    exit_file: str | None = None
    listed: bool = True
    exited: Callable[[], int | None] | None = None


def problem(w: Workload, nvml: Mapping[int, int | None], exists: Callable[[str], bool] = os.path.exists,
            read: Callable[[str], str] | None = None) -> tuple[str, str] | None:
    """Why ``w`` is not ready: ("dead", why) when it ended, ("waiting", why) while it is not there yet; None when ready."""
    if w.exit_file and exists(w.exit_file):
        status = (read or _read)(w.exit_file).strip() or "?"
        return "dead", f"{w.name}: the workload ended (exit status {status}) before it was ready"
    if w.exited is not None and (rc := w.exited()) is not None:
        return "dead", f"{w.name}: the workload ended (exit status {rc}) before it was ready"
    if not exists(w.ready):
        return "waiting", f"{w.name}: not allocated yet (no {os.path.basename(w.ready)})"
    if w.listed:
        want = int(w.gib * 1024 * 0.9) * MIB
        mine = [nvml.get(p) for p in w.pids() if p in nvml]
        if not any(used is not None and used >= want for used in mine):
            return "waiting", f"{w.name}: not listed by NVML with {want // MIB} MiB yet (its pids listed with {mine})"
    return None


def wait_ready(workloads: list[Workload], nvml: Callable[[], Mapping[int, int | None]], timeout: float = 120.0, *,
               exists: Callable[[str], bool] = os.path.exists, read: Callable[[str], str] | None = None,
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait until every workload is ready; returns the seconds it took. AssertionError at once when one died,
    and at the deadline naming every workload still not ready."""
    t0 = clock()
    while True:
        listed = nvml()
        found = [(w, p) for w in workloads if (p := problem(w, listed, exists, read)) is not None]
        dead = [why for _w, (kind, why) in found if kind == "dead"]
        if dead:
            raise AssertionError("; ".join(dead))
        if not found:
            return clock() - t0
        if clock() - t0 >= timeout:
            raise AssertionError(f"{len(found)} of {len(workloads)} workload(s) not ready after {timeout:g} s: "
                                 + "; ".join(why for _w, (_k, why) in found[:5]))
        sleep(0.1)


def first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The first line ``proc`` prints (its stdout a pipe), within ``timeout`` seconds; AssertionError when it
    ends or stays silent that long (a read of a process stuck in the driver never hangs the test)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            raise AssertionError(f"pid {proc.pid} printed nothing in {timeout:g} s (exit status {proc.poll()})")
        line = proc.stdout.readline()
    finally:
        sel.close()
    if not line:
        raise AssertionError(f"pid {proc.pid} ended (exit status {proc.wait(5)}) before it printed anything")
    return line.strip()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def nvml_listed(index: int = 0) -> dict[int, int | None]:
    """pid -> used bytes of every process NVML lists on GPU ``index`` (compute and graphics), through nvidia-ml-py."""
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    out: dict[int, int | None] = {}
    for fn in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
        try:
            for p in fn(h):
                out[int(p.pid)] = None if p.usedGpuMemory is None else int(p.usedGpuMemory)
        except pynvml.NVMLError:
            pass
    return out


def record(row: dict) -> None:
    """Append one result row to $PVEGPU_RESULTS (JSON lines), as the other GPU tests do."""
    path = os.environ.get("PVEGPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def goal(row: dict, wall_s: float, goal_s: float) -> dict:
    """The row with the wall time and whether it met the goal (performance is recorded, not asserted)."""
    return row | {"wall_s": round(wall_s, 3), "goal_s": goal_s, "goal_met": wall_s <= goal_s}


class PvegpuCalls:
    """A lab's pvegpu runs (a whole process with the lab's settings file) and the API calls its pvesh stand-in logged;
    the lab sets ``config``, ``env`` and ``pvesh_log``."""

    config: str
    env: dict[str, str]
    pvesh_log: str

    def pvegpu(self, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "pvegpu", "--config", self.config, *args], capture_output=True, text=True,
                           env=self.env, timeout=timeout, cwd=REPO)
        return r, time.perf_counter() - t

    def api_calls(self) -> list[str]:
        with open(self.pvesh_log) as f:
            return f.read().split("\n")[:-1]
