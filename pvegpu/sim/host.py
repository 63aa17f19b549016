"""The production ``/proc`` host, with the container boundary drawn by process session.

On a PVE node a container is a cgroup (``/lxc/<vmid>/ns``) plus a PID namespace; here it is the session
its simulated init started (``ps -o pid,sid,stat,comm -s <sid>``). Only the Boundary strategy differs:
everything else (fd and maps scan by device number, identity checks, pidfd signals, escaping) is ProcHost's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..adapters.procfs import DeviceTable, ProcHost
from ..model import Place, Placement
from ..procstat import Stat, read_stat
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


class SessionHost(ProcHost):
    """ProcHost over the simulated node's stand-in devices, with the SessionBoundary."""

    def __init__(self, state: SimState) -> None:
        table = {(os.major(os.stat(g["stand_in"]).st_rdev), os.minor(os.stat(g["stand_in"]).st_rdev)): int(g["minor"])
                 for g in state.gpus()}
        super().__init__(DeviceTable(table), boundary=SessionBoundary(state))
        self.state = state
