"""The node's processes, seen through ``/proc`` and cgroupfs, signalled through pidfds.

Manual equivalents: ``fuser -v /dev/nvidia*`` (holders by device number), ``cat /proc/<pid>/cgroup``
(which container), ``grep NSpid /proc/<pid>/status`` (pid inside the container), ``kill -TERM``.
"""

from __future__ import annotations

import os
import re
import signal as _signal
import stat
from collections.abc import Iterable, Mapping

from ..cgroup import parse_cgroup
from ..lxcconf import NVIDIA_MAJOR
from ..model import CONTROL, Holding, Place, Placement, ProcIdentity, ProcInfo, SignalResult

_MAPS_GPU = re.compile(r"\s/dev/nvidia(\d+|ctl|-uvm|-uvm-tools|-modeset)(?: \(deleted\))?$")
CGROUP_ROOTS = ("", "unified", "systemd", "pids", "memory", "cpu", "devices", "freezer")


def control_majors(proc: str = "/proc") -> frozenset[int]:
    """Dynamic majors of nvidia-uvm and nvidia-caps (``grep nvidia /proc/devices``)."""
    try:
        with open(f"{proc}/devices", encoding="utf-8") as f:
            return frozenset(int(p[0]) for line in f if len(p := line.split()) == 2 and p[0].isdigit()
                             and p[1].startswith(("nvidia-uvm", "nvidia-caps")))
    except OSError:
        return frozenset()


class DeviceTable:
    """Which character device numbers stand for which GPU minor.

    On a node: major 195 minors 0-253 are GPUs; 195:254 (modeset), 195:255 (nvidiactl) and the dynamic
    majors of nvidia-uvm and nvidia-caps are CONTROL nodes (no particular GPU). Tests and the simulated
    node pass their own stand-in numbers, which is also what PVE's ``devN`` mknod copies are: another
    path and inode, the same device number.
    """

    def __init__(self, gpus: Mapping[tuple[int, int], int] | None = None, control: frozenset[int] | None = None,
                 proc: str = "/proc") -> None:
        self._explicit = dict(gpus) if gpus is not None else None
        self._control = control if control is not None else (control_majors(proc) if gpus is None else frozenset())

    def gpu_minor(self, rdev: int) -> int | None:
        """The GPU minor a device number stands for, CONTROL for the shared control nodes, else None."""
        major, minor = os.major(rdev), os.minor(rdev)
        if self._explicit is not None:
            return self._explicit.get((major, minor))
        if major == NVIDIA_MAJOR:
            return minor if minor < 254 else CONTROL
        return CONTROL if major in self._control else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def parse_stat(text: str) -> tuple[str, str, int, int] | None:
    """(comm, state, session id, start ticks) from ``/proc/<pid>/stat``; comm may hold spaces and ')'."""
    lp, rp = text.find("("), text.rfind(")")
    if lp < 0 or rp < 0:
        return None
    fields = text[rp + 2 :].split()
    if len(fields) < 20:
        return None
    return text[lp + 1 : rp], fields[0], int(fields[3]), int(fields[19])


def parse_nspid(status_text: str) -> list[int]:
    for line in status_text.splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return []



