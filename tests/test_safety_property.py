"""The safety rule of ``pvegpu reset``, property-tested on real processes, cgroups and PID namespaces.

Generated nodes: several PVE-like containers (an lxc-start-like monitor in lxc.monitor/<vmid>, a new PID
namespace whose PID 1 is the container's init in /lxc/<vmid>/ns, payload forked under it) and host processes;
holders of a private stand-in GPU and non-holders, children (fork-inherited holders), re-parented orphans,
nested cgroups under ns/, processes that ignore SIGTERM, processes exiting while reset scans, nested PID
namespaces (a shim's ``unshare --pid --fork``: their PID 1 is a payload process, not the container's init), and
a pid recycled between scan and signal. Reset of one target container runs with the real ProcHost; the rule:

* a signal reaches only a payload holder of the target: never its init, its monitor, another container,
  the host, pvegpu itself (the test process holds the stand-in device too) or a recycled pid;
* every holder of the target is stopped, or named in the diagnosis; only the container's own init may be
  left, and only a restart stops it.

The stand-in GPU is a pseudo-terminal this module opens (not /dev/full, which other tests hold), with a high
index; the DeviceTable maps only its device number, and every assertion is about this test's own processes.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from pvegpu import wiring
from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.procfs import DeviceTable, ProcHost
from pvegpu.core.model import CtStatus, Guest, Holding, Place, Placement, ProcIdentity, ProcInfo, SignalResult
from pvegpu.core.settings import Settings
from pvegpu.reset import Ports, ResetReport, reset
from tests import pvelike
from tests.fakes import FdBackedProbe

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, PID namespaces, pidfd signals)")]

# the shipped defaults (wiring.reset_policy), with short waits and no restart: the rule is about signals
POLICY = replace(wiring.reset_policy(Settings()), restart=False, grace=0.3, kill_wait=3.0, timeout=1.5, poll=0.02, settle=0.1, task_timeout=5.0)
# Both properties together stay well under a minute on two busy cores (about 1 s an example).
# Reproducible in CI: derandomized, no example database; no shrinking (each example is real processes;
# the falsifying example is printed as generated).
PROFILE = dict(deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=False)
SUBCGROUPS = ["system.slice/app.service", "user.slice/user-0.slice/session-1.scope"]


# -- the generated world -------------------------------------------------------------------------------------


def _nodes(depth: int, nested: bool, in_ct: bool) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        "hold": st.sampled_from([True, True, False]),
        "ignore_term": st.booleans(),
        "exit_after": st.sampled_from([None, None, None, 0.0, 0.03, 0.15]),  # seconds after reset starts
        "orphan": st.sampled_from([False, False, True]),
        "nested_ns": st.sampled_from([False, False, True]) if nested else st.just(False),
        "cgroup": st.sampled_from([None, None, *SUBCGROUPS]) if in_ct else st.just(None),
        "children": st.lists(_nodes(depth - 1, nested, in_ct), max_size=2) if depth > 0 else st.just([]),
    }).map(_normalise)


def _normalise(node: dict[str, Any]) -> dict[str, Any]:
    if node["nested_ns"]:  # a namespace's PID 1 lives as long as the test needs its members
        node = node | {"orphan": False, "exit_after": None}
    return node


@st.composite
def worlds(draw: st.DrawFn, nested: bool = False) -> dict[str, Any]:
    """Containers (the first is the target) and host processes; ``nested`` adds nested PID namespaces and puts
    a holder that is PID 1 of one into the target."""
    rarely = st.sampled_from([False, False, False, True])  # an init holding costs reset's whole timeout
    cts = [{"init_holds": draw(rarely), "monitor_holds": draw(st.booleans()),
            "procs": draw(st.lists(_nodes(2, nested, True), min_size=int(i == 0), max_size=3))} for i in range(draw(st.integers(1, 3)))]
    if nested:
        cts[0]["procs"].insert(0, draw(_nodes(1, True, True)) | {"hold": True, "nested_ns": True, "orphan": False, "exit_after": None})
    host = draw(st.lists(_nodes(1, nested, False), min_size=1, max_size=2))
    recycle = draw(st.sampled_from([None, "target", "host"] + (["other"] if len(cts) > 1 else [])))
    return {"cts": cts, "host": host, "recycle": recycle}


def _leaf(**kw: Any) -> dict[str, Any]:
    return {"hold": False, "ignore_term": False, "exit_after": None, "orphan": False, "nested_ns": False, "cgroup": None, "children": []} | kw


# Every dimension at once, always run first: a fork-inherited holder child, a SIGTERM-ignoring holder in a
# nested cgroup, a re-parented orphan holder, a holder exiting mid-scan, a non-holder; a neighbour whose init,
# monitor and payload hold the device; a host holder; the target's monitor holding it; a recycled pid.
RICH = {
    "cts": [
        {"init_holds": False, "monitor_holds": True, "procs": [
            _leaf(hold=True, children=[_leaf(hold=True), _leaf(hold=False)]),
            _leaf(hold=True, ignore_term=True, cgroup=SUBCGROUPS[0], children=[_leaf(hold=True, orphan=True)]),
            _leaf(hold=True, exit_after=0.03),
            _leaf()]},
        {"init_holds": True, "monitor_holds": True, "procs": [_leaf(hold=True, children=[_leaf(hold=True, orphan=True)])]},
    ],
    "host": [_leaf(hold=True, children=[_leaf(hold=True)])],
    "recycle": "target",
}
# The target's init holds the device: it is never signalled, the verdict is "not clean" and names it.
INIT_HOLDS = {"cts": [{"init_holds": True, "monitor_holds": False, "procs": [_leaf(hold=True)]}], "host": [], "recycle": None}
# issue 7 item 1: docker/podman in a CT: the workload is PID 1 of a nested PID namespace, its worker a child there.
NESTED = {"cts": [{"init_holds": False, "monitor_holds": False, "procs": [_leaf(hold=True, nested_ns=True, children=[_leaf(hold=True)])]}],
          "host": [], "recycle": None}


# -- what the test knows about each of its processes (ground truth, not pvegpu's reading) ----------------------


@dataclass
class Proc:
    id: str
    where: str  # target | other | host
    role: str  # payload | init | monitor | shim | launcher
    hold: bool = False
    transient: bool = False  # exits by itself once reset has started
    nested: bool = False  # inside a nested PID namespace of its container (or its PID 1)
    nested_init: bool = False  # PID 1 of a nested PID namespace
    pid: int = 0
    start: int = 0
    nspid: list[int] = field(default_factory=list)

    @property
    def ident(self) -> ProcIdentity:
        return ProcIdentity(self.pid, self.start)

    def __str__(self) -> str:
        tag = " [NESTED PID NAMESPACE: issue 7 item 1]" if self.nested else ""
        kind = "PID 1 of a nested PID namespace" if self.nested_init else self.role
        return f"{self.id} (pid {self.pid}, NSpid {self.nspid}, {kind}, {'holder' if self.hold else 'non-holder'} in {self.where}){tag}"


def _assign(world: dict[str, Any], vmids: list[int]) -> tuple[dict[str, Any], list[Proc]]:
    """The launcher spec with ids, and the truth table of every process it will report."""
    procs = [Proc("L", "host", "launcher")]
    recycled = _leaf() | {"id": "rc"}

    def walk(nodes: list[dict[str, Any]], prefix: str, where: str, nested: bool) -> list[dict[str, Any]]:
        out = []
        for k, n in enumerate(nodes):
            nid = f"{prefix}{k}"
            inner = nested or n["nested_ns"]
            if n["nested_ns"]:
                procs.append(Proc(nid + ".shim", where, "shim", nested=nested))
            procs.append(Proc(nid, where, "payload", n["hold"], n["exit_after"] is not None, inner, n["nested_ns"]))
            out.append(n | {"id": nid, "children": walk(n["children"], nid + ".", where, inner)})
        return out

    cts = []
    for ci, (ct, vmid) in enumerate(zip(world["cts"], vmids)):
        where = "target" if ci == 0 else "other"
        procs += [Proc(f"c{ci}m", where, "monitor", ct["monitor_holds"]), Proc(f"c{ci}i", where, "init", ct["init_holds"])]
        payload = walk(ct["procs"], f"c{ci}n", where, False)
        if world["recycle"] == where and (where == "target" or ci == 1):
            payload.append(recycled)
            procs.append(Proc("rc", where, "payload"))
        cts.append({"vmid": vmid, "init": f"c{ci}i", "monitor": f"c{ci}m", "init_holds": ct["init_holds"],
                    "monitor_holds": ct["monitor_holds"], "procs": payload})
    host = walk(world["host"], "h", "host", False)
    if world["recycle"] == "host":
        host.append(recycled)
        procs.append(Proc("rc", "host", "payload"))
    return {"cts": cts, "host": host, "launcher": "L"}, procs


def _subcgroups(nodes: Iterable[dict[str, Any]]) -> set[str]:
    out: set[str] = set()
    for n in nodes:
        if n["cgroup"]:
            out.add(n["cgroup"])
        out |= _subcgroups(n["children"])
    return out


@dataclass
class Lab:
    vmids: list[int]
    procs: list[Proc]
    go: str

    @property
    def target(self) -> int:
        return self.vmids[0]

    def by_ident(self) -> dict[ProcIdentity, Proc]:
        return {p.ident: p for p in self.procs}

    def get(self, pid_id: str) -> Proc | None:
        return next((p for p in self.procs if p.id == pid_id), None)


@contextmanager
def built(world: dict[str, Any], dev: str) -> Iterator[Lab]:
    """The world's processes in place, with fresh vmids; every cgroup and process removed on the way out."""
    vmids: list[int] = []
    while len(vmids) < len(world["cts"]):  # not `random`: hypothesis seeds it, and concurrent runs must not clash
        v = 900_000_000 + secrets.randbelow(100_000_000)
        if v not in vmids and not any(os.path.exists(d) for d in (os.path.dirname(pvelike.cgroup_dir(v)), pvelike.monitor_dir(v))):
            vmids.append(v)
    work = tempfile.mkdtemp(prefix="pvegpu-safety-")
    host_cg = os.path.join(pvelike.cgroup_base(), f"pvegpu-safety-{os.path.basename(work)}")
    tops = [host_cg] + [d for v in vmids for d in (os.path.dirname(pvelike.cgroup_dir(v)), pvelike.monitor_dir(v))]
    launcher = None
    try:
        spec, procs = _assign(world, vmids)
        os.makedirs(host_cg)
        for ct in spec["cts"]:
            os.makedirs(pvelike.monitor_dir(ct["vmid"]))
            for sub in {""} | _subcgroups(ct["procs"]):
                os.makedirs(os.path.join(pvelike.cgroup_dir(ct["vmid"]), sub), exist_ok=True)
        ready = os.path.join(work, "ready")
        os.mkdir(ready)
        spec |= {"dev": dev, "ready": ready, "go": os.path.join(work, "go"), "host_cgroup": host_cg}
        launcher = pvelike.grow_world(spec, work)
        try:
            reports = pvelike.wait_ready(ready, {p.id for p in procs}, launcher)
        except AssertionError as exc:
            with open(os.path.join(work, "agent.log")) as f:
                raise AssertionError(f"{exc}\n{f.read()[-3000:]}") from None
        for p in procs:
            r = reports[p.id]
            p.pid, p.start, p.nspid = r["pid"], r["start"], r["nspid"]
        yield Lab(vmids, procs, spec["go"])
    finally:
        left = [t for t in tops if not pvelike.kill_cgroup(t)]
        if launcher is not None:
            launcher.kill()
            launcher.wait(10)
        shutil.rmtree(work, ignore_errors=True)
        if left and sys.exc_info()[0] is None:  # never hide the failure that got us here
            raise AssertionError(f"cgroups left behind: {left}")


