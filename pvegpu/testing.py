"""Public test doubles for pvegpu's ports, as ``structlog.testing`` is for structlog: build a node in memory and
drive ``pvegpu.reset.reset``, ``pvegpu.gate.decide.evaluate`` or ``pvegpu.audit.run.run_audit`` on a fake clock (no real
sleeping, no root, no GPU, no Proxmox).

- ``FakeClock``: the ``Clock`` port (a ``WallClock`` too); ``sleep`` advances ``t`` and calls ``listeners``.
- ``FakeHost`` (with ``FakeProc``): the ``Host`` port. Processes die ``exit_delay`` after a signal, or ignore
  SIGTERM (``on_term="ignore"``), sit in D state, are the container's init, are respawned by their parent
  (``respawn``), lead or join a process group or session (``pgid``, ``sid``); a dead process is gone from
  ``describe`` as from ``/proc``; ``boot_ticks`` is the fake clock in start-time units.
- ``FakeProbe``: the ``GpuProbe`` port on the one driver model every NVML stand-in uses (``pvegpu.sim.driver``):
  the per-context gap in ``used``, memory back some time after the last holder died (the dead owner still
  listed until then), lost GPUs (``fail``), leaks (``leak``), slow reads (``read_secs``).
- ``FakePve``: the ``PveApi`` port: guests with locks and HA, tasks that take fake-clock time and can fail,
  methods that raise (``broken``).
- ``FdBackedProbe``: NVML for a real host without a GPU: each live holder of the stand-in device gets a context.

Contract tests (``tests/test_testing_contract.py``) run the same cases against these fakes and the real adapters
(``ProcHost`` everywhere; NVML on a GPU node, marker ``gpu``), so a fake cannot drift from what it stands for.

    from pvegpu.testing import FakeClock, FakeHost, FakeProbe, FakePve
    clock = FakeClock(); host = FakeHost(clock); probe = FakeProbe(host); pve = FakePve(host)
"""

from __future__ import annotations

import itertools
import signal
from dataclasses import dataclass, field
from typing import Any

from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.tasks import wait_task
from pvegpu.core.errors import PveApiError
from pvegpu.core.model import (
    MIB,
    CtStatus,
    GpuInfo,
    GpuSample,
    Guest,
    Holding,
    Place,
    Placement,
    ProcIdentity,
    ProcInfo,
    SeenPid,
    SignalResult,
    TaskResult,
    Via,
)
from pvegpu.sim.driver import Context, DriverModel


class FakeClock:
    """The Clock port on fake time: starts at 1000.0; ``sleep`` advances it (at least 1 ms) and tells ``listeners``."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.listeners: list[Any] = []

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        """Wall time: the fake time itself (a WallClock, for the audit's ``generated_at``)."""
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.001)
        for fn in self.listeners:
            fn(self.t)


@dataclass
class FakeProc:
    pid: int
    vmid: int | None  # None: a host process
    minors: set[int] = field(default_factory=set)
    comm: str = "python3"
    on_term: str = "exit"  # exit | ignore
    state: str = "S"  # D: uninterruptible, never dies
    exit_delay: float = 0.1  # seconds from signal to death
    init: bool = False
    term_futile: bool = False  # what /proc/<pid>/status says: SIGTERM ignored, or a nested namespace's init without a handler
    maps: bool = True  # maps the device (a CUDA context owner); False: an NVML client with an fd only
    respawn: dict[str, Any] | None = None  # its parent restarts a copy on death: FakeProc fields, plus
    # "times" (how many copies, default: forever) and "delay" (seconds from death to the copy)
    respawned: bool = False  # a copy started by its parent: gets a fresh CUDA context
    start: int = 0
    dies_at: float | None = None
    ppid: int | None = None  # default: the container's init (the host's pid 1 for host processes)
    pgid: int | None = None  # process group id (stat field 5): a fork child keeps its group leader's pid
    sid: int | None = None  # session id (stat field 6)


