"""Cost of `pvegpu audit` on one busy node: 8 simulated GPUs, 100 containers, 2,000 real processes.

Usage (root): python3 bench/bench_audit.py [ROUNDS]

The containers are real cgroups (``/lxc/<vmid>/ns``, as PVE lays them out) holding 20 real processes each;
half of the containers hold a stand-in character device open (``/dev/full``, ``/dev/random``, ...) as their
``/dev/nvidiaN``; NVML is a stand-in listing one owner pid per holding container. The configs are a real
``/etc/pve``-like tree read from files, as on a node: Proxmox API calls stay 0 whatever the container count.
Prints: the whole audit (median), the holder scan per 1,000 processes, the PVE reads by kind, and the manual
method on the same node (``fuser -v`` on the stand-in devices + ``cat /proc/<pid>/cgroup`` per holder).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pvegpu.adapters.etcpve import EtcPve  # noqa: E402
from pvegpu.adapters.nodefiles import LocalNodeFiles  # noqa: E402
from pvegpu.adapters.procfs import DeviceTable, ProcHost  # noqa: E402
from pvegpu.audit import run_audit  # noqa: E402
from pvegpu.model import MIB, GpuHealth, GpuInfo, GpuSample, NvmlProcess  # noqa: E402
from tests import pvelike  # noqa: E402

GPUS, CTS, PER_CT = 8, 100, 20
STAND_INS = ["/dev/full", "/dev/random", "/dev/urandom", "/dev/zero"]  # GPUs 0-3; 4-7 are seen through NVML only


class StandInNvml:
    """NVML stand-in: 8 GPUs; each holding container's first process is listed with 1 GiB."""

    def __init__(self, owners: dict[int, list[int]]) -> None:
        self.owners = owners  # gpu minor -> owner pids

    def gpus(self) -> list[GpuInfo]:
        return [GpuInfo(i, i, f"GPU-bench-{i}", f"0000:{0x41 + i:02x}:00.0", "Bench GPU", 143771 * MIB) for i in range(GPUS)]

    def sample(self, minors):
        return {m: GpuSample(m, len(self.owners.get(m, [])) * 1024 * MIB, tuple(NvmlProcess(p, 1024 * MIB) for p in self.owners.get(m, [])))
                for m in minors}

    def health(self, minor: int) -> GpuHealth:
        return GpuHealth(reserved_bytes=615 * MIB, remap_pending=False, mig_enabled=False)


