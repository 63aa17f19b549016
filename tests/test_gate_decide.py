"""The start gate's pure decision, by table: facts in, verdict and per-GPU state out (no processes, no NVML)."""

from __future__ import annotations

import pytest

from pvegpu.core.holders import GpuFacts
from pvegpu.core.model import MIB, GpuInfo, GpuSample, Holder, NvmlProcess, Place, Placement, ProcIdentity, ProcInfo
from pvegpu.gate.decide import GatePolicy, GateState, Situation, decide

GPU = GpuInfo(0, 0, "GPU-0", "0000:41:00.0")


def holder(pid: int, place: Place, vmid: int | None, via: set[str]) -> Holder:
    info = ProcInfo(ProcIdentity(pid, pid), "python3", "S", Placement(place, vmid), f"/lxc/{vmid}/ns", pid)
    return Holder(info, frozenset({0}), frozenset(via))


def facts(used_mib: int | None = 0, procs: tuple[NvmlProcess, ...] = (), others: tuple[Holder, ...] = (),
          ghosts: tuple[int, ...] = (), ghost_owners: tuple[int, ...] = (), foreign_mib: int | None = 0,
          contexts: int = 0) -> dict[int, GpuFacts]:
    sample = GpuSample(0, None if used_mib is None else used_mib * MIB, None if used_mib is None else procs, None if used_mib is not None else "GPU is lost")
    f = GpuFacts(GPU, sample, other_holders=list(others), ghosts=list(ghosts), ghost_owners=list(ghost_owners),
                 heirs=dict(zip(ghosts, ghost_owners, strict=False)), foreign_bytes=None if foreign_mib is None else foreign_mib * MIB,
                 contexts_outside=contexts)
    return {0: f}


NEIGHBOUR = holder(500, Place.CONTAINER, 130, {"nvml", "fd", "maps"})
UNLISTED_NEIGHBOUR = holder(501, Place.CONTAINER, 130, {"fd", "maps"})
NVML_CLIENT = holder(502, Place.HOST, None, {"fd"})
HOST_JOB = holder(503, Place.HOST, None, {"nvml", "maps"})

CASES = [
    # name, facts, situation, policy, allow, state, words in the reasons
    ("clean", facts(), Situation(), GatePolicy(), True, GateState.CLEAN, ""),
    ("under threshold", facts(used_mib=60), Situation(), GatePolicy(), True, GateState.CLEAN, ""),
    ("leftover", facts(used_mib=2048), Situation(), GatePolicy(), False, GateState.REFUSED, "2048 MiB that no running container"),
    ("unreadable fails closed", facts(used_mib=None), Situation(), GatePolicy(), False, GateState.UNKNOWN, "cannot be read"),
    ("unreadable fails open", facts(used_mib=None), Situation(), GatePolicy(on_unknown="allow"), True, GateState.UNKNOWN, "allowed"),
    ("usage not reported", facts(used_mib=1024, foreign_mib=None), Situation(), GatePolicy(), False, GateState.REFUSED, "not reported"),
    ("usage not reported, allow", facts(used_mib=1024, foreign_mib=None), Situation(), GatePolicy(on_unknown="allow"), True, GateState.CLEAN, "allowed"),
    ("shared with a running CT", facts(used_mib=1024, others=(NEIGHBOUR,), foreign_mib=1024), Situation(), GatePolicy(), True, GateState.SHARED, "shared with CT 130"),
    ("exclusive self", facts(used_mib=1024, others=(NEIGHBOUR,), foreign_mib=1024), Situation(exclusive=True), GatePolicy(), False, GateState.REFUSED, "CT 129 is exclusive"),
    ("exclusive neighbour", facts(used_mib=1024, others=(NEIGHBOUR,), foreign_mib=1024), Situation(exclusive_neighbours=frozenset({130})), GatePolicy(), False, GateState.REFUSED, "CT 130, which is exclusive"),
    ("ghost nobody explains", facts(used_mib=1024, ghosts=(77,)), Situation(), GatePolicy(), False, GateState.REFUSED, "no longer exist"),
    ("ghost of a neighbour's child", facts(used_mib=1024, others=(UNLISTED_NEIGHBOUR,), ghosts=(77,), ghost_owners=(501,), foreign_mib=1024), Situation(), GatePolicy(), True, GateState.SHARED, "shared with CT 130"),
    ("NVML client is not a user", facts(others=(NVML_CLIENT,)), Situation(), GatePolicy(), True, GateState.CLEAN, ""),
    ("host job shares by default", facts(used_mib=512, others=(HOST_JOB,), foreign_mib=512), Situation(), GatePolicy(), True, GateState.SHARED, "host process(es) pid 503"),
    ("host job, host_users = refuse", facts(used_mib=512, others=(HOST_JOB,), foreign_mib=512), Situation(), GatePolicy(host_users="refuse"), False, GateState.REFUSED, "outside any container"),
    ("host job, exclusive self", facts(used_mib=512, others=(HOST_JOB,), foreign_mib=512), Situation(exclusive=True), GatePolicy(), False, GateState.REFUSED, "CT 129 is exclusive"),
    ("crowded: 12 neighbour contexts' gap is allowed", facts(used_mib=12 * 1024 + 73, others=(NEIGHBOUR,), foreign_mib=12 * 1024, contexts=12), Situation(), GatePolicy(), True, GateState.SHARED, "shared with CT 130"),
    ("crowded, plus a real leak", facts(used_mib=12 * 1024 + 73 + 200, others=(NEIGHBOUR,), foreign_mib=12 * 1024, contexts=12), Situation(), GatePolicy(), False, GateState.REFUSED, "no running container accounts for"),
    ("no flat allowance on an idle GPU", facts(used_mib=200), Situation(), GatePolicy(), False, GateState.REFUSED, "200 MiB"),
    ("process left in the CT", facts(), Situation(ct_pids=(9, 10)), GatePolicy(), False, GateState.CLEAN, "2 process(es) still sit"),
    ("reset in progress", facts(), Situation(reset_running=True), GatePolicy(), False, GateState.CLEAN, "reset of CT 129 is in progress"),
]