class FakeHost:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.procs: dict[int, FakeProc] = {}
        self.pids = itertools.count(5000)
        self.last_pid = 4999  # the latest pid handed out (``boot_ticks``)
        self.self_pid = 1
        self.signals: list[tuple[int, str]] = []
        self.pending: list[tuple[float, FakeProc]] = []  # (when, dead original): copies a parent will start
        self.seen: dict[int, SeenPid] | None = None  # the record of listed pids kept between runs (None: none yet)
        clock.listeners.append(self._tick)

    def add(self, vmid: int | None, **kw: Any) -> FakeProc:
        p = FakeProc(next(self.pids), vmid, **kw)
        self.last_pid = p.pid
        p.start = int(self.clock.t * 100) + p.pid
        if p.ppid is None:
            p.ppid = next((q.pid for q in self.procs.values() if q.init and q.vmid == vmid), 1) if vmid and not p.init else 1
        self.procs[p.pid] = p
        return p

    def _tick(self, t: float) -> None:
        for p in list(self.procs.values()):
            if p.dies_at is not None and t >= p.dies_at:
                del self.procs[p.pid]
                if p.respawn is not None:
                    self.pending.append((t + p.respawn.get("delay", 0.0), p))
        for when, p in list(self.pending):
            if t >= when:
                self.pending.remove((when, p))
                self._respawn(p)

    def _respawn(self, p: FakeProc) -> None:
        """The parent (if still alive) starts a copy of ``p``."""
        assert p.respawn is not None
        if p.ppid not in self.procs:
            return
        kw = {k: v for k, v in p.respawn.items() if k not in ("times", "delay")}
        times = p.respawn.get("times")
        again = p.respawn if times is None else ({**p.respawn, "times": times - 1} if times > 1 else None)
        self.add(p.vmid, minors=set(p.minors), respawn=again, ppid=p.ppid, respawned=True, **kw)

    def kill_ct(self, vmid: int) -> None:
        for p in [p for p in self.procs.values() if p.vmid == vmid]:
            del self.procs[p.pid]

    def describe(self, pid: int) -> ProcInfo | None:
        p = self.procs.get(pid)
        if p is None:
            return None
        place = Placement(Place.CONTAINER, p.vmid) if p.vmid else Placement(Place.HOST)
        return ProcInfo(ProcIdentity(pid, p.start), p.comm, p.state, place, f"/lxc/{p.vmid}/ns" if p.vmid else "/",
                        1 if p.init else pid - 4000, p.init, ppid=p.ppid, term_futile=p.term_futile, pgid=p.pgid, sid=p.sid)

    def ct_pids(self, vmid: int) -> list[int]:
        return sorted(p.pid for p in self.procs.values() if p.vmid == vmid)

    def ct_init(self, vmid: int) -> int | None:
        return next((p.pid for p in sorted(self.procs.values(), key=lambda p: p.pid) if p.vmid == vmid and p.init), None)

    def holdings(self, pids: Any = None, *, deep: bool = False) -> dict[int, Holding]:
        return {p.pid: Holding(p.pid, frozenset(p.minors), frozenset({Via.FD, Via.MAPS} if p.maps and deep else {"fd"}))
                for p in self.procs.values() if p.minors and (pids is None or p.pid in pids)}

    def alive(self, ident: ProcIdentity) -> bool:
        p = self.procs.get(ident.pid)
        return p is not None and p.start == ident.start_ticks

    def boot_ticks(self) -> int:
        """The fake clock in start-time units: every process added so far started at or before it, any added later
        after it (a start time is the fake time in 1/100 s plus the pid)."""
        return int(self.clock.t * 100) + self.last_pid

    def seen_pids(self) -> dict[int, SeenPid] | None:
        return None if self.seen is None else dict(self.seen)

    def keep_seen_pids(self, record: dict[int, SeenPid]) -> None:
        self.seen = dict(record)

    def signal(self, ident: ProcIdentity, sig: int, vmid: int) -> SignalResult:
        p = self.procs.get(ident.pid)
        if p is None or p.start != ident.start_ticks:
            return SignalResult.GONE
        if p.vmid != vmid:
            return SignalResult.MOVED
        if p.init:
            return SignalResult.REFUSED
        self.signals.append((p.pid, signal.Signals(sig).name))
        if p.state != "D" and (sig == signal.SIGKILL or p.on_term == "exit"):
            p.dies_at = min(p.dies_at or 1e18, self.clock.t + p.exit_delay)
        return SignalResult.SENT


