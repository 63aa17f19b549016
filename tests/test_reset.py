"""The reset state machine with a fake clock: every exit path, no real sleeping."""

from __future__ import annotations

import pytest

from pvegpu import errors as E
from pvegpu.reclaim import Ports, ResetPolicy, reset
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve


@pytest.fixture
def node():
    clock = FakeClock()
    host = FakeHost(clock)
    probe = FakeProbe(host)
    pve = FakePve(host)
    pve.add_ct(129)
    pve.add_ct(130)
    host.add(129, init=True, comm="init")
    host.add(130, init=True, comm="init")
    return clock, host, probe, pve


def run(node, vmid=129, **policy):
    clock, host, probe, pve = node
    return reset(vmid, Ports(pve, probe, host, clock), ResetPolicy(**policy))


def test_simple_holder_clean_after_sigterm(node):
    """One holder exits on SIGTERM; NVML confirms and no SIGKILL or restart happens."""
    _, host, probe, pve = node
    p = host.add(129, minors={0})
    probe.context(0, 2048, p)
    r = run(node)
    assert (r.outcome, r.exit_code) == ("clean", 0)
    assert host.signals == [(p.pid, "SIGTERM")] and pve.calls == []


def test_sigterm_ignored_escalates_to_sigkill_after_grace(node):
    """A SIGTERM-ignoring holder gets SIGKILL once the grace period has passed, not before."""
    clock, host, probe, _ = node
    p = host.add(129, minors={0}, on_term="ignore")
    probe.context(0, 512, p)
    t0 = clock.t
    r = run(node, grace=4.0)
    assert r.outcome == "clean"
    assert [s for _, s in host.signals] == ["SIGTERM", "SIGKILL"]
    kill_t = [e["t"] for e in r.signalled if e["signal"] == "SIGKILL"][0]
    assert kill_t - t0 >= 4.0


def test_unlisted_fork_child_is_found_and_stopped(node):
    """A child that inherited the context (never listed by NVML) is stopped; memory returns only then."""
    _, host, probe, _ = node
    parent = host.add(129, minors={0})
    child = host.add(129, minors={0})
    probe.context(0, 1024, parent, child)
    r = run(node)
    assert r.outcome == "clean"
    assert {pid for pid, _ in host.signals} == {parent.pid, child.pid}


def test_other_container_and_host_untouched_and_subtracted(node):
    """Holders in another CT and on the host are never signalled and their memory is not a leftover."""
    _, host, probe, _ = node
    mine, other, hosty = host.add(129, minors={0}), host.add(130, minors={0}), host.add(None, minors={0})
    for p, mib in ((mine, 1000), (other, 3000), (hosty, 500)):
        probe.context(0, mib, p)
    r = run(node)
    assert r.outcome == "clean"
    assert {pid for pid, _ in host.signals} == {mine.pid}
    assert other.pid in host.procs and hosty.pid in host.procs


def test_container_init_is_never_signalled_and_restart_fixes_it(node):
    """When the CT's init holds the GPU, pvegpu restarts the CT instead of signalling PID 1."""
    _, host, probe, pve = node
    init = next(p for p in host.procs.values() if p.vmid == 129 and p.init)
    init.minors = {0}
    probe.context(0, 700, init)
    r = run(node, timeout=1.0)
    assert init.pid not in {pid for pid, _ in host.signals}
    assert pve.calls == ["stop 129", "start 129"] and r.restarted and r.exit_code == 0


def test_respawning_holder_exhausts_rounds_then_restart(node):
    """A holder that a service keeps restarting is fought for N rounds, then the CT is restarted."""
    _, host, probe, pve = node
    p = host.add(129, minors={0}, respawn={})
    probe.context(0, 1024, p)
    r = run(node, rounds=2)
    assert len([s for s in r.steps if s.name == "round"]) == 2
    assert any(s.name == "respawn" for s in r.steps)
    assert pve.calls == ["stop 129", "start 129"] and r.outcome == "clean"


def test_no_restart_leaves_respawner_and_exits_holders_left(node):
    """With --no-restart a respawning holder ends with exit 6 and a diagnosis naming the pid."""
    _, host, probe, pve = node
    p = host.add(129, minors={0}, respawn={})
    probe.context(0, 1024, p)
    r = run(node, rounds=1, restart=False, timeout=1.0)
    assert r.exit_code == E.EXIT_HOLDERS_LEFT and pve.calls == []
    assert any("still holds" in d for d, _ in r.diagnosis)


def test_d_state_holder_diagnosed_as_stuck(node):
    """A holder stuck in D state survives SIGKILL and is reported as stuck in the driver."""
    _, host, probe, _ = node
    p = host.add(129, minors={0}, state="D")
    probe.context(0, 1024, p)
    r = run(node, grace=1.0, kill_wait=1.0, restart=False, timeout=1.0)
    assert r.exit_code == E.EXIT_HOLDERS_LEFT
    assert any("state D" in d for d, _ in r.diagnosis)
    assert host.signals == [(p.pid, "SIGTERM"), (p.pid, "SIGKILL")]  # fought once, not once a round
    assert not any(s.name == "respawn" for s in r.steps)