class CountingPve(EtcPve):
    """The node's /etc/pve reader, counting reads by kind (none of them is an API call)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.calls: dict[str, int] = {}

    def guests(self):
        self.calls["guests"] = self.calls.get("guests", 0) + 1
        return super().guests()

    def ct_config(self, guest):
        self.calls["ct_config (file)"] = self.calls.get("ct_config (file)", 0) + 1
        return super().ct_config(guest)


def child(cg: str, dev: str | None, r: int, w: int) -> None:
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    fd = os.open(dev, os.O_RDONLY) if dev else None  # noqa: F841 - held open, as a CUDA process holds /dev/nvidiaN
    os.close(r)
    os.write(w, b".")
    os.close(w)
    signal.pause()
    os._exit(0)


def breakdown(pids: list[int]) -> tuple[float, float]:
    """The two halves of the holder scan, timed apart: fd table (listdir + stat) and the maps text."""
    t = time.perf_counter()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    pass
        except OSError:
            pass
    fd_t = time.perf_counter() - t
    t = time.perf_counter()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                f.read()
        except OSError:
            pass
    return fd_t, time.perf_counter() - t


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("run as root (cgroups)")
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    base = 700000 + (os.getpid() % 1000) * 1000  # vmids private to this run
    vmids = [base + i for i in range(CTS)]
    tmp = tempfile.mkdtemp(prefix="pvegpu-bench-audit-")
    confs = {v: f"arch: amd64\nhostname: ct{i}\ndev0: /dev/nvidia{i % GPUS},gid=44\ndev1: /dev/nvidiactl,gid=44\n" for i, v in enumerate(vmids)}
    root = pvelike.etc_pve(os.path.join(tmp, "pve"), "bench", confs)
    kids: list[int] = []
    owners: dict[int, list[int]] = {}
    try:
        t0 = time.perf_counter()
        for i, v in enumerate(vmids):
            cg = pvelike.cgroup_dir(v)
            os.makedirs(cg, exist_ok=True)
            holding = i % 2 == 0
            gpu = i % GPUS
            dev = STAND_INS[gpu] if holding and gpu < len(STAND_INS) else None
            for j in range(PER_CT):
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    child(cg, dev, r, w)
                os.close(w)
                os.read(r, 1)  # the child is in its cgroup, its device open
                os.close(r)
                kids.append(pid)
                if holding and j == 0:
                    owners.setdefault(gpu, []).append(pid)
        setup = time.perf_counter() - t0
        nprocs = len([n for n in os.listdir("/proc") if n.isdigit()])
        table = DeviceTable({(os.major(os.stat(d).st_rdev), os.minor(os.stat(d).st_rdev)): m for m, d in enumerate(STAND_INS)})
        host, probe = ProcHost(table), StandInNvml(owners)
        pve = CountingPve(root, node="bench")
        files = LocalNodeFiles(root, dev_map={f"/dev/nvidia{m}": "/dev/full" for m in range(GPUS)} | {"/dev/nvidiactl": "/dev/full"})
        audits, scans = [], []
        for _ in range(rounds):
            pve.calls.clear()
            t = time.perf_counter()
            rep = run_audit(pve=pve, probe=probe, host=host, files=files)
            audits.append(time.perf_counter() - t)
            t = time.perf_counter()
            host.holdings(None)
            scans.append(time.perf_counter() - t)
        fd_t, maps_t = breakdown(host.all_pids())
        if os.environ.get("BENCH_PROFILE"):
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.runcall(run_audit, pve=pve, probe=probe, host=host, files=files)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(14)
            pve.calls.clear()
            run_audit(pve=pve, probe=probe, host=host, files=files)
        held = sum(len([h for h in g.holders if h.place == "lxc"]) for g in rep.gpus)
        manual = []
        for _ in range(rounds):
            t = time.perf_counter()
            out = subprocess.run(["fuser", *STAND_INS], capture_output=True, text=True).stdout
            for pid in out.split():
                try:
                    with open(f"/proc/{''.join(c for c in pid if c.isdigit())}/cgroup") as f:
                        f.read()
                except (OSError, ValueError):
                    pass
            manual.append(time.perf_counter() - t)
        print(f"node: {GPUS} GPUs, {CTS} containers x {PER_CT} = {len(kids)} bench processes, {nprocs} processes on the host "
              f"(setup {setup:.1f} s); {held} container holders found, {len(rep.guests)} GPU containers listed")
        print(f"audit (whole node, {rounds} rounds): median {statistics.median(audits) * 1000:.0f} ms, min {min(audits) * 1000:.0f} ms")
        per_k = statistics.median(scans) / nprocs * 1000
        print(f"holder scan (fd + maps of every process): median {statistics.median(scans) * 1000:.0f} ms = {per_k * 1000:.1f} ms per 1,000 processes")
        print(f"  of which: fd listdir+stat {fd_t * 1000:.0f} ms, /proc/<pid>/maps reads {maps_t * 1000:.0f} ms")
        print(f"PVE reads per audit: {dict(sorted(pve.calls.items()))}; Proxmox API calls: 0")
        print(f"manual (`fuser {' '.join(STAND_INS)}` + /proc/<pid>/cgroup per holder): median {statistics.median(manual) * 1000:.0f} ms "
              "(no memory, no placement logic, no configs)")
    finally:
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        for v in vmids:
            pvelike.destroy_ct(v)


if __name__ == "__main__":
    main()
