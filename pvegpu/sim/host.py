"""The production ``/proc`` host, with the container boundary drawn by process session.

On a PVE node a container is a cgroup (``/lxc/<vmid>/ns``) plus a PID namespace; here it is the session
its simulated init started (``ps -o pid,sid,stat,comm -s <sid>``). Only the Boundary strategy differs:
everything else (fd scan by device number, identity checks, pidfd signals, escaping) is ProcHost's.

One part of the scan differs too: a *mapped* stand-in is recognised by the device and inode the kernel writes in
its ``/proc/<pid>/maps`` line (``StandInScan``), not by ``stat /proc/<pid>/map_files/<range>``, because a
non-root user may not stat ``map_files`` even of their own processes (the demo and the tests run as a user).
That is sound here only because the simulated node names its stand-in files itself; on a real node a mapping
counts only if ``map_files`` stats as the GPU's character device (a ``devN`` mknod copy is another inode).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable
from typing import Any

from pvegpu.adapters.devscan import ProcessScan, ScanBudget, stat_nosync
from pvegpu.adapters.procfs import DeviceTable, ProcHost
from pvegpu.adapters.procstat import Stat, read_stat
from pvegpu.core.model import Place, Placement, Via
from pvegpu.sim.sessions import DEAD, descends, own_init
from pvegpu.sim.sessions import members as session_members
from pvegpu.sim.state import SimState


class SessionBoundary:
    """Container = the session of its simulated init, and only the processes below that init, while the init is
    provably this node's (``sessions.own_init``: pid, start time, owner, command line): a state file that names
    any other process places nothing in a container, so nothing else is ever signalled."""

    def __init__(self, state: SimState) -> None:
        self.state = state
        self._mtime = -1.0
        self._by_sid: dict[int, tuple[int, int, dict[str, Any]]] = {}  # sid -> (vmid, init pid, the state naming it)
        self._proved: set[tuple[int, int]] = set()  # inits whose owner and command line were read: only their start time is read again

    def _sessions(self) -> dict[int, tuple[int, int, dict[str, Any]]]:
        path = os.path.join(self.state.root, "cts")
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return {}
        if mtime != self._mtime:
            self._mtime = mtime
            self._by_sid = {int(c["sid"]): (int(c["vmid"]), int(c["init_pid"]), c)
                            for c in self.state.cts() if c.get("status") == "running" and c.get("sid") and c.get("init_pid")}
        return self._by_sid

    def _own(self, sid: int) -> tuple[int, int] | None:
        """(vmid, init pid) of the session ``sid`` when its init is provably this node's, else None."""
        hit = self._sessions().get(sid)
        if hit is None:
            return None
        ident = (hit[1], hit[2].get("init_start"))
        if ident in self._proved:
            st = read_stat(hit[1])
            if st is not None and st.start_ticks == ident[1] and st.state not in DEAD:
                return hit[0], hit[1]
            return None
        init = own_init(self.state.root, hit[2])
        if init is None:
            return None
        self._proved.add(init)
        return hit[0], hit[1]

    def place(self, pid: int, st: Stat) -> tuple[Placement, str]:
        hit = self._own(st.sid)
        if hit is None or not descends(pid, hit[1]):
            return Placement(Place.HOST), "/"
        return Placement(Place.CONTAINER, hit[0]), f"/lxc/{hit[0]}/ns (simulated: session {st.sid})"

    def view(self, pid: int, placement: Placement, nspid: list[int]) -> tuple[int | None, bool]:
        """No PID namespace here: the pid in the "container" is the host pid."""
        if placement.place is not Place.CONTAINER:
            return None, False
        hit = next((h for h in self._sessions().values() if h[0] == placement.vmid), None)
        return pid, hit is not None and hit[1] == pid

    def members(self, vmid: int) -> Iterable[int]:
        sids = [s for s, (v, _, _) in self._sessions().items() if v == vmid and self._own(s) is not None]
        return [p for s in sids for p in session_members(s)]

    def init_candidates(self, vmid: int) -> Iterable[int]:
        """The init the node recorded for the container, once proved its own (no walk over every process)."""
        return [hit[1] for s, (v, _, _) in self._sessions().items() if v == vmid and (hit := self._own(s)) is not None]