@pytest.mark.parametrize("name,f,sit,policy,allow,state,words", CASES, ids=[c[0] for c in CASES])
def test_decide_table(name, f, sit, policy, allow, state, words):
    """Each row: the verdict, the GPU's state and the reason that explains it."""
    d = decide(129, f, sit, policy)
    assert (d.allow, d.per_gpu[0]) == (allow, state), d.reasons
    assert words in "; ".join(d.reasons)


def test_fix_lines_are_not_repeated():
    """Two GPUs refused for the same reason suggest the same fix once."""
    two = {0: facts(used_mib=2048)[0], 1: GpuFacts(GpuInfo(1, 1, "GPU-1", "b"), GpuSample(1, 2048 * MIB, ()))}
    d = decide(129, two, Situation(ct_pids=(5,)), GatePolicy())
    assert not d.allow and len(d.fix) == len(set(d.fix))
    assert sum("pvegpu reset 129 --no-restart" == f for f in d.fix) == 1


def test_gate_scan_for_a_dead_pids_heir_is_bounded_by_the_granted_containers():
    """With a dead pid listed, the gate never scans the whole node: only listed pids and the processes of the
    containers granted the GPU (a host process or a container without the GPU is never read), and the orphan in a
    granted container is still found as the heir."""
    from pvegpu.gate.decide import GatePorts, evaluate
    from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve

    host = FakeHost(FakeClock())
    probe, pve = FakeProbe(host), FakePve(host)
    pve.add_ct(129)
    pve.add_ct(130)
    pve.add_ct(131, minors=(1,))
    for vmid in (130, 131):
        host.add(vmid, init=True)
    parent = host.add(130, minors={0})
    parent.pgid = parent.pid  # a shell job: its group's leader
    child = host.add(130, minors={0}, pgid=parent.pid)  # forked after "cuInit": the parent's group
    probe.context(0, 2048, parent, child)
    del host.procs[parent.pid]
    strangers = {host.add(None).pid for _ in range(50)} | {host.add(131).pid}
    scanned: list[object] = []
    real = host.holdings

    def holdings(pids=None, *, deep=False):
        scanned.append(None if pids is None else set(pids))
        return real(pids, deep=deep)

    host.holdings = holdings
    res = evaluate(129, GatePorts(pve, probe, host), GatePolicy())
    assert None not in scanned and not strangers & set().union(*scanned)
    assert res.decision.allow and res.facts[0].heirs == {parent.pid: child.pid}


def test_recycled_listed_pids_orphan_is_no_proven_heir():
    """NVML lists a dead parent whose pid a host process (holding nothing) now has, while an orphan in a granted
    container maps the device: the pid is a ghost and the scan widens to the granted containers, but no group or
    session can link the orphan to a pid a live process has, so the memory is unexplained: refused, never shared."""
    from pvegpu.gate.decide import GatePorts, evaluate
    from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve

    host = FakeHost(FakeClock())
    probe, pve = FakeProbe(host), FakePve(host)
    pve.add_ct(129)
    pve.add_ct(130)
    host.add(130, init=True)
    parent = host.add(130, minors={0})
    child = host.add(130, minors={0}, pgid=parent.pid)
    probe.context(0, 2048, parent, child)
    del host.procs[parent.pid]
    stranger = host.add(None)
    del host.procs[stranger.pid]
    stranger.pid = parent.pid  # the kernel handed the dead parent's pid to an unrelated host process
    host.procs[parent.pid] = stranger
    res = evaluate(129, GatePorts(pve, probe, host), GatePolicy())
    f = res.facts[0]
    assert f.recycled == [parent.pid] and f.heirs == {} and f.unexplained_ghosts == [parent.pid]
    assert not res.decision.allow and res.decision.per_gpu[0] is GateState.REFUSED
    assert child.pid in {h.pid for h in f.other_holders}  # scanned (the widened scan), not credited
