"""Who a reset signals: the one pure rule (``reset.targets``), and the dry run and the stop loop agreeing on it."""

from __future__ import annotations

import random

from pvegpu.core.holders import GpuFacts
from pvegpu.core.model import GpuInfo, GpuSample, Holder, Place, Placement, ProcIdentity, ProcInfo
from pvegpu.reset import KillNow, Ports, ResetPolicy, Spared, reset, targets
from pvegpu.reset.targets import kill_now_why
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve

VMID = random.randint(10_000, 99_999)
SELF = 4242


def _holder(pid: int, vmid: int | None = VMID, **kw: object) -> Holder:
    place = Placement(Place.CONTAINER, vmid) if vmid else Placement(Place.HOST)
    info = ProcInfo(ProcIdentity(pid, pid * 10), "python3", str(kw.pop("state", "S")), place, "/", pid - 100, **kw)  # type: ignore[arg-type]
    return Holder(info, frozenset({0}), frozenset({"fd", "maps"}))


def _facts(ct: list[Holder], other: list[Holder], minor: int = 0) -> GpuFacts:
    return GpuFacts(GpuInfo(minor, minor, f"GPU-{minor}", f"0000:0{minor}:00.0"), GpuSample(minor, 0, []), ct_holders=ct, other_holders=other)


def test_targets_sorts_every_holder_into_one_kind():
    """Payload processes are targets (SIGKILL at once when SIGTERM is futile, traced or frozen); the CT's init,
    pvegpu itself and holders outside the container are spared, each with its reason."""
    plain, stopped = _holder(501), _holder(502, state="T")
    futile, traced, frozen = _holder(503, term_futile=True), _holder(504, state="t"), _holder(505, frozen=True)
    init, me, outside = _holder(506, is_ct_init=True), _holder(SELF), _holder(507, vmid=VMID + 1)
    t = targets({0: _facts([frozen, init, plain, me, traced, futile, stopped], [outside])}, SELF)
    assert [h.pid for h in t.term] == [501, 502]
    assert [h.pid for h in t.kill_now] == [503, 504, 505]
    assert [(h.pid, why) for h, why in t.spared] == [(506, Spared.CT_INIT), (SELF, Spared.SELF), (507, Spared.OUTSIDE)]
    assert [kill_now_why(h) for h in t.kill_now] == [KillNow.TERM_FUTILE, KillNow.TERM_FUTILE, KillNow.FROZEN]


def test_targets_names_a_process_on_two_gpus_once_and_forgets_what_was_tried():
    """A holder of two of the CT's GPUs is one target; ``without`` drops targets already signalled."""
    a, b = _holder(601), _holder(602)
    t = targets({0: _facts([a], []), 1: _facts([_holder(601), b], [], minor=1)}, SELF)
    assert [h.pid for h in t.signalled] == [601, 602]
    assert [h.pid for h in t.without({a.info.ident}).signalled] == [602]


def _world():
    clock = FakeClock()
    host = FakeHost(clock)
    probe, pve = FakeProbe(host), FakePve(host)
    pve.add_ct(VMID)
    pve.add_ct(VMID + 1)
    host.add(VMID, init=True, comm="init")
    host.add(VMID + 1, init=True, comm="init")
    procs = [host.add(VMID, minors={0}), host.add(VMID, minors={0}, on_term="ignore"),
             host.add(VMID, minors={0}, term_futile=True), host.add(VMID, minors={0}, state="t"),
             host.add(VMID + 1, minors={0}), host.add(None, minors={0})]
    for p in procs:
        probe.context(0, 256, p)
    return clock, host, probe, pve


def test_dry_run_lists_exactly_what_the_stop_loop_signals():
    """On the same facts the dry run's "would signal" list, and its SIGKILL-at-once part, are what the stop
    loop's first round sends: both come from ``targets``."""
    clock, host, probe, pve = _world()
    dry = reset(VMID, Ports(pve, probe, host, clock), ResetPolicy(dry_run=True))
    would = {p["pid"]: p["action"] for p in dry.plan if not p["action"].startswith("none")}
    assert host.signals == []
    clock, host, probe, pve = _world()
    real = reset(VMID, Ports(pve, probe, host, clock), ResetPolicy(restart=False))
    first: dict[int, str] = {}
    for pid, sig in host.signals:
        first.setdefault(pid, sig)
    assert set(would) == set(first)
    assert {pid for pid, a in would.items() if a.startswith("SIGKILL at once")} == {p for p, s in first.items() if s == "SIGKILL"}
    assert {e["pid"] for e in dry.plan if e.get("spared") == Spared.OUTSIDE} == {
        h.pid for f in real.before.values() for h in f.other_holders}