PRIVATE_MAJOR = 0xFFFFF  # no kernel device number has it (majors are 12 bits): an fd of a private stand-in stats as PRIVATE_MAJOR:n


class StandInTable(DeviceTable):
    """The stand-ins' device numbers (for open fds) and their files' (st_dev, st_ino) (for mappings).

    A stand-in that is a plain file (the default: the node's own ``DIR/dev/nvidia<minor>``) is matched by its
    inode for open fds too: no process outside this node opens it, whatever else on the machine holds a device."""

    def __init__(self, gpus: list[dict[str, object]]) -> None:
        stats = [(os.stat(str(g["stand_in"])), int(str(g["minor"]))) for g in gpus]
        self.private_paths = frozenset(os.path.realpath(str(g["stand_in"])) for g, (st, _) in zip(gpus, stats) if stat.S_ISREG(st.st_mode))
        self.files = {(st.st_dev, st.st_ino): m for st, m in stats}
        private = [((st.st_dev, st.st_ino), m) for st, m in stats if stat.S_ISREG(st.st_mode)]
        self.private = {key: n for n, (key, _) in enumerate(private)}  # file -> the pseudo device's minor
        super().__init__({(os.major(st.st_rdev), os.minor(st.st_rdev)): m for st, m in stats if stat.S_ISCHR(st.st_mode)}
                         | {(PRIVATE_MAJOR, n): m for n, (_, m) in enumerate(private)})


class StandInScan(ProcessScan):
    """ProcessScan whose mappings are matched by the (device, inode) in the maps line: no ``map_files`` needed;
    an open fd of a private (plain file) stand-in stats as the pseudo device ``PRIVATE_MAJOR:<minor>``."""

    def __init__(self, devices: DeviceTable, budget: ScanBudget, cache: dict[tuple[bytes, bytes], int | None],
                 clock: Callable[[], float] = time.monotonic, stat_of: Callable[[str], tuple[int, int]] = stat_nosync) -> None:
        super().__init__(devices, budget, cache, clock=clock, stat_of=stat_of)
        if isinstance(devices, StandInTable) and devices.private:
            self._use_stat(_private_stat(devices.private, devices.private_paths, stat_of))

    def _prove(self, proc: str, pid: int, leader_zombie: bool, files: dict[tuple[bytes, bytes], bytes],
               minors: set[int], via: set[str]) -> bool:
        table = self.devices.files if isinstance(self.devices, StandInTable) else {}
        for n, (dev, ino) in enumerate(files):
            if n % 256 == 255:
                self._check()
            major, _, minor = dev.partition(b":")
            m = table.get((os.makedev(int(major, 16), int(minor, 16)), int(ino)))
            if m is not None:
                minors.add(m)
                via.add(Via.MAPS)
        return False  # every line is decided: a mapping is a stand-in's file or no GPU of this node


def _private_stat(private: dict[tuple[int, int], int], paths: frozenset[str],
                  inner: Callable[[str], tuple[int, int]]) -> Callable[[str], tuple[int, int]]:
    """``inner``, except that an fd of a private stand-in stats as its pseudo device; only an fd whose link names a
    stand-in is stat'ed in full (and then counts by its inode), so no other file's server is asked."""
    def stat_of(path: str) -> tuple[int, int]:
        mode, rdev = inner(path)
        if stat.S_ISREG(mode) and os.readlink(path) in paths:
            st = os.stat(path)
            n = private.get((st.st_dev, st.st_ino))
            if n is not None:
                return stat.S_IFCHR | stat.S_IMODE(mode), os.makedev(PRIVATE_MAJOR, n)
        return mode, rdev
    return stat_of


class SessionHost(ProcHost):
    """ProcHost over the simulated node's stand-in devices, with the SessionBoundary and the StandInScan."""

    def __init__(self, state: SimState, record_dir: str | None = None) -> None:
        super().__init__(StandInTable(state.gpus()), boundary=SessionBoundary(state), scan=StandInScan, record_dir=record_dir)
        self.state = state