def test_driver_leak_leaves_container_stopped_exit_7(node):
    """Memory with no holder anywhere survives the stop: the CT is left stopped, exit 7, reset advice."""
    _, _host, probe, pve = node
    probe.leak[0] = 2048 * 1024 * 1024
    r = run(node, timeout=1.0)
    assert pve.calls == ["stop 129"] and r.left_stopped
    assert r.exit_code == E.EXIT_MEMORY_LEFT
    assert any("driver-level leak" in d and "nvidia-smi -r" in a for d, a in r.diagnosis)


def test_locked_container_is_not_restarted(node):
    """A CT with a lock (backup) is never stopped; the report says why, with exit 4."""
    _, _host, probe, pve = node
    pve.status[129]["lock"] = "backup"
    probe.leak[0] = 1 << 30
    r = run(node, timeout=0.5)
    assert pve.calls == [] and r.exit_code == E.EXIT_PVE
    assert any("locked (backup)" in d for d, _ in r.diagnosis)


def test_start_refused_by_hookscript_reported(node):
    """A start task that ends with a hookscript refusal is reported as such (exit 4), GPU verified clean."""
    _, host, probe, pve = node
    pve.status[129]["start_error"] = "hookscript error for 129 on pre-start: command '/x 129 pre-start' failed: exit code 10"
    p = host.add(129, minors={0}, respawn={})
    probe.context(0, 1024, p)
    r = run(node, rounds=1)
    assert r.exit_code == E.EXIT_PVE and r.outcome.startswith("clean") and r.left_stopped
    assert any("hookscript" in d and "pvegpu check 129" in a for d, a in r.diagnosis)


def test_unreadable_gpu_is_unknown_not_zero(node):
    """A GPU NVML cannot read makes the result 'unknown' (exit 5), never clean."""
    _, _host, probe, _ = node
    probe.fail.add(0)
    r = run(node, restart=False, timeout=0.5)
    assert r.exit_code == E.EXIT_GPU_UNKNOWN and r.outcome == "not clean"


def test_dry_run_signals_nothing(node):
    """--dry-run lists what would be signalled and why, and signals nothing."""
    _, host, probe, pve = node
    p = host.add(129, minors={0})
    probe.context(0, 1024, p)
    r = run(node, dry_run=True)
    assert host.signals == [] and pve.calls == [] and r.exit_code == 0
    assert [e["pid"] for e in r.plan if e["action"].startswith("SIGTERM")] == [p.pid]


def test_ha_managed_restart_polls_status(node):
    """An HA-managed CT is restarted through the API and the result is polled, not assumed."""
    _, host, probe, pve = node
    pve.status[129]["ha"] = True
    probe.leak[0] = 0
    p = host.add(129, minors={0}, respawn={})
    probe.context(0, 1024, p)
    r = run(node, rounds=1)
    assert r.restarted and r.exit_code == 0


@pytest.mark.parametrize("setup,msg", [
    (lambda pve: None, "no guest 999"),
    (lambda pve: pve.guests_.__setitem__(999, __import__("pvegpu.model").model.Guest(999, "pve1", "qemu")), "is a qemu VM"),
    (lambda pve: pve.add_ct(999, node="pve2"), "lives on node pve2"),
])
def test_refusals_name_the_problem(node, setup, msg):
    """Unknown vmid, a VM, or a CT on another node: NotFoundError (exit 3) naming why."""
    setup(node[3])
    with pytest.raises(E.NotFoundError, match=msg) as exc:
        run(node, vmid=999)
    assert exc.value.exit_code == E.EXIT_NOT_FOUND


def test_control_node_holder_in_container_is_stopped_outside_ignored(node):
    """A CT process holding only nvidiactl/nvidia-uvm is one of the CT's GPU users and is stopped; a host
    daemon on nvidiactl (persistenced) is neither signalled nor reported as a GPU holder."""
    from pvegpu.model import CONTROL

    _, host, probe, _ = node
    ctl_user = host.add(129, minors={CONTROL}, comm="nvidia-smi")
    daemon = host.add(None, minors={CONTROL}, comm="nvidia-persiste")
    r = run(node)
    assert r.outcome == "clean" and {pid for pid, _ in host.signals} == {ctl_user.pid}
    assert daemon.pid in host.procs and not r.before[0].other_holders


def test_foreign_unlisted_holder_does_not_get_the_target_restarted(node):
    """Memory held by another CT's unlisted fork child (its dead parent still listed) is not blamed on the
    target: no restart of the target, exit 7, and the diagnosis names the foreign holder."""
    _, host, probe, pve = node
    mine = host.add(129, minors={0})
    probe.context(0, 1024, mine)
    parent, child = host.add(130, minors={0}), host.add(130, minors={0})
    probe.context(0, 2048, parent, child)
    del host.procs[parent.pid]  # the parent died; its context lives on in the child, NVML still lists the parent
    r = run(node, timeout=1.0)
    assert pve.calls == [] and child.pid in host.procs and {pid for pid, _ in host.signals} == {mine.pid}
    assert r.exit_code == E.EXIT_MEMORY_LEFT
    assert any(f"pid {child.pid}" in d and "CT 130" in d for d, _ in r.diagnosis)
    assert any(s.name == "restart" and s.outcome == "skipped" for s in r.steps)
