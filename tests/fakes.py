"""Stateful in-memory fakes for the reset state machine, driven by a fake clock (no real sleeping).

FakeHost: processes that die some ticks after a signal (or ignore SIGTERM, or sit in D state, or get
respawned by their container's init). FakeProbe: CUDA contexts that live while any holder lives, the
owner's pid listed even after it died. FakePve: guests, locks, HA, tasks that can fail.
"""

from __future__ import annotations

import itertools
import signal
from dataclasses import dataclass, field
from typing import Any

from pvegpu.model import MIB, CtStatus, GpuInfo, GpuSample, Guest, Holding, NvmlProcess, Place, Placement, ProcIdentity, ProcInfo


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.listeners: list[Any] = []

    def monotonic(self) -> float:
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
    respawn: dict[str, Any] | None = None  # init restarts a copy of it on death
    start: int = 0
    dies_at: float | None = None


class FakeHost:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.procs: dict[int, FakeProc] = {}
        self.pids = itertools.count(5000)
        self.self_pid = 1
        self.signals: list[tuple[int, str]] = []
        clock.listeners.append(self._tick)

    def add(self, vmid: int | None, **kw: Any) -> FakeProc:
        p = FakeProc(next(self.pids), vmid, **kw)
        p.start = int(self.clock.t * 100) + p.pid
        self.procs[p.pid] = p
        return p

    def _tick(self, t: float) -> None:
        for p in list(self.procs.values()):
            if p.dies_at is not None and t >= p.dies_at:
                del self.procs[p.pid]
                if p.respawn is not None and any(q.init and q.vmid == p.vmid for q in self.procs.values()):
                    self.add(p.vmid, minors=set(p.minors), respawn=p.respawn, **p.respawn)

    def kill_ct(self, vmid: int) -> None:
        for p in [p for p in self.procs.values() if p.vmid == vmid]:
            del self.procs[p.pid]

    def describe(self, pid: int) -> ProcInfo | None:
        p = self.procs.get(pid)
        if p is None:
            return None
        place = Placement(Place.CONTAINER, p.vmid) if p.vmid else Placement(Place.HOST)
        return ProcInfo(ProcIdentity(pid, p.start), p.comm, p.state, place, f"/lxc/{p.vmid}/ns" if p.vmid else "/",
                        1 if p.init else pid - 4000, p.init)

    def ct_pids(self, vmid: int) -> list[int]:
        return sorted(p.pid for p in self.procs.values() if p.vmid == vmid)

    def holdings(self, pids: Any = None) -> dict[int, Holding]:
        return {p.pid: Holding(p.pid, frozenset(p.minors), frozenset({"fd"})) for p in self.procs.values()
                if p.minors and (pids is None or p.pid in pids)}

    def alive(self, ident: ProcIdentity) -> bool:
        p = self.procs.get(ident.pid)
        return p is not None and p.start == ident.start_ticks

    def signal(self, ident: ProcIdentity, sig: int, vmid: int) -> str:
        p = self.procs.get(ident.pid)
        if p is None or p.start != ident.start_ticks:
            return "gone"
        if p.vmid != vmid:
            return "moved"
        if p.init:
            return "refused"
        self.signals.append((p.pid, signal.Signals(sig).name))
        if p.state != "D" and (sig == signal.SIGKILL or p.on_term == "exit"):
            p.dies_at = min(p.dies_at or 1e18, self.clock.t + p.exit_delay)
        return "sent"


class FakeProbe:
    def __init__(self, host: FakeHost, minors: tuple[int, ...] = (0,)) -> None:
        self.host = host
        self.minors = minors
        self.contexts: list[dict[str, Any]] = []  # {gpu, bytes, owner, holders: set}
        self.leak: dict[int, int] = {}
        self.fail: set[int] = set()

    def context(self, gpu: int, mib: int, owner: FakeProc, *others: FakeProc) -> None:
        self.contexts.append({"gpu": gpu, "bytes": mib * MIB, "owner": owner.pid, "holders": {owner.pid, *(o.pid for o in others)}})

    def gpus(self) -> list[GpuInfo]:
        return [GpuInfo(i, m, f"GPU-fake-{m}", f"0000:0{m}:00.0") for i, m in enumerate(self.minors)]

    def sample(self, minors: Any) -> dict[int, GpuSample]:
        self.contexts = [c for c in self.contexts if c["holders"] & set(self.host.procs)]
        # a respawned holder gets a fresh context
        for p in self.host.procs.values():
            if p.respawn and not any(p.pid in c["holders"] for c in self.contexts):
                self.contexts.append({"gpu": min(p.minors), "bytes": 1024 * MIB,
                                      "owner": p.pid, "holders": {p.pid}})
        out = {}
        for m in minors:
            if m in self.fail:
                out[m] = GpuSample(m, None, None, "NVML: GPU is lost")
                continue
            cs = [c for c in self.contexts if c["gpu"] == m]
            out[m] = GpuSample(m, sum(c["bytes"] for c in cs) + self.leak.get(m, 0),
                               tuple(NvmlProcess(c["owner"], c["bytes"]) for c in cs))
        return out


class FakePve:
    def __init__(self, host: FakeHost, node: str = "pve1") -> None:
        self.host = host
        self.node = node
        self.guests_: dict[int, Guest] = {}
        self.configs: dict[int, str] = {}
        self.status: dict[int, dict[str, Any]] = {}
        self.tasks: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []

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
        s = self.status[g.vmid]
        return CtStatus(s["status"], bool(s.get("ha")), s.get("lock"))

    def _task(self, kind: str, exitstatus: str, g: Guest) -> str:
        upid = f"UPID:{self.node}:0000{len(self.tasks):04X}:00000001:00000001:{kind}:{g.vmid}:root@pam:"
        self.tasks[upid] = {"status": "stopped", "exitstatus": exitstatus, "log": [exitstatus]}
        return upid

    def ct_stop(self, g: Guest) -> str:
        self.calls.append(f"stop {g.vmid}")
        self.host.kill_ct(g.vmid)
        self.status[g.vmid]["status"] = "stopped"
        return self._task("vzstop", "OK", g)

    def ct_start(self, g: Guest) -> str:
        self.calls.append(f"start {g.vmid}")
        err = self.status[g.vmid].get("start_error")
        if not err:
            self.status[g.vmid]["status"] = "running"
            self.host.add(g.vmid, init=True, comm="init")
        return self._task("vzstart", err or "OK", g)

    def task_status(self, node: str, upid: str) -> dict[str, Any]:
        return self.tasks[upid]

    def task_log(self, node: str, upid: str, limit: int = 50) -> list[str]:
        return self.tasks[upid]["log"]


class FdBackedProbe:
    """NVML stand-in for hosts without a GPU: each live process holding the stand-in device open has a
    "context" of ``mib_per_holder`` MiB, listed by its host pid as NVML lists CUDA processes; the memory
    returns when the holder is gone, as the driver frees it at fd close."""

    def __init__(self, host: Any, mib_per_holder: int = 512) -> None:
        self.host = host
        self.mib = mib_per_holder

    def gpus(self) -> list[GpuInfo]:
        return [GpuInfo(0, 0, "GPU-standin-0", "0000:00:00.0")]

    def sample(self, minors: Any) -> dict[int, GpuSample]:
        held = self.host.holdings(None)
        live = [h for h in held.values() if (i := self.host.describe(h.pid)) is not None and i.state not in ("Z", "X")]
        return {m: GpuSample(m, sum(self.mib * MIB for h in live if m in h.minors),
                             tuple(NvmlProcess(h.pid, self.mib * MIB) for h in live if m in h.minors)) for m in minors}