# -- the Host port as reset sees it ----------------------------------------------------------------------------


class Recycled:
    """A Host where pid ``victim.pid`` was a holder of the target when reset scanned, and was then reused:
    describe() keeps giving the scan-time identity (an earlier start time) until reset tries to signal it,
    while the real process at that pid is the new one. Everything else is the real adapter's."""

    def __init__(self, real: ProcHost, victim: Proc, target: int) -> None:
        self.real, self.self_pid, self.target = real, real.self_pid, target
        self.stale = ProcIdentity(victim.pid, victim.start - 1)
        self.active = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def describe(self, pid: int) -> ProcInfo | None:
        info = self.real.describe(pid)
        if not self.active or pid != self.stale.pid or info is None:
            return info
        return replace(info, ident=self.stale, placement=Placement(Place.CONTAINER, self.target), cgroup=f"/lxc/{self.target}/ns",
                       is_ct_init=False)

    def ct_pids(self, vmid: int) -> list[int]:
        pids = self.real.ct_pids(vmid)
        return sorted({*pids, self.stale.pid}) if self.active and vmid == self.target else pids

    def ct_init(self, vmid: int) -> int | None:
        return self.real.ct_init(vmid)

    def holdings(self, pids: Iterable[int] | None = None, **kw: Any) -> dict[int, Holding]:
        wanted = None if pids is None else set(pids)
        out = self.real.holdings(wanted, **kw)
        if self.active and (wanted is None or self.stale.pid in wanted):
            out[self.stale.pid] = Holding(self.stale.pid, frozenset({0}), frozenset({"fd"}))
        return out

    def signal(self, ident: ProcIdentity, sig: int, vmid: int) -> SignalResult:
        if ident == self.stale:
            self.active = False  # from now on the pid reads as what it is
        return self.real.signal(ident, sig, vmid)


