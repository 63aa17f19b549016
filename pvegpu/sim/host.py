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
from collections.abc import Iterable

from ..adapters.devscan import ProcessScan
from ..adapters.procfs import DeviceTable, ProcHost
from ..adapters.procstat import Stat, read_stat
from ..model import Place, Placement, Via
from .state import SimState


class SessionBoundary:
    """Container = the session of its simulated init; its init is the recorded init pid."""

    def __init__(self, state: SimState) -> None:
        self.state = state
        self._mtime = -1.0
        self._by_sid: dict[int, tuple[int, int]] = {}  # sid -> (vmid, init pid)

    def _sessions(self) -> dict[int, tuple[int, int]]:
        path = os.path.join(self.state.root, "cts")
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return {}
        if mtime != self._mtime:
            self._mtime = mtime
            self._by_sid = {int(c["sid"]): (int(c["vmid"]), int(c["init_pid"]))
                            for c in self.state.cts() if c.get("status") == "running" and c.get("sid")}
        return self._by_sid

    def place(self, pid: int, st: Stat) -> tuple[Placement, str]:
        hit = self._sessions().get(st.sid)
        if hit is None:
            return Placement(Place.HOST), "/"
        return Placement(Place.CONTAINER, hit[0]), f"/lxc/{hit[0]}/ns (simulated: session {st.sid})"

    def view(self, pid: int, placement: Placement, nspid: list[int]) -> tuple[int | None, bool]:
        """No PID namespace here: the pid in the "container" is the host pid."""
        if placement.place is not Place.CONTAINER:
            return None, False
        hit = next((h for h in self._sessions().values() if h[0] == placement.vmid), None)
        return pid, hit is not None and hit[1] == pid

    def members(self, vmid: int) -> Iterable[int]:
        sids = {s for s, (v, _) in self._sessions().items() if v == vmid}
        return [int(n) for n in os.listdir("/proc") if n.isdigit() and (st := read_stat(n)) is not None and st.sid in sids]


class StandInTable(DeviceTable):
    """The stand-ins' device numbers (for open fds) and their files' (st_dev, st_ino) (for mappings).

    A stand-in that is a plain file (a GPU no process holds, e.g. one that only leaks) has no device number."""

    def __init__(self, gpus: list[dict[str, object]]) -> None:
        stats = [(os.stat(str(g["stand_in"])), int(str(g["minor"]))) for g in gpus]
        super().__init__({(os.major(st.st_rdev), os.minor(st.st_rdev)): m for st, m in stats if stat.S_ISCHR(st.st_mode)})
        self.files = {(st.st_dev, st.st_ino): m for st, m in stats}


class StandInScan(ProcessScan):
    """ProcessScan whose mappings are matched by the (device, inode) in the maps line: no ``map_files`` needed."""

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


class SessionHost(ProcHost):
    """ProcHost over the simulated node's stand-in devices, with the SessionBoundary and the StandInScan."""

    def __init__(self, state: SimState) -> None:
        super().__init__(StandInTable(state.gpus()), boundary=SessionBoundary(state), scan=StandInScan)
        self.state = state
