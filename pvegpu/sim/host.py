"""The production ``/proc`` host, with the container boundary drawn by process session.

On a PVE node a container is a cgroup (``/lxc/<vmid>/ns``); here it is the session its simulated init
started. Everything else (fd scan by device number, identity checks, pidfd signals) is ProcHost's.
"""

from __future__ import annotations

import os

from ..adapters.procfs import DeviceTable, ProcHost, parse_stat
from ..model import Place, Placement
from .state import SimState


class SessionHost(ProcHost):
    def __init__(self, state: SimState) -> None:
        table = {(os.major(os.stat(g["stand_in"]).st_rdev), os.minor(os.stat(g["stand_in"]).st_rdev)): int(g["minor"])
                 for g in state.gpus()}
        super().__init__(DeviceTable(table))
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

    def _placement(self, pid: int, sid: int) -> tuple[Placement, str]:
        hit = self._sessions().get(sid)
        if hit is None:
            return Placement(Place.HOST), "/"
        return Placement(Place.CONTAINER, hit[0]), f"/lxc/{hit[0]}/ns (simulated: session {sid})"

    def _is_ct_init(self, pid: int, placement: Placement, nspid: list[int], sid: int) -> bool:
        hit = self._sessions().get(sid)
        return hit is not None and hit[1] == pid

    def ct_pids(self, vmid: int) -> list[int]:
        sids = [s for s, (v, _) in self._sessions().items() if v == vmid]
        out = []
        for pid in self.all_pids():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parsed = parse_stat(f.read())
            except OSError:
                continue
            if parsed and parsed[2] in sids and parsed[1] not in ("Z", "X"):
                out.append(pid)
        return out
