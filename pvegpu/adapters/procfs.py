"""The node's processes, seen through ``/proc`` and cgroupfs, signalled through pidfds.

Manual equivalents: ``fuser -v /dev/nvidia*`` (holders by device number), ``cat /proc/<pid>/cgroup``
(which container), ``grep NSpid /proc/<pid>/status`` (pid inside the container), ``kill -TERM``.

Where the container boundary is drawn is a strategy (``Boundary``): on a node it is the cgroup
``/lxc/<vmid>/`` plus the container's PID namespace (``CgroupBoundary``); the simulated node passes its
own. Everything a tenant can write (comm, cmdline, cgroup names) is escaped before it leaves here and
never decides anything: placement is parsed from the raw bytes, the init from kernel-written NSpid.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from pvegpu.adapters import pidrecord, scanpool
from pvegpu.adapters.devscan import BUDGET, UNREADABLE, DeviceTable, ProcessScan, ScanBudget, control_majors, stat_nosync
from pvegpu.adapters.procstat import PF_KTHREAD, Stat, kernel_thread, parse_stat, read_small, read_stat  # noqa: F401 - kernel_thread, PF_KTHREAD: re-exported
from pvegpu.core.cgroup import UNKNOWN, parse_cgroup
from pvegpu.core.model import Holding, Place, Placement, ProcIdentity, ProcInfo, SeenPid, SignalResult, Via
from pvegpu.core.safetext import escape

STUCK = Via.STUCK  # via, with unreadable: reading this process's fds or mappings blocked in the kernel (a hung mount)


class Boundary(Protocol):
    """Where containers begin and end on this node (a strategy passed to ProcHost)."""

    def place(self, pid: int, st: Stat) -> tuple[Placement, str]:
        """The process's placement and the raw (unescaped) path or note that decided it."""
        ...

    def view(self, pid: int, placement: Placement, nspid: list[int]) -> tuple[int | None, bool]:
        """(pid inside the container's PID namespace, whether it is the container's own init)."""
        ...

    def members(self, vmid: int) -> Iterable[int]:
        """Candidate pids of the container (ProcHost re-checks each by ``place``)."""
        ...

    def init_candidates(self, vmid: int) -> Iterable[int]:
        """Pids that may be the container's init, likeliest first (ProcHost re-checks each by ``describe``)."""
        ...


__all__ = ["CgroupBoundary", "DeviceTable", "ProcHost", "ScanBudget", "control_majors", "parse_status"]

CGROUP_ROOTS = ("", "unified", "systemd", "pids", "memory", "cpu", "devices", "freezer")
CT_LEVEL = 1  # index in NSpid of the container's PID namespace: one below the host's, where lxc creates it
CMDLINE_READ = 4096  # bytes of /proc/<pid>/cmdline read (display only)
CMDLINE_SHOWN = 512  # characters kept after escaping
DEAD = ("Z", "X")
CMDLINE_CACHE = 65_536  # identities whose command line one run keeps (bounded: a node of many short-lived processes)


