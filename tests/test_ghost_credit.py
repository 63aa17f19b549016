"""Ghost credit: a dead NVML-listed pid's memory goes only to a process proven to keep its context, and a listed pid's
later process is its successor, never its owner, and once a pid left NVML's list its next listing is a new
process's own (issue 30, item 8; the decision: ``holders._credit_ghosts``,
``holders._successor``). Pure: the stateful fakes; the same attacks on real processes are in tests/test_heirs.py."""

from __future__ import annotations

from pvegpu.audit.run import run_audit
from pvegpu.core.holders import FirstReading, inspect_gpus
from pvegpu.core.leftover import LeftoverRule, baseline
from pvegpu.core.model import GpuInfo
from pvegpu.gate.decide import GatePolicy, GatePorts, GateState, evaluate
from pvegpu.reset.diagnosis import restart_would_not_help
from pvegpu.reset.verify import is_clean
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve
from tests.test_scan_ahead import target_job

GPU = [GpuInfo(0, 0, "GPU-fake-0", "0000:00:00.0")]


def _node():
    """CT 129 (stopped, the gate's target) and CT 130 (running, granted the same GPU)."""
    host = FakeHost(FakeClock())
    probe, pve = FakeProbe(host), FakePve(host)
    pve.add_ct(129)
    pve.add_ct(130)
    host.add(130, init=True, comm="init")
    return host, probe, pve


def _stopped_cts_leak(host: FakeHost, probe: FakeProbe, mib: int = 8192) -> int:
    """A stopped CT's job died with its context kept (an fd in flight): NVML lists its dead pid with ``mib``."""
    job = host.add(129, minors={0})
    probe.context(0, mib, job, pinned=True)
    del host.procs[job.pid]
    return job.pid


def _take_pid(host: FakeHost, pid: int, vmid: int, **kw) -> object:
    """A new process of CT ``vmid`` that the kernel handed ``pid`` (a recycled pid)."""
    p = host.add(vmid, **kw)
    del host.procs[p.pid]
    p.pid = pid
    host.procs[pid] = p
    return p


def test_neighbours_mapper_under_its_init_takes_no_dead_pids_memory():
    """CT 130's process maps the device and sits directly under its CT's init, in no group or session of the dead
    pid: no heir, so the 8 GiB stay unexplained and the start is refused (gate), credited to nobody (audit)."""
    host, probe, pve = _node()
    ghost = _stopped_cts_leak(host, probe)
    mapper = host.add(130, minors={0})
    res = evaluate(129, GatePorts(pve, probe, host), GatePolicy())
    f = res.facts[0]
    assert not res.decision.allow and res.decision.per_gpu[0] is GateState.REFUSED
    assert f.unexplained_ghosts == [ghost] and f.heirs == {} and mapper.pid in {h.pid for h in f.other_holders}
    row = run_audit(pve=pve, probe=probe, host=host).gpus[0]
    assert [h.inherited_from for h in row.holders if h.pid == mapper.pid] == [None]


def test_neighbours_fork_child_in_the_dead_leaders_session_keeps_its_memory():
    """CT 130's fork child whose session (or process group) is the dead listed pid is proven its heir: shared."""
    for link in ("sid", "pgid"):
        host, probe, pve = _node()
        leader = host.add(130, minors={0})
        child = host.add(130, minors={0}, **{link: leader.pid})
        probe.context(0, 2048, leader, child)
        del host.procs[leader.pid]
        res = evaluate(129, GatePorts(pve, probe, host), GatePolicy())
        assert res.decision.allow and res.decision.per_gpu[0] is GateState.SHARED, (link, res.decision.reasons)
        assert res.facts[0].heirs == {leader.pid: child.pid} and res.facts[0].linked == [leader.pid]


def test_process_that_took_a_listed_pid_after_the_reading_is_not_its_owner():
    """NVML lists a dead pid with 8 GiB; right after the reading, a CT 130 process that maps the device gets that pid:
    it started after NVML listed the pid, so it is the dead one's successor, not the 8 GiB's owner: refused."""
    host, probe, pve = _node()
    ghost = _stopped_cts_leak(host, probe)
    real = host.describe

    def describe(pid):  # the first look at the listed pid, after NVML's reading
        if pid == ghost and ghost not in host.procs:
            host.clock.sleep(0.01)
            _take_pid(host, ghost, 130, minors={0})
        return real(pid)

    host.describe = describe
    res = evaluate(129, GatePorts(pve, probe, host), GatePolicy())
    f = res.facts[0]
    assert not res.decision.allow and res.decision.per_gpu[0] is GateState.REFUSED
    assert f.recycled == [ghost] and f.unexplained_ghosts == [ghost] and f.foreign_bytes == 0