class ProcHost:
    """The real node: ``/proc`` and cgroupfs under injectable roots, pidfd signals."""

    def __init__(
        self,
        devices: DeviceTable | None = None,
        proc: str = "/proc",
        cgroup_root: str = "/sys/fs/cgroup",
    ) -> None:
        self.devices = devices or DeviceTable()
        self.proc = proc
        self.cgroup_root = cgroup_root
        self.self_pid = os.getpid()

    # -- placement (overridden by the simulated node) -------------------------------------------
    def _placement(self, pid: int, sid: int) -> tuple[Placement, str]:
        text = _read(f"{self.proc}/{pid}/cgroup")
        if text is None:
            return Placement(Place.HOST), "?"
        return parse_cgroup(text)

    def _is_ct_init(self, pid: int, placement: Placement, nspid: list[int], sid: int) -> bool:
        return placement.place is Place.CONTAINER and len(nspid) > 1 and nspid[-1] == 1

    # -- Host port ------------------------------------------------------------------------------
    def describe(self, pid: int) -> ProcInfo | None:
        text = _read(f"{self.proc}/{pid}/stat")
        parsed = parse_stat(text) if text else None
        if parsed is None:
            return None
        comm, state, sid, start = parsed
        nspid = parse_nspid(_read(f"{self.proc}/{pid}/status") or "")
        placement, path = self._placement(pid, sid)
        return ProcInfo(
            ident=ProcIdentity(pid, start),
            comm=comm,
            state=state,
            placement=placement,
            cgroup=path,
            ns_pid=nspid[-1] if nspid else None,
            is_ct_init=self._is_ct_init(pid, placement, nspid, sid),
        )

    def all_pids(self) -> list[int]:
        return [int(n) for n in os.listdir(self.proc) if n.isdigit()]

    def ct_pids(self, vmid: int) -> list[int]:
        pids: set[int] = set()
        found_dir = False
        for sub in CGROUP_ROOTS:
            top = os.path.join(self.cgroup_root, sub, "lxc", str(vmid))
            if not os.path.isdir(top):
                continue
            found_dir = True
            for dirpath, _dirs, _files in os.walk(top):
                text = _read(os.path.join(dirpath, "cgroup.procs")) or ""
                pids.update(int(x) for x in text.split() if x.isdigit())
        if not found_dir and not self._cgroupfs_mounted():
            pids.update(self._ct_pids_by_proc(vmid))  # no cgroupfs where expected: ask every process
        want = Placement(Place.CONTAINER, vmid)
        return sorted(p for p in pids if (i := self.describe(p)) is not None and i.placement == want and i.state not in ("Z", "X"))

    def _cgroupfs_mounted(self) -> bool:
        """A cgroup v2 root or a v1/hybrid hierarchy is mounted, so a missing lxc/<vmid> dir means an empty CT."""
        return any(os.path.exists(os.path.join(self.cgroup_root, sub, "cgroup.procs")) for sub in CGROUP_ROOTS)

    def _ct_pids_by_proc(self, vmid: int) -> list[int]:
        want = Placement(Place.CONTAINER, vmid)
        return [p for p in self.all_pids() if self._placement(p, -1)[0] == want]

    def holdings(self, pids: Iterable[int] | None = None) -> dict[int, Holding]:
        out: dict[int, Holding] = {}
        for pid in self.all_pids() if pids is None else pids:
            if pid == self.self_pid:
                continue
            held = self._scan_one(pid)
            if held is not None:
                out[pid] = held
        return out

    def _scan_one(self, pid: int) -> Holding | None:
        minors: set[int] = set()
        via: set[str] = set()
        fd_dir = f"{self.proc}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            return None
        except PermissionError:
            return Holding(pid, frozenset(), frozenset({"unreadable"}))
        for fd in fds:
            try:
                st = os.stat(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and (m := self.devices.gpu_minor(st.st_rdev)) is not None:
                minors.add(m)
                via.add("fd")
        maps = _read(f"{self.proc}/{pid}/maps") or ""
        if "/dev/nvidia" in maps:
            for line in maps.splitlines():
                if mm := _MAPS_GPU.search(line):
                    minors.add(int(mm.group(1)) if mm.group(1).isdigit() else CONTROL)
                    via.add("maps")
        if not minors:
            return None
        return Holding(pid, frozenset(minors), frozenset(via))

    def alive(self, ident: ProcIdentity) -> bool:
        text = _read(f"{self.proc}/{ident.pid}/stat")
        parsed = parse_stat(text) if text else None
        return parsed is not None and parsed[3] == ident.start_ticks and parsed[1] not in ("Z", "X")

    def signal(self, ident: ProcIdentity, sig: int, vmid: int) -> SignalResult:
        try:
            pidfd = os.pidfd_open(ident.pid)
        except ProcessLookupError:
            return SignalResult.GONE
        try:
            # The pidfd pins the process; re-check identity now, so a recycled pid is never hit.
            info = self.describe(ident.pid)
            if info is None or info.ident != ident or info.state in ("Z", "X"):
                return SignalResult.GONE
            if info.placement != Placement(Place.CONTAINER, vmid):
                return SignalResult.MOVED
            if info.is_ct_init or info.pid == self.self_pid:
                return SignalResult.REFUSED
            _signal.pidfd_send_signal(pidfd, sig)
            return SignalResult.SENT
        except ProcessLookupError:
            return SignalResult.GONE
        finally:
            os.close(pidfd)
