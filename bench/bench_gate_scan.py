"""The start gate with a dead NVML-listed pid on a node of ~20,000 processes: bounded scan vs the whole node.

Usage: python3 bench/bench_gate_scan.py [PROCESSES] [RUNS]   (default 20000, 5; no root, no GPU needed)

Real processes at that count would take most of this host's pid space (shared with other work), so the node is a
simulated ``/proc`` (and cgroupfs) of that size that the production ``ProcHost`` reads as it reads the real one:
per process ``stat``, ``status``, ``cgroup``, ``cmdline``, ``maps`` and an ``fd`` directory of links (to
``/dev/null``; the GPU stand-in is ``/dev/zero``). 10 containers of 5 processes are granted GPU 0; one holds an
orphaned fork child that maps it (the heir of the dead listed pid). NVML is the driver model with the dead pid's
context listed. Prints the gate's wall time (median and max over RUNS) with the scan bounded by the containers
granted the GPU (``gate.evaluate``) and with the whole node scanned (what the gate did before), and the verdicts.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pvegpu import gate  # noqa: E402
from pvegpu.adapters.clock import SystemClock  # noqa: E402
from pvegpu.adapters.procfs import DeviceTable, ProcHost  # noqa: E402
from pvegpu.adapters.procstat import read_stat  # noqa: E402
from pvegpu.contract import dumps  # noqa: E402
from pvegpu.model import MIB, GpuInfo, Guest  # noqa: E402
from pvegpu.sim.driver import DriverModel  # noqa: E402

ZERO = os.stat("/dev/zero").st_rdev
CTS = list(range(200, 210))
TARGET = 300


def _proc(root: str, pid: int, ppid: int, cgroup: str, nspid: str, fds: list[str], maps: str = "", comm: str = "worker") -> None:
    d = os.path.join(root, str(pid))
    os.makedirs(os.path.join(d, "fd"))
    os.makedirs(os.path.join(d, "task"))
    os.makedirs(os.path.join(d, "map_files"))
    fields = ["S", str(ppid), str(pid), str(pid)] + ["0"] * 15 + [str(1000 + pid)] + ["0"] * 30
    fields[17] = "1"  # num_threads (field 20)
    with open(os.path.join(d, "stat"), "w") as f:
        f.write(f"{pid} ({comm}) " + " ".join(fields) + "\n")
    with open(os.path.join(d, "status"), "w") as f:
        f.write(f"Name:\t{comm}\nUid:\t0\t0\t0\t0\nNSpid:\t{nspid}\nSigIgn:\t0000000000000000\nSigCgt:\t0000000000004002\n")
    with open(os.path.join(d, "cgroup"), "w") as f:
        f.write(f"0::{cgroup}\n")
    with open(os.path.join(d, "cmdline"), "w") as f:
        f.write(comm + "\0")
    with open(os.path.join(d, "maps"), "w") as f:
        f.write(maps or "55d0c0000000-55d0c0021000 r--p 00000000 08:01 1234 /usr/bin/python3.11\n")
    for i, target in enumerate(fds):
        os.symlink(target, os.path.join(d, "fd", str(i)))
    if maps:
        rng = maps.split()[0]
        os.symlink("/dev/zero", os.path.join(d, "map_files", rng))


def build(n: int, root: str) -> tuple[str, str, int, int]:
    """A /proc and cgroupfs of ``n`` processes; returns (proc, cgroup root, heir pid, ghost pid)."""
    proc, cg = os.path.join(root, "proc"), os.path.join(root, "cgroup")
    os.makedirs(proc)
    os.makedirs(cg)
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write("1\n")
    pid = 2
    heir = 0
    for vmid in CTS:
        ns = os.path.join(cg, "lxc", str(vmid), "ns")
        os.makedirs(ns)
        members = []
        init = pid
        _proc(proc, init, 1, f"/lxc/{vmid}/ns/init.scope", f"{init}\t1", ["/dev/null"], comm="init")
        members.append(init)
        pid += 1
        for k in range(4):
            mapped = vmid == CTS[0] and k == 0
            _proc(proc, pid, init, f"/lxc/{vmid}/ns/app.service", f"{pid}\t{k + 2}", ["/dev/null", "/dev/zero"] if mapped else ["/dev/null"],
                  maps="7f0000000000-7f0000001000 rw-s 00000000 00:05 6 /dev/zero\n" if mapped else "")
            if mapped:
                heir = pid
            members.append(pid)
            pid += 1
        with open(os.path.join(ns, "cgroup.procs"), "w") as f:
            f.write("\n".join(map(str, members)) + "\n")
    while pid < n + 2:
        _proc(proc, pid, 1, f"/system.slice/svc{pid % 97}.service", str(pid), ["/dev/null", "/dev/null", "/dev/null"])
        pid += 1
    return proc, cg, heir, pid + 10  # a pid with no entry: dead


class Pve:
    """The gate's /etc/pve reads: the containers granted GPU 0 and the (stopped) target."""

    def local_node(self) -> str:
        return "bench"

    def where(self, vmid: int) -> Guest | None:
        return Guest(vmid, "bench", "lxc")

    def guests(self) -> list[Guest]:
        return [Guest(v, "bench", "lxc") for v in [*CTS, TARGET]]

    def ct_config(self, guest: Guest) -> str:
        return "arch: amd64\ndev0: /dev/nvidia0,gid=44\n"


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    tmp = tempfile.mkdtemp(prefix="pvegpu-bench-")
    try:
        t = time.perf_counter()
        proc, cg, heir, ghost = build(n, tmp)
        built = time.perf_counter() - t
        host = ProcHost(DeviceTable({(os.major(ZERO), os.minor(ZERO)): 0}), proc=proc, cgroup_root=cg)

        def alive(ident: tuple[int, int]) -> bool:
            st = read_stat(ident[0], proc)
            return st is not None and st.start_ticks == ident[1]

        model = DriverModel(SystemClock(), alive, (0,))
        model.names = {0: GpuInfo(0, 0, "GPU-bench-0", "0000:41:00.0")}
        model.open_context(0, 8192 * MIB, (ghost, 1), (heir, 1000 + heir))  # the dead parent's context, kept by its orphan
        ports = gate.GatePorts(Pve(), model, host)
        out: dict[str, object] = {"processes": len(os.listdir(proc)), "build_s": round(built, 1), "runs": runs}
        for label, bounded in (("bounded", True), ("whole_node", False)):
            real = gate.inspect_gpus
            if not bounded:
                gate.inspect_gpus = lambda *a, real=real, **kw: real(*a, **{k: v for k, v in kw.items() if k != "heir_pids"})
            times, verdict = [], None
            try:
                for _ in range(runs):
                    t = time.perf_counter()
                    res = gate.evaluate(TARGET, ports, gate.GatePolicy())
                    times.append(time.perf_counter() - t)
                    verdict = (res.decision.allow, str(res.decision.per_gpu.get(0)), res.facts[0].heirs)
            finally:
                gate.inspect_gpus = real
            out[label] = {"median_ms": round(statistics.median(times) * 1000, 1), "max_ms": round(max(times) * 1000, 1),
                          "verdict": verdict}
        print(dumps(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