class Recorder:
    """The Host reset is given: every signal() call with what the real adapter answered; the rest passes through."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.self_pid = inner, inner.self_pid
        self.calls: list[tuple[ProcIdentity, int, int, SignalResult]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def signal(self, ident: ProcIdentity, sig: int, vmid: int) -> SignalResult:
        res: SignalResult = self.inner.signal(ident, sig, vmid)
        self.calls.append((ident, sig, vmid, res))
        return res


class NoPowerPve:
    """PVE for a reset with restart disabled: the containers and their GPU grant (``devN: /dev/nvidia0``);
    a power action is recorded, never done (the rule says none happens)."""

    def __init__(self, vmids: list[int], node: str = "pve1") -> None:
        self.node, self.vmids = node, vmids
        self.calls: list[str] = []

    def local_node(self) -> str:
        return self.node

    def where(self, vmid: int) -> Guest | None:
        return Guest(vmid, self.node, "lxc") if vmid in self.vmids else None

    def guests(self) -> list[Guest]:
        return [Guest(v, self.node, "lxc") for v in self.vmids]

    def ct_config(self, guest: Guest) -> str:
        return "arch: amd64\ndev0: /dev/nvidia0,gid=44\n"

    def ct_status(self, guest: Guest) -> CtStatus:
        return CtStatus("running")

    def _power(self, what: str, guest: Guest) -> str:
        self.calls.append(f"{what} {guest.vmid}")
        raise AssertionError(f"{what} of CT {guest.vmid} with restart disabled")

    def ct_stop(self, guest: Guest) -> str:
        return self._power("stop", guest)

    def ct_start(self, guest: Guest) -> str:
        return self._power("start", guest)


def _alive(p: Proc) -> bool:
    """That very process still runs (same start time, not a zombie): read here, not through pvegpu."""
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    fields = text[text.rfind(")") + 2 :].split()
    return int(fields[19]) == p.start and fields[0] not in ("Z", "X")


# -- the rule ---------------------------------------------------------------------------------------------------


def violations(lab: Lab, rep: ResetReport, calls: list[tuple[ProcIdentity, int, int, SignalResult]], pve_calls: list[str]) -> list[str]:
    """Every way this run broke the safety rule (empty: it held)."""
    out: list[str] = []
    known = lab.by_ident()
    diagnosis = "\n".join(f"{a} | {b}" for a, b in rep.diagnosis)
    # 1. signals reach only payload holders of the target, through the identity seen at scan time
    for ident, sig, vmid, res in calls:
        if vmid != lab.target:
            out.append(f"signal {signal.Signals(sig).name} asked for CT {vmid}, not the target {lab.target}")
        if res != SignalResult.SENT:
            continue
        p = known.get(ident)
        if p is None:
            out.append(f"{signal.Signals(sig).name} delivered to {ident}, which is none of this test's processes (recycled pid?)")
        elif not (p.where == "target" and p.role == "payload" and p.hold):
            out.append(f"{signal.Signals(sig).name} delivered to {p}")
    rc = lab.get("rc")
    if rc is not None and any(ident.pid == rc.pid and res == SignalResult.SENT for ident, _s, _v, res in calls):
        out.append(f"a signal for the recycled pid reached the process now at that pid: {rc}")
    # 2. nothing outside the target's payload died: its init and monitor, neighbours, host processes
    for p in lab.procs:
        if not (p.where == "target" and p.role in ("payload", "shim")) and not p.transient and not _alive(p):
            out.append(f"stopped, but must never be: {p}")
    # 3. every holder of the target is stopped or named; every payload holder is stopped
    for p in lab.procs:
        if p.where != "target" or p.role == "monitor" or not p.hold or p.transient or not _alive(p):
            continue  # the monitor is outside the container: not its holder, never touched (rule 2)
        if p.role == "payload":
            out.append(f"payload holder of the target left running: {p}")
        if not re.search(rf"\bpid {p.pid}\b", diagnosis):
            out.append(f"holder of the target neither stopped nor named in the diagnosis: {p}")
        if p.nested_init and f"the init of CT {lab.target} (pid {p.pid}" in diagnosis:
            out.append(f"the diagnosis takes a nested namespace's PID 1 for the container's init: {p}")
    # 4. what the report shows of each signalled process is its pid inside the container's namespace
    for s in rep.signalled:
        p = next((q for q in lab.procs if q.pid == s["pid"]), None)
        if s["result"] == "sent" and p is not None and len(p.nspid) > 1 and s["ns_pid"] != p.nspid[1]:
            out.append(f"report shows CT pid {s['ns_pid']} for {p}; inside the container it is {p.nspid[1]}")
    # 5. the verdict: clean unless the container's own init holds the device
    init_holds = any(p.where == "target" and p.role == "init" and p.hold for p in lab.procs)
    want = "not clean" if init_holds else "clean"
    if rep.outcome != want:
        out.append(f"verdict {rep.outcome!r} (exit {rep.exit_code}), expected {want!r}; diagnosis: {rep.diagnosis}")
    if pve_calls:
        out.append(f"power actions with restart disabled: {pve_calls}")
    return out


@pytest.fixture(scope="module")
def standin() -> Iterator[tuple[str, DeviceTable]]:
    """A stand-in GPU no one else holds: a pseudo-terminal's slave, mapped to GPU minor 0 (the test process keeps
    it open, so pvegpu itself is a holder it must skip). Other holders of that device number, if any, are not
    this test's processes, and every assertion is about this test's processes only."""
    master, slave = pvelike.high_pty()
    rdev = os.fstat(slave).st_rdev
    try:
        yield os.ttyname(slave), DeviceTable({(os.major(rdev), os.minor(rdev)): 0})
    finally:
        os.close(slave)
        os.close(master)


def _dimensions(world: dict[str, Any]) -> set[str]:
    """Which generated dimensions this world has (shown by ``pytest --hypothesis-show-statistics``)."""
    out = {f"{len(world['cts'])} container(s)", f"recycled pid: {world['recycle']}"}

    def walk(nodes: list[dict[str, Any]], where: str, depth: int) -> None:
        for n in nodes:
            out.update(f"{where}: {name}" for name, on in (
                ("holder", n["hold"]), ("child holder", n["hold"] and depth > 0), ("orphan", n["orphan"]),
                ("exits mid-scan", n["exit_after"] is not None), ("ignores SIGTERM", n["ignore_term"] and n["hold"]),
                ("nested cgroup", bool(n["cgroup"])), ("nested PID namespace", n["nested_ns"])) if on)
            walk(n["children"], where, depth + 1)

    for i, ct in enumerate(world["cts"]):
        where = "target" if i == 0 else "neighbour"
        out.update(f"{where}: {x} holds" for x in ("init", "monitor") if ct[f"{x}_holds"])
        walk(ct["procs"], where, 0)
    walk(world["host"], "host", 0)
    return out


def run_reset(world: dict[str, Any], dev: str, table: DeviceTable) -> None:
    for d in sorted(_dimensions(world)):
        event(d)
    with built(world, dev) as lab:
        real = ProcHost(table)
        rc = lab.get("rc")
        host = Recorder(Recycled(real, rc, lab.target) if rc is not None else real)
        pve = NoPowerPve(lab.vmids)
        with open(lab.go, "w"):
            pass  # transient processes start their countdown: they exit while reset scans
        t0 = time.monotonic()
        rep = reset(lab.target, Ports(pve, FdBackedProbe(real), host, SystemClock()), POLICY)
        bad = violations(lab, rep, host.calls, pve.calls)
        assert not bad, "safety rule broken:\n  " + "\n  ".join(bad) + "\nprocesses:\n  " + "\n  ".join(map(str, lab.procs)) + \
            f"\nsignals: {[(i.pid, signal.Signals(s).name, r) for i, s, _v, r in host.calls]}\nreset took {time.monotonic() - t0:.2f} s; " \
            f"steps: {[(s.name, s.outcome, s.detail.get('msg')) for s in rep.steps]}"


@settings(max_examples=20, **PROFILE)
@given(world=worlds())
@example(world=RICH)
@example(world=INIT_HOLDS)
def test_reset_signals_only_target_payload_and_stops_every_holder(standin, world):
    """Over generated trees of containers and host processes, reset signals only the target's payload holders
    (never an init, a monitor, a neighbour, the host, itself or a recycled pid) and leaves none of them running."""
    run_reset(world, *standin)


@settings(max_examples=4, **PROFILE)
@given(world=worlds(nested=True))
@example(world=NESTED)
def test_reset_stops_holders_in_nested_pid_namespaces(standin, world):
    """The same rule with nested PID namespaces in every container and the host, and a target holder that is
    PID 1 of one (docker/podman in a CT): that PID 1 is payload and is stopped; the container's own init is not."""
    run_reset(world, *standin)