class FakeProbe:
    """NVML on the one driver model (``pvegpu.sim.driver``): per-context gap, release latency, dead owners
    listed, lost GPUs; holders are FakeHost processes, time is the fake clock."""

    def __init__(self, host: FakeHost, minors: tuple[int, ...] = (0,)) -> None:
        self.host = host
        self.minors = minors
        self.model = DriverModel(host.clock, self._alive, minors)
        self.model.names = {m: GpuInfo(i, m, f"GPU-fake-{m}", f"0000:0{m}:00.0") for i, m in enumerate(minors)}
        self.leak = self.model.leak
        self.fail: set[int] = set()
        self.read_secs = 0.0  # each sample() takes this long (fake clock): the state is the one at its start

    def _alive(self, ident: tuple[int, int]) -> bool:
        p = self.host.procs.get(ident[0])
        return p is not None and p.start == ident[1]

    @staticmethod
    def _ident(p: FakeProc) -> tuple[int, int]:
        return (p.pid, p.start)

    def context(self, gpu: int, mib: int, owner: FakeProc, *others: FakeProc, pinned: bool = False, leaks: bool = False) -> Context:
        return self.model.open_context(gpu, mib * MIB, self._ident(owner), *(self._ident(o) for o in others), pinned=pinned, leaks=leaks)

    @property
    def contexts(self) -> list[Context]:
        return self.model.contexts

    @property
    def failed(self) -> list[str]:
        return self.model.failed

    def gpus(self) -> list[GpuInfo]:
        return self.model.gpus()

    def sample(self, minors: Any) -> dict[int, GpuSample]:
        for p in self.host.procs.values():  # a respawned holder gets a fresh context
            if p.respawned and not any(self._ident(p) in c.holders for c in self.model.contexts):
                self.model.open_context(min(p.minors), 1024 * MIB, self._ident(p))
        self.model.fail = {m: "GPU is lost" for m in self.fail}
        out = self.model.sample(minors)
        if self.read_secs:
            self.host.clock.sleep(self.read_secs)
        return out