def _read_bytes(path: str, limit: int = 1 << 20) -> bytes | None:
    """Up to ``limit`` bytes of ``path`` (read to its end), None when it cannot be opened or read: what
    ``open(path, "rb").read(limit)`` gives, without a file object's fstat, ioctl and lseek per file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks: list[bytes] = []
        left = limit
        while left > 0 and (chunk := os.read(fd, min(left, 65536))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)




CMDLINE_WAIT = 0.25  # seconds a command line's read may take outside a watched scan ("?" past it)
CMDLINE_STUCK = 8  # readers left blocked in the kernel at most: past that, an unread command line is "?" at once
_TIMED_OUT: Any = object()
_STUCK_READERS: list[threading.Thread] = []


def _read_bounded(path: str, limit: int, wait: float) -> bytes | None:
    """``_read_bytes(path, limit)`` in a daemon thread of its own, given ``wait`` seconds: ``_TIMED_OUT`` past them
    (the reader is left blocked in the kernel; at most ``CMDLINE_STUCK`` of them, then no new one is started)."""
    _STUCK_READERS[:] = [t for t in _STUCK_READERS if t.is_alive()]  # unblocked since
    if len(_STUCK_READERS) >= CMDLINE_STUCK:
        return _TIMED_OUT  # type: ignore[no-any-return]
    got: list[bytes | None] = []
    reader = threading.Thread(target=lambda: got.append(_read_bytes(path, limit)), name="pvegpu-read", daemon=True)
    try:
        reader.start()
    except RuntimeError:  # no thread can be started (a process limit): not read, as a read that timed out
        return _TIMED_OUT  # type: ignore[no-any-return]
    reader.join(wait)
    if reader.is_alive():
        _STUCK_READERS.append(reader)
        return _TIMED_OUT  # type: ignore[no-any-return]
    return got[0] if got else None


def _read_at(dirfd: int, name: str, limit: int = 1 << 20) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return b""
    chunks: list[bytes] = []
    try:
        while sum(map(len, chunks)) < limit and (chunk := os.read(fd, 65536)):
            chunks.append(chunk)
    except OSError:
        pass
    finally:
        os.close(fd)
    return b"".join(chunks)


SIGTERM_BIT = 1 << (15 - 1)


def term_futile(data: bytes, nspid: list[int]) -> bool:
    """Would SIGTERM from the host be dropped? It is when the process ignores it (``SigIgn``), and when it is
    PID 1 of a PID namespace below the container's (docker in a CT) without a handler (``SigCgt``): the kernel
    delivers only handled signals, SIGKILL and SIGSTOP to a namespace's init; and when a tracer (a debugger) is
    attached (``TracerPid`` not 0): the tracer sees SIGTERM first and may never pass it on. Then SIGKILL need
    not wait ``grace``."""
    masks = {}
    for line in data.split(b"\n"):
        key, _, value = line.partition(b":")
        if key == b"TracerPid" and value.strip() not in (b"", b"0"):
            return True
        if key in (b"SigIgn", b"SigCgt"):
            try:
                masks[key] = int(value.strip(), 16)
            except ValueError:
                return False
    if masks.get(b"SigIgn", 0) & SIGTERM_BIT:
        return True
    return len(nspid) > 2 and nspid[-1] == 1 and b"SigCgt" in masks and not masks[b"SigCgt"] & SIGTERM_BIT


def cgroup_frozen(cgroup_file: bytes | None, cgroup_root: str) -> bool:
    """Is the process's cgroup v2 frozen (``cgroup.freeze`` on it or an ancestor: ``cgroup.events`` says ``frozen 1``)?
    ``cat /proc/<pid>/cgroup`` (the ``0::`` line) then ``grep frozen /sys/fs/cgroup/<path>/cgroup.events``; the
    kernel writes both. Unreadable: False (the holder gets the ordinary SIGTERM, then SIGKILL after the grace)."""
    if not cgroup_file:
        return False
    for line in cgroup_file.split(b"\n"):  # never splitlines(): a cgroup name may hold \r, \v, ...
        if line.startswith(b"0::/"):
            path = os.fsdecode(line[3:])
            if "/../" in path + "/" or "\0" in path:
                return False
            for sub in ("", "unified"):  # cgroup v2, or the unified hierarchy of a hybrid host
                events = _read_bytes(os.path.join(cgroup_root, sub, path.lstrip("/"), "cgroup.events"), 4096)
                if events is not None:
                    return b"\nfrozen 1" in b"\n" + events
            return False
    return False


def parse_status(data: bytes) -> tuple[list[int], int | None, int]:
    """(NSpid, real uid, Threads) from ``/proc/<pid>/status``; the kernel writes these lines, not the tenant.

    The ``Name:`` line is tenant text but the kernel escapes it; lines are still split on ``\\n`` only.
    """
    nspid: list[int] = []
    uid: int | None = None
    threads = 1
    for line in data.split(b"\n"):
        key, _, value = line.partition(b":")
        try:
            if key == b"NSpid":
                nspid = [int(x) for x in value.split()]
            elif key == b"Uid":
                uid = int(value.split()[0])
            elif key == b"Threads":
                threads = int(value)
        except (ValueError, IndexError):
            continue
    return nspid, uid, threads


def status_facts(data: bytes) -> tuple[list[int], int | None, bool]:
    """(NSpid, real uid, term_futile) of one ``/proc/<pid>/status`` text in one pass over its lines: exactly
    ``parse_status(data)[:2]`` and ``term_futile(data, nspid)``, the way ``describe`` needs them."""
    nspid: list[int] = []
    uid: int | None = None
    traced = bad_mask = False
    masks: dict[bytes, int] = {}
    for line in data.split(b"\n"):
        key, _, value = line.partition(b":")
        if key == b"NSpid":
            try:
                nspid = [int(x) for x in value.split()]
            except ValueError:
                pass
        elif key == b"Uid":
            try:
                uid = int(value.split()[0])
            except (ValueError, IndexError):
                pass
        elif key == b"TracerPid":
            if not bad_mask and value.strip() not in (b"", b"0"):
                traced = True
                break  # term_futile stops here: True; later NSpid/Uid lines are still wanted below
        elif key in (b"SigIgn", b"SigCgt") and not bad_mask:
            try:
                masks[key] = int(value.strip(), 16)
            except ValueError:
                bad_mask = True
    if traced:  # the lines after TracerPid may still carry NSpid and Uid (the kernel writes them after it)
        nspid, uid, _threads = parse_status(data)
        return nspid, uid, True
    if bad_mask:
        return nspid, uid, False
    if masks.get(b"SigIgn", 0) & SIGTERM_BIT:
        return nspid, uid, True
    futile = len(nspid) > 2 and nspid[-1] == 1 and b"SigCgt" in masks and not masks[b"SigCgt"] & SIGTERM_BIT
    return nspid, uid, futile


class CgroupBoundary:
    """A PVE container: cgroup ``/lxc/<vmid>/...`` and the PID namespace lxc created for it.

    The init rule (``grep NSpid /proc/<pid>/status``): NSpid lists a process's pid in each PID namespace
    from the host's down to its own. lxc creates the container's namespace directly below the host's, so
    for every container process NSpid[1] is its pid in the container; the container's init is the process
    placed in the container whose NSpid is exactly ``[host pid, 1]``. A namespace the tenant makes
    (docker, podman, ``unshare --pid --fork``) is nested below the container's, so its PID 1 shows
    ``[host pid, ct pid, 1]``: a payload process, signalled like any other. The kernel writes NSpid and
    a tenant can only add levels below its own, so this cannot be forged from inside.
    """

    def __init__(self, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.proc = proc
        self.cgroup_root = cgroup_root

    def place(self, pid: int, st: Stat) -> tuple[Placement, str]:
        return self.place_read(pid)[:2]

    def place_read(self, pid: int) -> tuple[Placement, str, bytes | None]:
        """``place`` and the ``/proc/<pid>/cgroup`` bytes it was decided on (describe's frozen check reads the same)."""
        data = _read_bytes(f"{self.proc}/{pid}/cgroup")
        if data is None:
            return UNKNOWN, "?", None  # unreadable (e.g. too long on older kernels): never "host"
        return (*parse_cgroup(data), data)

    def view(self, pid: int, placement: Placement, nspid: list[int]) -> tuple[int | None, bool]:
        if placement.place is not Place.CONTAINER or len(nspid) <= CT_LEVEL:
            return None, False
        return nspid[CT_LEVEL], len(nspid) == CT_LEVEL + 1 and nspid[CT_LEVEL] == 1

    def init_candidates(self, vmid: int) -> Iterable[int]:
        """The container's members, lowest pid first (its init is started before its payload)."""
        return sorted(set(self.members(vmid)))

    def members(self, vmid: int) -> Iterable[int]:
        """``cat /sys/fs/cgroup/lxc/<vmid>/**/cgroup.procs`` (every hierarchy present)."""
        pids: set[int] = set()
        found_dir = False
        for sub in CGROUP_ROOTS:
            top = os.path.join(self.cgroup_root, sub, "lxc", str(vmid))
            if not os.path.isdir(top):
                continue
            found_dir = True
            for _path, _dirs, _files, dirfd in os.fwalk(top):  # by directory fd: no PATH_MAX, however deep a tenant nests
                pids.update(int(x) for x in _read_at(dirfd, "cgroup.procs").split() if x.isdigit())
        if not found_dir and not self._cgroupfs_mounted():  # no cgroupfs: ask every process (placed, not unknown)
            want = Placement(Place.CONTAINER, vmid)
            for name in os.listdir(self.proc):
                st = read_stat(name, self.proc) if name.isdigit() else None
                if st is not None and self.place(int(name), st)[0] == want:
                    pids.add(int(name))
        return pids

    def _cgroupfs_mounted(self) -> bool:
        """A cgroup v2 root or a v1/hybrid hierarchy is mounted, so a missing lxc/<vmid> dir means an empty CT."""
        return any(os.path.exists(os.path.join(self.cgroup_root, sub, "cgroup.procs")) for sub in CGROUP_ROOTS)


def _given_up(pid: int, scan: ProcessScan, why: str) -> Holding:
    """The holding of a process whose scan was given up (``why``: stuck, or the whole scan's deadline): unknown, with
    whatever its fds had already proved (a deep scan was reading its maps after them), never less."""
    at, proven = scan.proven
    if at == pid and proven:
        return Holding(pid, proven, frozenset({UNREADABLE, why, Via.FD}))
    return Holding(pid, frozenset(), frozenset({UNREADABLE, why}))


_BOTH: Any = object()  # a pid two sides of a split scan described: neither description is handed out
PREFETCH_FRESH = 5.0  # seconds a prefetched whole-node scan may wait for the holdings() call that takes it


class _Early:
    """A prefetched whole-node scan: its split, whether it reads maps after a GPU fd, and when it started."""

    __slots__ = ("split", "deep", "started", "promised")

    def __init__(self, split: scanpool.Split, deep: bool, started: float) -> None:
        self.split, self.deep, self.started = split, deep, started
        self.promised = False  # ``prefetched()`` said the next whole-node reading takes it: it does, fresh or not

    def finish(self) -> dict[int, Holding]:
        return self.split.finish()

    def cancel(self) -> None:
        self.split.cancel()


class ProcHost:
    """The real node: ``/proc`` under an injectable root, a container Boundary, pidfd signals."""

    def __init__(
        self,
        devices: DeviceTable | None = None,
        proc: str = "/proc",
        cgroup_root: str = "/sys/fs/cgroup",
        boundary: Boundary | None = None,
        budget: ScanBudget | None = None,
        stat_of: Callable[[str], tuple[int, int]] = stat_nosync,
        scan: type[ProcessScan] = ProcessScan,
        workers: int | None = None,
        record_dir: str | None = None,
    ) -> None:
        self.record_dir = record_dir  # where the record of NVML-listed pids lasts between runs (None: none kept)
        self.devices = devices or DeviceTable()
        self._stat_of = stat_of  # tests pass a plain os.stat to reproduce a scan that blocks
        self._scan_type = scan  # how one process is scanned (the simulated node passes its own; see sim/host.py)
        self.proc = proc
        self.cgroup_root = cgroup_root
        self.boundary: Boundary = boundary or CgroupBoundary(proc, cgroup_root)
        self.budget = budget or ScanBudget()
        self.self_pid = os.getpid()
        self._stuck: set[tuple[int, int]] = set()  # processes whose scan blocked in the kernel, by identity
        self._cmdlines: dict[tuple[int, int], str] = {}  # identity -> escaped cmdline, read once per run (display only)
        self.workers = workers  # whole-node scans: shares at most (None: one per core; 1: serial), see scanpool
        self._early: _Early | None = None  # a whole-node scan started ahead (``prefetch``)
        # A prefetched scan also describes each holder it finds, beside its holding (``_describing`` while it scans,
        # in its workers too); the reading that takes it leaves them in ``_seen``, and ``describe()`` hands each out
        # once: the description read with the holding, in the scan's watched thread, not again after the scan.
        self._describing: dict[int, ProcInfo] | None = None
        self._seen: dict[int, ProcInfo] = {}
        self._took_prefetch = False  # a reading took a prefetched scan: later readings of listed pids describe too
        self._looked: tuple[set[int], dict[int, ProcInfo]] | None = None  # a second look before the prefetch was taken

    # -- liveness -------------------------------------------------------------------------------
    def _live_state(self, pid: int, st: Stat) -> str:
        """The process's state; a zombie leader whose other threads still run takes a live thread's state."""
        if st.state != "Z" or st.threads <= 1:
            return st.state
        try:
            tids = [t for t in os.listdir(f"{self.proc}/{pid}/task") if t.isdigit() and t != str(pid)]
        except OSError:
            return st.state
        for tid in tids:
            t = read_stat(tid, f"{self.proc}/{pid}/task")
            if t is not None and t.state not in DEAD:
                return t.state
        return st.state

    # -- Host port ------------------------------------------------------------------------------
    def describe(self, pid: int) -> ProcInfo | None:
        """What the process is now: stat, status, cgroup (and cgroup.events) are read at every call; only the
        command line (display text, never decided on) is read once per identity (pid + start time) and run, since
        a reset's polls describe every NVML-listed neighbour again and again. A holder the last prefetched whole-node
        reading found (the audit's) is described as that reading read it, beside its holding, once."""
        if self._seen and (seen := self._seen.pop(pid, None)) is not None:
            return seen
        return self._describe_now(pid)

    def _describe_now(self, pid: int, watched: bool = False) -> ProcInfo | None:
        """``describe`` as the process is now. Its command line is read by the kernel under the process's mm lock,
        which a process can leave held (a thread stuck in a driver's munmap): outside a watched scan thread (``watched``)
        it is read within ``CMDLINE_WAIT``, else shown as ``?`` (display text, never decided on)."""
        raw = read_small(f"{self.proc}/{pid}/stat")  # read_stat's answer, without a file object
        st = parse_stat(raw) if raw is not None else None
        if st is None:
            return None
        status = _read_bytes(f"{self.proc}/{pid}/status") or b""
        nspid, uid, futile = status_facts(status)
        if isinstance(self.boundary, CgroupBoundary):  # one read of /proc/<pid>/cgroup decides placement and frozen
            placement, path, cg = self.boundary.place_read(pid)
        else:
            placement, path = self.boundary.place(pid, st)
            cg = _read_bytes(f"{self.proc}/{pid}/cgroup") if placement.place is Place.CONTAINER else None
        ns_pid, is_init = self.boundary.view(pid, placement, nspid)
        key = (pid, st.start_ticks)
        cmdline = self._cmdlines.get(key)
        if cmdline is None:
            where = f"{self.proc}/{pid}/cmdline"
            got = _read_bytes(where, CMDLINE_READ) if watched else _read_bounded(where, CMDLINE_READ, CMDLINE_WAIT)
            cmd = b"?" if got is _TIMED_OUT else (got or b"").rstrip(b"\0").replace(b"\0", b" ")  # type: ignore[union-attr]
            cmdline = escape(cmd, CMDLINE_SHOWN)
            if cmd:  # an empty one (a zombie, a kernel thread, not yet exec'd) is read again next time
                if len(self._cmdlines) >= CMDLINE_CACHE:
                    self._cmdlines.clear()
                self._cmdlines[key] = cmdline
        return ProcInfo(
            ident=ProcIdentity(pid, st.start_ticks),
            comm=escape(st.comm),
            state=self._live_state(pid, st),
            placement=placement,
            cgroup=escape(path),
            ns_pid=ns_pid,
            is_ct_init=is_init,
            ppid=st.ppid,
            uid=uid,
            cmdline=cmdline,
            term_futile=futile,
            pgid=st.pgid,
            sid=st.sid,
            frozen=placement.place is Place.CONTAINER and cgroup_frozen(cg, self.cgroup_root),
        )

    def all_pids(self) -> list[int]:
        return [int(n) for n in os.listdir(self.proc) if n.isdigit()]

    def ct_pids(self, vmid: int) -> list[int]:
        """Live members of the container. A member (listed by the CT's own cgroupfs) whose placement cannot be
        read is kept, with placement UNKNOWN: it is not known to be elsewhere, so it is never left out (the
        gate refuses a start while one sits there), and ``signal`` still never touches it."""
        want = Placement(Place.CONTAINER, vmid)
        return sorted(p for p in set(self.boundary.members(vmid)) if (i := self.describe(p)) is not None
                      and (i.placement == want or i.placement.place is Place.UNKNOWN) and i.state not in DEAD)

    def ct_init(self, vmid: int) -> int | None:
        """The container's init, read only as far as it takes to find it (the boundary's candidates, each described).
        A candidate whose NSpid cannot be an init's (one ``status`` read) is not described: a container of thousands
        whose init is not among its first members (pids wrapped; a tenant's choice) costs a read each, not a describe."""
        want = Placement(Place.CONTAINER, vmid)
        for p in self.boundary.init_candidates(vmid):
            nspid = status_facts(_read_bytes(f"{self.proc}/{p}/status") or b"")[0]
            if not self.boundary.view(p, want, nspid)[1]:
                continue
            i = self.describe(p)
            if i is not None and i.is_ct_init and i.placement == want and i.state not in DEAD:
                return p
        return None

    def holdings(self, pids: Iterable[int] | None = None, *, deep: bool = False) -> dict[int, Holding]:
        """Holdings per pid; see devscan for the rules (device numbers, budget, threads of a dead leader).

        Nothing a FUSE/NFS server answers is waited for (devscan), and the scan still runs in a worker thread
        watched from here, for whatever else may block in the kernel: such a process is given up after
        ``budget.seconds`` + 0.5 s as unreadable (``stuck``), remembered for the rest of this run, and the scan
        goes on with a new worker. The whole call is bounded by ``budget.total``: the processes not reached by
        then are unreadable (``budget``), never "hold nothing", so many stuck processes cost that bound, never more.
        A whole-node scan (``pids`` None) of many processes is spread over forked workers, one per core, with the
        same rules and the same answer (``scanpool``); a worker that fails has its share scanned here.
        """
        if pids is None:  # a whole-node reading: the last one's descriptions go with it
            self._seen = {}
        if pids is None and self._early is not None:
            early, self._early = self._early, None
            if early.deep == deep and (early.promised or time.monotonic() - early.started <= PREFETCH_FRESH):
                try:  # a process started since the prefetch listed /proc is read too (listed while the workers scan)
                    listed = set(early.split.todo)
                    later = [p for p in self.all_pids() if p not in listed and p != self.self_pid]
                except BaseException:
                    early.cancel()
                    raise
                self._describing, self._took_prefetch = {}, True
                try:
                    got = early.finish()
                    start = 0
                    while start < len(later):  # within the prefetch's own deadline: one scan, one bound
                        start = self._scan_watched(later, start, deep, got, early.split.end)
                    self._seen = {p: i for p, i in self._describing.items() if p in got and i is not _BOTH}
                finally:
                    self._describing = None
                looked, self._looked = self._looked, None
                if looked is not None:  # read again before this reading took the prefetch: those descriptions stand
                    for p in looked[0]:
                        self._seen.pop(p, None)
                    self._seen.update(looked[1])
                return got
            early.cancel()
            self._looked = None  # not taken (stale): its pids are described afresh, as every other holder
        elif pids is not None and (self._took_prefetch or (self._early is not None and self._early.promised)):
            # read again now (``inspect_gpus``' second look at NVML's listed pids, after the reading, while a prefetched
            # scan may still run): described again now too, the holders beside their holdings as the prefetched
            # reading's were; before that reading is taken, kept for it (``_looked``), which then hands them out
            pids = list(pids)
            for p in pids:
                self._seen.pop(p, None)
            self._describing = {}
            try:
                got = self._holdings_of(pids, deep)
                described = {p: i for p, i in self._describing.items() if p in got}
            finally:
                self._describing = None
            if self._took_prefetch:
                self._seen.update(described)
            else:
                self._looked = (set(pids), described)
            return got
        return self._holdings_of(None if pids is None else list(pids), deep)

    def _holdings_of(self, pids: list[int] | None, deep: bool) -> dict[int, Holding]:
        todo = [p for p in (self.all_pids() if pids is None else pids) if p != self.self_pid]
        out: dict[int, Holding] = {}
        end = time.monotonic() + self.budget.total
        if pids is None and self.workers != 1 and len(todo) >= 2 * scanpool.MIN_PER_WORKER:
            n = scanpool.shares(len(todo), self.workers)
            if n > 1 and scanpool.forkable():
                return scanpool.scan(self, todo, deep, end, n)
        start = 0
        while start < len(todo):
            start = self._scan_watched(todo, start, deep, out, end)
        return out

    def prefetched(self, deep: bool) -> bool:
        """The next whole-node ``holdings(deep=deep)`` takes a prefetched scan (started, fresh, of that depth): from
        now on it is promised that reading, so that a second look read before it (``inspect_gpus``) is read while
        the workers scan, and its holdings and descriptions stand over theirs. False: that reading scans afresh."""
        early = self._early
        if early is None or early.deep != deep or time.monotonic() - early.started > PREFETCH_FRESH:
            return False
        early.promised = True
        return True

    def prefetch(self, *, deep: bool = False) -> None:
        """Start the next whole-node ``holdings()`` now, in forked workers (``scanpool.Split``), when it would be
        spread over them anyway: they scan while this process goes on (imports, NVML, configs), and that call
        scans here what they have not reached, merges, and returns the same answer a scan started then would give
        for every process already running now (``inspect_gpus`` looks again at NVML-listed pids it lacks). Taken
        by the next whole-node ``holdings()`` within ``PREFETCH_FRESH`` s (later: discarded, scanned again);
        ``cancel_prefetch()`` when none will come."""
        if self._early is not None or self.workers == 1:
            return
        todo = [p for p in self.all_pids() if p != self.self_pid]
        if len(todo) < 2 * scanpool.MIN_PER_WORKER:
            return
        n = scanpool.shares(len(todo), self.workers)
        if n > 1 and scanpool.forkable():
            started = time.monotonic()
            self._describing = {}  # what the workers are forked with: each describes the holders it finds
            try:
                self._early = _Early(scanpool.Split(self, todo, deep, started + self.budget.total, n - 1), deep, started)
            finally:
                self._describing = None

    def cancel_prefetch(self) -> None:
        """Kill the workers of a ``prefetch()`` no scan took, and reap those of the scans that were taken."""
        early, self._early = self._early, None
        self._seen, self._looked = {}, None
        if early is not None:
            early.cancel()
        scanpool.reap_exited()

    def _scan_watched(self, todo: list[int], start: int, deep: bool, out: dict[int, Holding], end: float,
                      stop: Callable[[int], bool] | None = None) -> int:
        """Scan ``todo[start:]`` into ``out`` until ``end``, or until ``stop(index)`` is true (a split scan's meeting
        point, ``scanpool.Split``); returns where to go on (past a stuck process, where it stopped, or the end). The
        scan runs in a daemon thread; a process whose reading raised (a bug, never a tenant's doing) is unreadable,
        what its fds had proved kept, and the scan goes on past it (``PVEGPU_DEBUG=1``: raised here instead)."""

        found: dict[int, Holding] = {}
        at: list[Any] = [start, time.monotonic(), None, False]  # index, since when, pid, describing its proven holding
        halt = [len(todo)]
        abandoned = [False]  # set by this thread when it gives the scan up; the worker looks before each pid
        raised: list[BaseException] = []  # what the worker's reading raised (a bug), for this thread to judge

        stuck = {p for p, _ticks in self._stuck}  # grows only once this scan's thread is given up (a new one reads it)
        describing = self._describing
        described: dict[int, ProcInfo] = {}

        scan = self._scan_type(self.devices, self.budget, cache={}, stat_of=self._stat_of)

        def work() -> None:
            for j in range(start, len(todo)):
                if abandoned[0]:
                    return
                if stop is not None and stop(j):
                    halt[0] = j
                    break
                pid = todo[j]
                at[:] = [j, time.monotonic(), pid, False]
                if pid in stuck and self._identity(pid) in self._stuck:  # the process that blocked before: not again
                    found[pid] = Holding(pid, frozenset(), frozenset({UNREADABLE, STUCK}))
                    continue
                # kernel threads and leaders whose threads live on are told by their stat, read only for a process with
                # no fd at all (``ProcessScan.run``)
                held = scan.run(self.proc, pid, deep=deep)
                if held is not None:
                    found[pid] = held
                    if describing is not None:  # display facts of a proven holding: a stall here costs its description only
                        at[:] = [j, time.monotonic(), pid, True]
                        if (info := self._describe_now(pid, watched=True)) is not None:
                            described[pid] = info

        def watched() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - judged below, in this thread
                raised.append(exc)

        worker = threading.Thread(target=watched, name="pvegpu-scan", daemon=True)
        worker.start()
        limit = self.budget.seconds + 0.5
        while True:
            worker.join(0.05)
            if not worker.is_alive():
                break
            j, since, _pid, describing_it = at
            if time.monotonic() > end:  # the whole scan's bound: what is not read by now is unknown
                abandoned[0] = True
                rest = set(todo[j + 1 if describing_it else j:])  # in progress (unless only its description) or not reached
                kept = {p: h for p, h in dict(found).items() if p not in rest}
                out.update(kept)
                out.update({p: Holding(p, frozenset(), frozenset({UNREADABLE, BUDGET})) for p in rest})
                if not describing_it:
                    out[todo[j]] = _given_up(todo[j], scan, BUDGET)
                self._keep_described(describing, described, kept)
                return len(todo)
            if time.monotonic() - since > limit and describing_it:  # its holding was proven: kept, described later
                abandoned[0] = True
                kept = dict(found)
                out.update(kept)
                self._keep_described(describing, described, kept)
                return int(j) + 1
            if time.monotonic() - since > limit:
                abandoned[0] = True
                # who it is, read now: a process blocked in the kernel keeps its pid, and its stat needs none of the
                # locks it may hold (the kernel writes stat without the process's mm lock, unlike its maps)
                if (ident := self._identity(todo[j])) is not None:
                    self._stuck.add(ident)
                kept = {p: h for p, h in dict(found).items() if p != todo[j]}
                out.update(kept)
                # what its fds already proved (a deep scan then reads its maps) stays: unknown beyond it, never less
                out[todo[j]] = _given_up(todo[j], scan, STUCK)
                self._keep_described(describing, described, kept)
                return int(j) + 1
        if raised:  # the reading of todo[at[0]] raised: unknown, never "holds nothing", nor a crash
            if os.environ.get("PVEGPU_DEBUG") == "1":
                raise raised[0]
            j, _since, _pid, describing_it = at
            kept = {p: h for p, h in found.items() if describing_it or p != todo[j]}
            out.update(kept)
            if not describing_it:
                out[todo[j]] = _given_up(todo[j], scan, UNREADABLE)
            self._keep_described(describing, described, kept)
            return int(j) + 1
        out.update(found)
        self._keep_described(describing, described, found)
        return halt[0]

    def _described_rows(self) -> list[tuple[object, ...]] | None:
        """A forked worker's descriptions as plain values (``scanpool`` sends them back with its holdings)."""
        if self._describing is None:
            return None
        return [(i.pid, i.ident.start_ticks, i.comm, i.state, i.placement.place.value, i.placement.vmid, i.cgroup, i.ns_pid,
                 i.is_ct_init, i.ppid, i.uid, i.cmdline, i.term_futile, i.pgid, i.sid, i.frozen) for i in self._describing.values()]

    def _add_described(self, rows: list[tuple[object, ...]]) -> None:
        """A worker's descriptions, into this scan's. A pid both sides found holding (where they met) keeps neither:
        it is described again when asked, so a description always goes with the reading that was kept."""
        if self._describing is None:
            return
        for row in rows:
            pid, (ticks, comm, state, place, vmid, cgroup, ns_pid, init, ppid, uid, cmdline, futile, pgid, sid, frozen) = int(row[0]), row[1:]  # type: ignore[call-overload]
            if pid in self._describing:
                self._describing[pid] = _BOTH
                continue
            self._describing[pid] = ProcInfo(ProcIdentity(pid, ticks), comm, state, Placement(Place(place), vmid),  # type: ignore[arg-type]
                                             cgroup, ns_pid, init, ppid, uid, cmdline, futile, pgid, sid, frozen)  # type: ignore[arg-type]

    @staticmethod
    def _keep_described(describing: dict[int, ProcInfo] | None, described: dict[int, ProcInfo],
                        kept: dict[int, Holding]) -> None:
        """The descriptions read beside the holdings ``kept`` (a scan's answer), into the scan's ``describing``."""
        if describing is not None:
            describing.update({p: i for p, i in dict(described).items() if p in kept})

    def _identity(self, pid: int) -> tuple[int, int] | None:
        """(pid, start ticks) of the process now at ``pid``, None when it is gone."""
        st = read_stat(pid, self.proc)
        return (pid, st.start_ticks) if st is not None else None

    def alive(self, ident: ProcIdentity) -> bool:
        st = read_stat(ident.pid, self.proc)
        return st is not None and st.start_ticks == ident.start_ticks and self._live_state(ident.pid, st) not in DEAD

    def boot_ticks(self) -> int | None:
        """CLOCK_BOOTTIME in clock ticks: the clock and unit of stat's start time (the kernel writes a process's
        boot-based start time in USER_HZ ticks). None for a ``/proc`` other than this machine's (a tree a test
        wrote has no clock of its own)."""
        if self.proc != "/proc":
            return None
        return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))

    def seen_pids(self) -> dict[int, SeenPid] | None:
        """The record of NVML-listed pids kept by earlier runs (``pidrecord``), None without one."""
        return pidrecord.read(self.record_dir) if self.record_dir else None

    def keep_seen_pids(self, record: dict[int, SeenPid]) -> None:
        if self.record_dir:
            pidrecord.write(self.record_dir, record)

    def signal(self, ident: ProcIdentity, sig: int, vmid: int) -> SignalResult:
        """Send ``sig`` to ``ident`` through a pidfd: the adapter half of who may be signalled (the core half,
        who is chosen, is ``pvegpu.reset.targets``). With the process pinned, it re-checks its identity (a
        recycled pid is GONE), its placement (outside CT ``vmid``: MOVED) and that it is neither the CT's init
        nor pvegpu (REFUSED)."""
        try:
            pidfd = os.pidfd_open(ident.pid)
        except ProcessLookupError:
            return SignalResult.GONE
        try:
            # The pidfd pins the process; re-check identity now, so a recycled pid is never hit.
            info = self._describe_now(ident.pid)
            if info is None or info.ident != ident or info.state in DEAD:
                return SignalResult.GONE
            if info.placement != Placement(Place.CONTAINER, vmid):
                return SignalResult.MOVED
            if info.is_ct_init or info.pid == self.self_pid:
                return SignalResult.REFUSED
            signal.pidfd_send_signal(pidfd, sig)  # to the whole thread group, even with its leader gone
            return SignalResult.SENT
        except ProcessLookupError:
            return SignalResult.GONE
        finally:
            os.close(pidfd)