def test_successor_that_maps_the_gpu_leaves_the_targets_ghost_its_own():
    """A reset's first reading lists the target's job with 4 GiB; the job dies with its context kept out of sight, and
    a neighbour's new process gets its pid and maps the device: a successor (another start time than first seen), so
    the 4 GiB stay the target's ghost, never called the neighbour's and never clean."""
    host, probe, _pve = _node()
    job = host.add(129, minors={0})
    probe.context(0, 4096, job, pinned=True)
    first = FirstReading()
    f0 = inspect_gpus(129, GPU, host=host, probe=probe, first=first)[0]
    rule = LeftoverRule()
    f0.baseline_bytes = baseline(f0, rule)
    del host.procs[job.pid]
    host.clock.sleep(1.0)
    _take_pid(host, job.pid, 130, minors={0})
    for whole in (False, True):
        f = inspect_gpus(129, GPU, host=host, probe=probe, first=first, whole_host=whole)[0]
        f.baseline_bytes = f0.baseline_bytes
        assert f.target_ghosts == [job.pid] and f.recycled == [job.pid] and f.foreign_bytes == 0
        assert not is_clean(f, rule)


def test_a_listed_pid_that_leaves_nvmls_list_is_forgotten():
    """A reset reading that no longer lists a pid ends what was remembered of it: the pid's next listing (a new
    process's own context) is that process's, not a successor's."""
    host, probe, _pve = _node()
    job = host.add(129, minors={0})
    probe.context(0, 1024, job)
    first = FirstReading()
    inspect_gpus(129, GPU, host=host, probe=probe, first=first)
    del host.procs[job.pid]
    inspect_gpus(129, GPU, host=host, probe=probe, first=first)  # listed dead: the driver's release latency runs
    host.clock.sleep(1.0)
    assert not inspect_gpus(129, GPU, host=host, probe=probe, first=first)[0].sample.processes
    assert job.pid not in first.listed
    newcomer = _take_pid(host, job.pid, 130, minors={0})
    probe.context(0, 2048, newcomer)
    f = inspect_gpus(129, GPU, host=host, probe=probe, first=first)[0]
    assert f.ghosts == [] and f.foreign_bytes == 2048 * 1024 * 1024


def test_a_target_pid_reused_by_a_neighbours_gpu_job_is_never_the_targets_leftover():
    """The target's pid, released and then reused by a neighbour's new GPU job, is the neighbour's: never the target's ghost."""
    clock, host, probe, job, gpu, first, f0 = target_job()
    f0.baseline_bytes = baseline(f0, LeftoverRule())
    del host.procs[job.pid]  # stopped by the reset
    probe.model.sample([0])  # seen dead: the release latency runs
    clock.sleep(1.0)  # the driver released its context
    gone = inspect_gpus(129, gpu, host=host, probe=probe, first=first)[0]  # the verify loop's reading: no longer listed
    assert not gone.sample.processes
    neighbour = host.add(300, minors={0}, maps=True)  # a neighbour's new job ...
    del host.procs[neighbour.pid]
    neighbour.pid = job.pid  # ... got the freed pid
    host.procs[job.pid] = neighbour
    probe.context(0, 2048, neighbour)
    for whole in (False, True):  # the verify loop's readings and may_restart's whole-node reading
        f = inspect_gpus(129, gpu, host=host, probe=probe, first=first, whole_host=whole)[0]
        f.baseline_bytes = f0.baseline_bytes
        assert job.pid not in f.target_ghosts, f
        assert is_clean(f, 64) and restart_would_not_help({0: f}) is not None