class FakePve:
    """Guests with locks and HA, and tasks that take fake-clock time. Knobs per CT (``status[vmid]``):
    ``stop_secs``/``start_secs`` (task duration; the CT changes state when the task ends), ``stop_error``/
    ``start_error`` (the task ends with that exitstatus, the CT unchanged), ``ha`` (the task only requests
    the state; HA acts ``ha_delay`` seconds later), ``lock``. ``broken[name]``: that many calls of method
    ``name`` raise PveApiError (-1: every call), e.g. ``broken["task_status"] = -1``."""

    def __init__(self, host: FakeHost, node: str = "pve1") -> None:
        self.host = host
        self.clock = host.clock
        self.node = node
        self.guests_: dict[int, Guest] = {}
        self.configs: dict[int, str] = {}
        self.status: dict[int, dict[str, Any]] = {}
        self.tasks: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.broken: dict[str, int] = {}
        self.later: list[tuple[float, Any]] = []  # (when, effect): HA acting, tasks ending
        self.stopped_at: dict[int, float] = {}  # vmid -> fake time the CT last stopped
        self.clock.listeners.append(self._tick)

    def _tick(self, t: float) -> None:
        due = [(at, fn) for at, fn in self.later if at <= t]
        self.later = [(at, fn) for at, fn in self.later if at > t]
        for _, fn in sorted(due, key=lambda e: e[0]):
            fn()

    def _at(self, delay: float, fn: Any) -> None:
        if delay <= 0:
            fn()
        else:
            self.later.append((self.clock.t + delay, fn))

    def _check(self, name: str) -> None:
        n = self.broken.get(name, 0)
        if n:
            self.broken[name] = n - 1 if n > 0 else n
            raise PveApiError(f"{name}: 500 fake failure", "fake hint")

    def add_ct(self, vmid: int, minors: tuple[int, ...] = (0,), node: str | None = None, **status: Any) -> None:
        self.guests_[vmid] = Guest(vmid, node or self.node, "lxc")
        self.configs[vmid] = "".join(f"dev{i}: /dev/nvidia{m},gid=44\n" for i, m in enumerate(minors))
        self.status[vmid] = {"status": "running"} | status

    def local_node(self) -> str:
        return self.node

    def where(self, vmid: int) -> Guest | None:
        return self.guests_.get(vmid)

    def guests(self) -> list[Guest]:
        return list(self.guests_.values())

    def ct_config(self, g: Guest) -> str:
        return self.configs[g.vmid]

    def ct_status(self, g: Guest) -> CtStatus:
        self._check("ct_status")
        s = self.status[g.vmid]
        return CtStatus(s["status"], bool(s.get("ha")), s.get("lock"))

    def _task(self, kind: str, g: Guest, secs: float, exitstatus: str, effect: Any) -> str:
        upid = f"UPID:{self.node}:0000{len(self.tasks):04X}:00000001:00000001:{kind}:{g.vmid}:root@pam:"
        task: dict[str, Any] = {"status": "running", "exitstatus": None, "log": [f"{kind} {g.vmid}"]}
        self.tasks[upid] = task

        def end() -> None:
            task.update(status="stopped", exitstatus=exitstatus)
            task["log"].append("TASK OK" if exitstatus == "OK" else f"TASK ERROR: {exitstatus}")
            if exitstatus == "OK":
                effect()

        self._at(secs, end)
        return upid

    def _stop_now(self, vmid: int) -> None:
        self.host.kill_ct(vmid)
        self.status[vmid]["status"] = "stopped"
        self.stopped_at[vmid] = self.clock.t

    def _start_now(self, vmid: int) -> None:
        self.status[vmid]["status"] = "running"
        self.host.add(vmid, init=True, comm="init")

    def ct_stop(self, g: Guest) -> str:
        self.calls.append(f"stop {g.vmid}")
        self._check("ct_stop")
        s = self.status[g.vmid]
        if s.get("ha"):  # the task only asks HA; HA acts later
            return self._task("hastop", g, 0, "OK", lambda: self._at(s.get("ha_delay", 0), lambda: self._stop_now(g.vmid)))
        return self._task("vzstop", g, s.get("stop_secs", 0), s.get("stop_error") or "OK", lambda: self._stop_now(g.vmid))

    def ct_start(self, g: Guest) -> str:
        self.calls.append(f"start {g.vmid}")
        self._check("ct_start")
        s = self.status[g.vmid]
        if s.get("ha") and not s.get("start_error"):
            return self._task("hastart", g, 0, "OK", lambda: self._at(s.get("ha_delay", 0), lambda: self._start_now(g.vmid)))
        return self._task("vzstart", g, s.get("start_secs", 0), s.get("start_error") or "OK", lambda: self._start_now(g.vmid))

    def task_status(self, node: str, upid: str) -> dict[str, Any]:
        self._check("task_status")
        return dict(self.tasks[upid])

    def task_log(self, node: str, upid: str, limit: int = 50) -> list[str]:
        self._check("task_log")
        return list(self.tasks[upid]["log"])

    def wait_task(self, node: str, upid: str, *, timeout: float, what: str, progress: Any = None) -> TaskResult:
        return wait_task(lambda: self.task_status(node, upid), lambda: self.task_log(node, upid), self.clock,
                         node=node, upid=upid, timeout=timeout, what=what, progress=progress)


class FdBackedProbe:
    """NVML stand-in for hosts without a GPU, on the one driver model: each live process found holding the
    stand-in device opens a "context" of ``mib_per_holder`` MiB, listed by its host pid as NVML lists CUDA
    processes, with the model's per-context gap and release latency (real time)."""

    def __init__(self, host: Any, mib_per_holder: int = 512, clock: Any = None) -> None:
        self.host = host
        self.mib = mib_per_holder
        self.model = DriverModel(clock or SystemClock(), self._alive, (0,))
        self.model.names = {0: GpuInfo(0, 0, "GPU-standin-0", "0000:00:00.0")}

    def _alive(self, ident: tuple[int, int]) -> bool:
        i = self.host.describe(ident[0])
        return i is not None and i.state not in ("Z", "X") and i.ident.start_ticks == ident[1]

    def gpus(self) -> list[GpuInfo]:
        return self.model.gpus()

    def sample(self, minors: Any) -> dict[int, GpuSample]:
        known = {h for c in self.model.contexts for h in c.holders}
        for h in self.host.holdings(None).values():
            i = self.host.describe(h.pid)
            if i is None or i.state in ("Z", "X") or (h.pid, i.ident.start_ticks) in known:
                continue
            for m in h.minors:
                if m >= 0:
                    self.model.open_context(m, self.mib * MIB, (h.pid, i.ident.start_ticks))
        return self.model.sample(minors)