def test_a_session_made_at_a_dead_pids_number_after_it_died_is_no_link():
    """A stopped CT's dead listed pid holds 8 GiB and no group or session keeps its number: CT 130's tenant cycles
    pids until one of its processes gets that number, calls setsid() there, forks a child that maps the device and
    lets the leader exit. The child's session id is the dead pid's, but the session was made after the owner died, in
    another container: no link, so the start of CT 129 onto the 8 GiB is refused and nothing is credited to CT 130
    (CT 129's post-stop check saw the pid listed and dead: the record says since when)."""
    host, probe, pve = _node()
    ghost = _stopped_cts_leak(host, probe)
    evaluate(129, GatePorts(pve, probe, host), GatePolicy())  # the post-stop hook's check
    host.clock.sleep(60.0)  # the tenant's pid cycling takes a while
    leader = _take_pid(host, ghost, 130)
    child = host.add(130, minors={0}, sid=leader.pid, pgid=leader.pid)  # setsid() at the dead pid's number, then fork
    del host.procs[leader.pid]  # the leader exits: its session lives on in the child, as a real heir's would
    res = evaluate(129, GatePorts(pve, probe, host), GatePolicy())
    f = res.facts[0]
    assert not res.decision.allow and res.decision.per_gpu[0] is GateState.REFUSED, res.decision.reasons
    assert f.heirs == {} and f.unexplained_ghosts == [ghost] and f.foreign_bytes == 0
    [h] = [h for h in run_audit(pve=pve, probe=probe, host=host).gpus[0].holders if h.pid == child.pid]
    assert h.inherited_from is None and h.memory_bytes == 0


def test_process_that_took_a_dead_listed_pid_before_the_reading_and_maps_the_gpu_is_not_its_owner():
    """A stopped CT's dead listed pid holds 8 GiB; a minute later CT 130's tenant gets that pid (pid cycling) and opens
    and maps the device, all before the gate reads NVML: it is the dead one's successor, not the owner of its entry,
    so the start of CT 129 onto the 8 GiB is refused and CT 130 is not charged with them (CT 129's post-stop check
    saw the pid listed and dead: the record says since when)."""
    host, probe, pve = _node()
    ghost = _stopped_cts_leak(host, probe)
    evaluate(129, GatePorts(pve, probe, host), GatePolicy())  # the post-stop hook's check
    host.clock.sleep(60.0)
    _take_pid(host, ghost, 130, minors={0})
    res = evaluate(129, GatePorts(pve, probe, host), GatePolicy())
    f = res.facts[0]
    assert not res.decision.allow and res.decision.per_gpu[0] is GateState.REFUSED, res.decision.reasons
    assert f.recycled == [ghost] and f.foreign_bytes == 0


def test_a_fresh_node_without_a_record_decides_as_before():
    """No record (the first run after boot): the gate decides on this reading alone, as it did before the record
    existed (a pid taken before any run saw it listed is the horizon), and then keeps the record for the next run."""
    host, probe, pve = _node()
    ghost = _stopped_cts_leak(host, probe)
    host.clock.sleep(60.0)
    _take_pid(host, ghost, 130, minors={0})
    assert host.seen is None
    before = inspect_gpus(129, GPU, host=host, probe=probe)[0]
    f = evaluate(129, GatePorts(pve, probe, host), GatePolicy()).facts[0]
    assert (f.recycled, f.heirs, f.unexplained_ghosts, f.foreign_bytes) == \
        (before.recycled, before.heirs, before.unexplained_ghosts, before.foreign_bytes)
    assert host.seen is not None and set(host.seen) == {ghost}


def test_a_real_heirs_session_stays_a_link_with_the_record():
    """CT 130's service led its session, forked a child that maps the device, and died after a gate run saw it
    listed there: the child started before its leader was seen dead, in the leader's container, so it stays the
    proven heir and the start of CT 129 is allowed as a shared one."""
    host, probe, pve = _node()
    leader = host.add(130, minors={0})
    leader.sid = leader.pgid = leader.pid
    child = host.add(130, minors={0}, maps=True, sid=leader.pid, pgid=leader.pid)
    probe.context(0, 2048, leader, child, pinned=True)
    evaluate(129, GatePorts(pve, probe, host), GatePolicy())  # saw the leader alive and listed in CT 130
    del host.procs[leader.pid]
    evaluate(129, GatePorts(pve, probe, host), GatePolicy())  # saw it dead
    host.clock.sleep(60.0)
    res = evaluate(129, GatePorts(pve, probe, host), GatePolicy())
    f = res.facts[0]
    assert f.heirs == {leader.pid: child.pid} and f.unexplained_ghosts == [], f
    assert res.decision.allow, res.decision.reasons
