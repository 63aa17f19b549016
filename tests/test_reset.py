"""The reset state machine with a fake clock: every exit path, no real sleeping."""

from __future__ import annotations

import pytest

from pvegpu.cli.render import reset_json, reset_table
from pvegpu.core import errors as E
from pvegpu.core.model import MIB
from pvegpu.reset import Kind, Ports, ResetPolicy, reset
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


def _target_left(node, nbytes, vmid=129):
    """Memory CT ``vmid`` leaves behind: its holder's context stays allocated when the holder is gone (a
    driver-level leak of the target's own memory; the driver model lists no pid for it once released)."""
    _, host, probe, _ = node
    p = host.add(vmid, minors={0})
    probe.context(0, nbytes // MIB, p, leaks=True)
    return p


def _kinds(r):
    """The kinds of a report's diagnosis lines."""
    return {d.kind for d in r.diagnosis}


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
    assert Kind.HOLDER_LEFT in _kinds(r)


def test_d_state_holder_diagnosed_as_stuck(node):
    """A holder stuck in D state survives SIGKILL and is reported as stuck in the driver."""
    _, host, probe, _ = node
    p = host.add(129, minors={0}, state="D")
    probe.context(0, 1024, p)
    r = run(node, grace=1.0, kill_wait=1.0, restart=False, timeout=1.0)
    assert r.exit_code == E.EXIT_HOLDERS_LEFT
    assert Kind.STUCK_IN_DRIVER in _kinds(r)
    assert host.signals == [(p.pid, "SIGTERM"), (p.pid, "SIGKILL")]  # fought once, not once a round
    assert not any(s.name == "respawn" for s in r.steps)


def test_driver_leak_leaves_container_stopped_exit_7(node):
    """Memory with no holder anywhere survives the stop: the CT is left stopped, exit 7, reset advice."""
    _, _host, probe, pve = node
    _target_left(node, 2048 * 1024 * 1024)
    r = run(node, timeout=1.0)
    assert pve.calls == ["stop 129"] and r.left_stopped
    assert r.exit_code == E.EXIT_MEMORY_LEFT
    assert Kind.DRIVER_LEAK in _kinds(r)


def test_locked_container_is_not_restarted(node):
    """A CT with a lock (backup) is never stopped; the report says why, with exit 4."""
    _, _host, probe, pve = node
    pve.status[129]["lock"] = "backup"
    _target_left(node, 1 << 30)
    r = run(node, timeout=0.5)
    assert pve.calls == [] and r.exit_code == E.EXIT_PVE
    assert any(d.kind is Kind.RESTART_FAILED and "backup" in d.problem for d in r.diagnosis)


def test_start_refused_by_hookscript_reported(node):
    """A start task that ends with a hookscript refusal is reported as such (exit 4), GPU verified clean."""
    _, host, probe, pve = node
    pve.status[129]["start_error"] = "hookscript error for 129 on pre-start: command '/x 129 pre-start' failed: exit code 10"
    p = host.add(129, minors={0}, respawn={})
    probe.context(0, 1024, p)
    r = run(node, rounds=1)
    assert r.exit_code == E.EXIT_PVE and r.outcome.startswith("clean") and r.left_stopped
    assert Kind.RESTART_FAILED in _kinds(r)


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
    (lambda pve: pve.guests_.__setitem__(999, __import__("pvegpu.core.model").core.model.Guest(999, "pve1", "qemu")), "is a qemu VM"),
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
    from pvegpu.core.model import CONTROL

    _, host, probe, _ = node
    ctl_user = host.add(129, minors={CONTROL}, comm="nvidia-smi")
    daemon = host.add(None, minors={CONTROL}, comm="nvidia-persiste")
    r = run(node)
    assert r.outcome == "clean" and {pid for pid, _ in host.signals} == {ctl_user.pid}
    assert daemon.pid in host.procs and not r.before[0].other_holders


def test_neighbours_fork_child_memory_is_the_neighbours(node):
    """Memory held by another CT's unlisted fork child (its dead parent still listed, the leader of its process group)
    is credited to that neighbour: the target is clean as soon as its own holder is gone, nothing is restarted, the
    child is untouched."""
    _, host, probe, pve = node
    mine = host.add(129, minors={0})
    probe.context(0, 1024, mine)
    parent = host.add(130, minors={0})
    child = host.add(130, minors={0}, pgid=parent.pid)
    probe.context(0, 2048, parent, child)
    del host.procs[parent.pid]  # the parent died; its context lives on in the child, NVML still lists the parent
    r = run(node, timeout=1.0)
    assert pve.calls == [] and child.pid in host.procs and {pid for pid, _ in host.signals} == {mine.pid}
    assert r.exit_code == E.EXIT_OK and r.after[0].ghost_owners == [child.pid]
    assert r.elapsed < 1.0  # decided once its own memory was back, not at the timeout


def test_nvml_client_does_not_explain_leftover_memory(node):
    """A host process holding only an NVML handle (an fd, no mapping: persistenced, DCGM) never explains
    leftover memory: the restart fallback still runs, and the diagnosis does not blame it."""
    _, host, probe, pve = node
    client = host.add(None, minors={0}, maps=False, comm="nvidia-persist")
    _target_left(node, 1024 * MIB)  # memory no process holds, left by the container's dead job
    r = run(node, timeout=0.5)
    assert "stop 129" in pve.calls, pve.calls
    assert not any(f"pid {client.pid}" in d and "likely held" in d for d, _ in r.diagnosis)


# -- waiting for PVE tasks (adapters/tasks.py through FakePve.wait_task) -----------------------------

def _guest(pve, vmid=129):
    return pve.where(vmid)


def test_wait_task_failure_carries_the_log_tail(node):
    """A stop task that ends with an error raises TaskFailed with PVE's message and the task log's tail."""
    _, _, _, pve = node
    pve.status[129]["stop_error"] = "container did not stop"
    upid = pve.ct_stop(_guest(pve))
    with pytest.raises(E.TaskFailed) as exc:
        pve.wait_task("pve1", upid, timeout=5, what="stop task of CT 129")
    assert "stop task of CT 129 failed: container did not stop" in exc.value.message
    assert exc.value.log_tail[-1] == "TASK ERROR: container did not stop"


def test_wait_task_unreadable_log_is_added_to_the_failure_not_replacing_it(node):
    """When the log of a failed task cannot be read, the task's own failure stays the message, the log
    error is added to it."""
    _, _, _, pve = node
    pve.status[129]["stop_error"] = "container did not stop"
    pve.broken["task_log"] = -1
    upid = pve.ct_stop(_guest(pve))
    with pytest.raises(E.TaskFailed) as exc:
        pve.wait_task("pve1", upid, timeout=5, what="stop task of CT 129")
    msg = exc.value.message
    assert msg.startswith("stop task of CT 129 failed: container did not stop") and "log could not be read" in msg


def test_wait_task_times_out_within_its_deadline_even_with_slow_status_reads(node):
    """A task slower than the timeout raises TaskTimeout; with status reads taking 3 s each, the wait ends
    at most one read after the deadline."""
    clock, _, _, pve = node
    pve.status[129]["stop_secs"] = 1000
    upid = pve.ct_stop(_guest(pve))
    slow = pve.task_status

    def task_status(node_, upid_):
        clock.sleep(3.0)
        return slow(node_, upid_)

    pve.task_status = task_status
    t0 = clock.t
    with pytest.raises(E.TaskTimeout, match="still running after 10 s"):
        pve.wait_task("pve1", upid, timeout=10, what="stop task of CT 129")
    assert clock.t - t0 <= 10 + 3.0 + 0.2


def test_warnings_exitstatus_is_success(node):
    """A task that ends with 'WARNINGS: n' is a success for wait_task."""
    _, _, _, pve = node
    pve.status[129]["stop_error"] = "WARNINGS: 2"
    upid = pve.ct_stop(_guest(pve))
    assert pve.wait_task("pve1", upid, timeout=5, what="stop").exitstatus == "WARNINGS: 2"


# -- after a stop was requested, the container's state is always found out and reported (issue 8.1) ---

def _init_holds_gpu(node):
    """The CT's init holds the GPU: only a restart can free it."""
    _, host, probe, _ = node
    init = next(p for p in host.procs.values() if p.vmid == 129 and p.init)
    init.minors = {0}
    probe.context(0, 700, init)
    return init


def test_stop_slower_than_task_timeout_is_reported_as_maybe_stopped(node):
    """A stop task still running after task_timeout may stop the CT after pvegpu exits: left_stopped,
    a step and a diagnosis line say so, exit 4."""
    _, _, _, pve = node
    _init_holds_gpu(node)
    pve.status[129]["stop_secs"] = 1000
    r = run(node, timeout=1.0, task_timeout=10, state_wait=5)
    assert r.left_stopped and r.ct_state == "running" and r.exit_code == E.EXIT_PVE and not r.restarted
    assert Kind.MAY_STOP in _kinds(r)
    assert any(s.name == "restart" and s.outcome == "left stopped" for s in r.steps)


def test_stop_that_lands_after_task_timeout_is_found_and_verified(node):
    """A stop that completes after task_timeout but within state_wait is seen: the CT is reported STOPPED
    (not started again after a failed stop), its GPU verified clean, exit 4."""
    _, _, _, pve = node
    _init_holds_gpu(node)
    pve.status[129]["stop_secs"] = 12
    r = run(node, timeout=1.0, task_timeout=10, state_wait=5)
    assert pve.calls == ["stop 129"] and r.left_stopped and r.ct_state == "stopped"
    assert r.outcome == "clean, but the restart failed" and r.exit_code == E.EXIT_PVE
    assert any("left STOPPED" in d and "pct start 129" in a for d, a in r.diagnosis)


def test_task_status_read_failing_after_a_successful_stop_reports_stopped(node):
    """The stop worked but its task status cannot be read: the CT's real state (stopped) is read and
    reported, not assumed; exit 4."""
    _, _, _, pve = node
    _init_holds_gpu(node)
    pve.broken["task_status"] = -1
    r = run(node, timeout=1.0)
    assert pve.status[129]["status"] == "stopped"
    assert r.left_stopped and r.ct_state == "stopped" and r.exit_code == E.EXIT_PVE
    assert {Kind.RESTART_FAILED, Kind.LEFT_STOPPED} <= _kinds(r)


def test_ha_acting_late_is_reported(node):
    """HA acts on the stop request later than task_timeout: the CT is still running now, but HA will stop
    it, and the report says so (left_stopped, HA named, exit 4)."""
    _, _, _, pve = node
    _init_holds_gpu(node)
    pve.status[129].update(ha=True, ha_delay=1000)
    r = run(node, timeout=1.0, task_timeout=10, state_wait=5)
    assert r.left_stopped and r.exit_code == E.EXIT_PVE
    assert Kind.MAY_STOP in _kinds(r)


def test_status_read_failing_after_the_stop_reports_unknown_state(node):
    """After the stop, status/current cannot be read: the CT is reported as possibly stopped (state
    unknown), never silently running; exit 4."""
    _, _, _, pve = node
    _init_holds_gpu(node)
    pve.status[129]["ha"] = True
    stop = pve.ct_stop

    def ct_stop(g):
        upid = stop(g)
        pve.broken["ct_status"] = -1
        return upid

    pve.ct_stop = ct_stop
    r = run(node, timeout=1.0, task_timeout=10, state_wait=5)
    assert r.left_stopped and r.ct_state == "unknown" and r.exit_code == E.EXIT_PVE
    assert Kind.STATE_UNKNOWN in _kinds(r)


# -- never exit 0 unless verified clean (issue 8.1) ---------------------------------------------------

def _leak_until(node, when):
    """Leftover memory with no holder, gone at fake time ``when(pve)`` (None: not yet)."""
    clock, _, probe, pve = node
    _target_left(node, 2048 * 1024 * 1024)

    def tick(t):
        at = when(pve)
        if at is not None and t >= at:
            probe.leak.pop(0, None)

    clock.listeners.append(tick)


def test_memory_back_inside_the_last_settle_window_is_not_verified(node):
    """Memory that comes back less than `settle` before the deadline is not verified: exit 5, never 0."""
    clock = node[0]
    t0 = clock.t
    _leak_until(node, lambda pve: t0 + 0.9)
    r = run(node, restart=False, timeout=1.0, settle=0.25)
    assert r.outcome == "not verified" and r.exit_code == E.EXIT_GPU_UNKNOWN
    assert Kind.UNSETTLED in _kinds(r)
    assert "NOT verified" in reset_table(r) and reset_json(r)["outcome"] == "not verified"


def test_timeout_shorter_than_settle_never_exits_clean(node):
    """With --timeout shorter than settle the memory can never be verified: exit 5, no restart."""
    _, host, probe, pve = node
    p = host.add(129, minors={0})
    probe.context(0, 1024, p)
    probe.model.release_latency = 0.0  # this case is about the settle window: memory back at once
    r = run(node, timeout=0.1, settle=0.25)
    assert r.exit_code == E.EXIT_GPU_UNKNOWN and r.outcome == "not verified" and pve.calls == []
    assert Kind.TIMEOUT_TOO_SHORT in _kinds(r)


def test_left_stopped_with_memory_back_in_the_last_settle_window_is_not_exit_0(node):
    """After the stop, memory that returns inside the last settle window leaves the CT stopped, and the
    exit code says the GPU is not verified (not 0 'clean')."""
    _init_holds_gpu(node)
    _leak_until(node, lambda pve: pve.stopped_at[129] + 0.9 if 129 in pve.stopped_at else None)
    r = run(node, timeout=1.0, settle=0.25)
    assert node[3].calls == ["stop 129"] and r.left_stopped
    assert r.exit_code == E.EXIT_GPU_UNKNOWN and r.outcome == "not verified"
    assert Kind.HELD_STOPPED in _kinds(r)


# -- a failed task's log tail is in the report (issue 8.5) ---------------------------------------------

def test_failed_start_task_log_tail_in_report_and_json(node):
    """The log tail of a failed start task is in the diagnosis and in the JSON report."""
    _, _, _, pve = node
    _init_holds_gpu(node)
    pve.status[129]["start_error"] = "hookscript error for 129 on pre-start: exit code 10"
    r = run(node, timeout=1.0)
    assert r.task_log[-1] == "TASK ERROR: hookscript error for 129 on pre-start: exit code 10"
    assert any(d.kind is Kind.TASK_LOG and "TASK ERROR" in d.problem for d in r.diagnosis)
    j = reset_json(r)
    assert j["task_log"] == r.task_log and j["left_stopped"] is True and j["ct_state"] == "stopped"


def test_failed_stop_with_unreadable_log_keeps_the_reason(node):
    """A failed stop whose log cannot be read still reports why it failed ('container did not stop')."""
    _, _, _, pve = node
    _init_holds_gpu(node)
    pve.status[129]["stop_error"] = "container did not stop"
    pve.broken["task_log"] = -1
    r = run(node, timeout=1.0)
    assert r.exit_code == E.EXIT_PVE and not r.left_stopped and r.ct_state == "running"
    assert any("container did not stop" in d and "log could not be read" in d for d, _ in r.diagnosis)


# -- respawns are reported with the parent that started them (issue 7.8) -------------------------------

def test_respawn_reported_with_its_parent_even_when_clean(node):
    """A supervisor restarts the holder once; the next round stops the copy and the GPU is clean, and the
    report still says a respawn happened and names the supervisor."""
    _, host, probe, _ = node
    sup = host.add(129, comm="supervisord")
    p = host.add(129, minors={0}, respawn={"times": 1}, ppid=sup.pid)
    probe.context(0, 1024, p)
    r = run(node)
    assert r.outcome == "clean" and r.exit_code == 0
    assert [e.parent_pid for e in r.respawns] == [sup.pid]
    assert any(s.name == "respawn" and s.outcome == "seen" for s in r.steps)
    assert any(f"pid {sup.pid} (supervisord" in n for n in r.notes)


def test_respawn_inside_the_settle_window_is_reported(node):
    """A copy that appears while clean is settling (supervisor restart delay 0.1 s < settle) is caught,
    stopped and reported with its parent."""
    _, host, probe, _ = node
    sup = host.add(129, comm="supervisord")
    p = host.add(129, minors={0}, respawn={"times": 1, "delay": 0.1}, ppid=sup.pid)
    probe.context(0, 1024, p)
    r = run(node, settle=0.25)
    assert r.outcome == "clean"
    assert [e.parent_comm for e in r.respawns] == ["supervisord"]
    assert len([s for s in r.steps if s.name == "round"]) == 2


def test_endless_respawn_diagnosis_names_the_parent(node):
    """When rounds run out against a respawning holder, the diagnosis names the parent that restarts it."""
    _, host, probe, _ = node
    sup = host.add(129, comm="supervisord")
    p = host.add(129, minors={0}, respawn={}, ppid=sup.pid)
    probe.context(0, 1024, p)
    r = run(node, rounds=2, restart=False, timeout=1.0)
    assert r.exit_code == E.EXIT_HOLDERS_LEFT
    assert any(d.kind is Kind.RESPAWNED and f"pid {sup.pid} (supervisord" in d.problem for d in r.diagnosis)


# -- deadlines hold when GPU reads are slow (issue 8.7) -----------------------------------------------

def test_verify_ends_within_one_read_of_its_deadline_with_slow_reads(node):
    """With every NVML reading taking 3 s and --timeout 2, verify gives up at most one read after 2 s."""
    _, _, probe, _ = node
    _target_left(node, 1 << 30)
    probe.read_secs = 3.0
    r = run(node, restart=False, timeout=2.0)
    v = next(s for s in r.steps if s.name == "verify")
    assert v.outcome == "timeout" and v.detail["seconds"] <= 2.0 + 3.0 + 0.05
    assert r.exit_code == E.EXIT_MEMORY_LEFT


def test_whole_reset_stays_within_its_budget_with_slow_reads(node):
    """A respawning holder, slow reads and a restart: the reset still ends within ResetPolicy.budget."""
    _, host, probe, _ = node
    p = host.add(129, minors={0}, respawn={})
    probe.context(0, 1024, p)
    probe.read_secs = 3.0
    pol = dict(rounds=2, grace=1.0, kill_wait=1.0, timeout=8.0, task_timeout=5.0, state_wait=2.0)
    r = run(node, **pol)
    assert r.elapsed <= ResetPolicy(**pol).budget + 3.0
    assert r.restarted and r.exit_code == 0


def test_start_task_status_unreadable_but_ct_running_is_not_left_stopped(node):
    """The start worked but its task status cannot be read: the CT's state is read (running), so it is
    reported restarted and not left stopped, with the failed read named (exit 4)."""
    _, _, _, pve = node
    _init_holds_gpu(node)
    start = pve.ct_start

    def ct_start(g):
        upid = start(g)
        pve.broken["task_status"] = -1
        return upid

    pve.ct_start = ct_start
    r = run(node, timeout=1.0)
    assert pve.calls == ["stop 129", "start 129"] and pve.status[129]["status"] == "running"
    assert r.restarted and not r.left_stopped and r.ct_state == "running" and r.exit_code == E.EXIT_PVE


def test_ha_start_acting_late_reports_stopped_with_start_pending(node):
    """HA has not started the CT when state_wait ends: it is reported STOPPED, its start still pending."""
    _, _, _, pve = node
    _init_holds_gpu(node)
    pve.status[129]["ha"] = True
    start = pve.ct_start

    def ct_start(g):
        pve.status[129]["ha_delay"] = 1000
        return start(g)

    pve.ct_start = ct_start
    r = run(node, timeout=1.0, task_timeout=10, state_wait=5)
    assert r.left_stopped and r.ct_state == "stopped" and not r.restarted and r.exit_code == E.EXIT_PVE
    assert Kind.LEFT_STOPPED in _kinds(r)


def test_sigterm_that_cannot_arrive_is_not_waited_for(node):
    """A holder SIGTERM cannot reach (it ignores it, or it is a nested namespace's init without a handler) gets
    SIGKILL at once instead of after the grace period."""
    _, host, probe, pve = node
    p = host.add(129, minors={0}, on_term="ignore", term_futile=True)
    probe.context(0, 1024, p)
    r = run(node, grace=10.0)
    assert r.exit_code == 0 and host.signals == [(p.pid, "SIGKILL")]
    assert r.elapsed < 2.0  # not the 10 s grace


def test_stop_request_without_an_answer_is_followed_to_the_real_state(node):
    """The stop request timed out (no UPID came back) but PVE carried it out a few seconds later: the CT's state
    is polled until known, and the report says it was left stopped instead of 'running'."""
    from pvegpu.core.errors import PveNoAnswer

    clock, host, probe, pve = node
    _target_left(node, 1024 * MIB)  # memory no process holds: the restart fallback runs
    real_stop = pve._stop_now

    def stop_without_answer(g):
        pve.calls.append(f"stop {g.vmid}")
        clock.listeners.append(lambda t, at=clock.t + 3.0: at <= t and pve.status[g.vmid]["status"] == "running" and real_stop(g.vmid))
        raise PveNoAnswer("stop CT 129: pve1:8006 did not answer within 2 s", "raise api.timeout")

    pve.ct_stop = stop_without_answer
    r = run(node, timeout=0.5)
    assert pve.status[129]["status"] == "stopped"
    assert r.left_stopped and r.ct_state == "stopped" and r.exit_code != 0


def test_stop_task_ok_but_ct_still_running_is_not_called_stopped(node):
    """The stop task ends OK but the CT is running (started again meanwhile): no "verified while stopped", no
    "left stopped"; the report says what happened (exit 4)."""
    _, host, probe, pve = node
    _target_left(node, 1024 * MIB)
    real_stop = pve._stop_now
    pve._stop_now = lambda vmid: (real_stop(vmid), pve._start_now(vmid))  # an admin starts it again at once
    r = run(node, timeout=0.5)
    assert pve.status[129]["status"] == "running"
    assert not r.left_stopped and r.exit_code == 4
    assert Kind.RESTART_FAILED in _kinds(r)


def test_leak_on_a_shared_gpu_is_named_in_the_diagnosis(node):
    """Memory no live process accounts for is named as a leak even when a neighbour also uses the GPU."""
    _, host, probe, _ = node
    neighbour = host.add(130, minors={0})
    probe.context(0, 1024, neighbour)
    _target_left(node, 2048 * MIB)
    r = run(node, timeout=0.3, restart=False)
    assert r.exit_code == E.EXIT_MEMORY_LEFT
    assert any(d.kind is Kind.DRIVER_LEAK and "2048 MiB" in d.problem for d in r.diagnosis), r.diagnosis
    assert Kind.NEIGHBOUR in _kinds(r)


def test_holder_seen_gone_after_sigterm_but_still_there_gets_sigkill(node):
    """A holder that looked gone after SIGTERM but is still listed (a multi-threaded process mid-exit) is not
    taken for a SIGKILL survivor: it gets SIGKILL, and the reset ends clean."""
    clock, host, probe, _ = node
    p = host.add(129, minors={0})
    probe.context(0, 1024, p)
    real_alive = host.alive
    host.alive = lambda ident: False if ident.pid == p.pid and not host.signals[1:] else real_alive(ident)  # flicker: "gone" after SIGTERM
    p.on_term = "ignore"
    r = run(node, grace=3.0)
    assert r.exit_code == 0, r.diagnosis
    assert host.signals == [(p.pid, "SIGTERM"), (p.pid, "SIGKILL")] and r.elapsed < 3.0


# -- the target is judged on its own memory (issue 14.3) ------------------------------------------------

def test_existing_leak_never_stops_the_target(node):
    """2 GiB were leaked before the reset (no pid listed, never the target's): the target's own memory comes back,
    so the reset is clean (exit 0), nothing is stopped, and the diagnosis names the leftover as someone else's."""
    _, host, probe, pve = node
    probe.leak[0] = 2048 * MIB
    p = host.add(129, minors={0})
    probe.context(0, 4096, p)
    r = run(node, timeout=1.0)
    assert (r.outcome, r.exit_code) == ("clean", E.EXIT_OK) and pve.calls == [] and not r.left_stopped
    assert Kind.FOREIGN_LEFTOVER in _kinds(r)


def test_neighbours_hidden_context_never_stops_the_target(node):
    """A dead pid listed with 1 GiB that no heir explains and that was never the target's: the target is clean of
    its own memory, not stopped; the diagnosis names the ghost as another's."""
    _, host, probe, pve = node
    gone = host.add(130, minors={0})
    probe.context(0, 1024, gone, pinned=True)
    del host.procs[gone.pid]
    probe.context(0, 2048, host.add(129, minors={0}))
    r = run(node, timeout=1.0)
    assert (r.outcome, r.exit_code) == ("clean", E.EXIT_OK) and pve.calls == []
    assert r.after[0].unexplained_ghosts == [gone.pid]
    assert any(d.kind is Kind.UNEXPLAINED_GHOST and f"pid {gone.pid}" in d.problem for d in r.diagnosis)


def test_targets_own_ghost_is_its_leftover_and_a_restart_may_help(node):
    """The target's job is listed, then dies while its context lives on (an fd in flight): that ghost was the
    target's at the first reading, so the reset is not clean by itself and the restart runs (the stop frees it)."""
    _, host, probe, pve = node
    p = host.add(129, minors={0})
    ctx = probe.context(0, 4096, p, pinned=True)
    real_stop = pve._stop_now
    pve._stop_now = lambda vmid: (real_stop(vmid), setattr(ctx, "pinned", False))  # the CT's stop closes the socket
    r = run(node, timeout=1.0)
    assert pve.calls[:1] == ["stop 129"] and r.restarted and r.exit_code == E.EXIT_OK


def test_crowded_gpu_reset_is_clean_without_restart(node):
    """12 neighbours with one context each: the gap of 13 contexts exceeds 64 MiB, yet the target is clean once its
    own memory is back, with no restart."""
    _, host, probe, pve = node
    for vmid in range(131, 143):
        pve.add_ct(vmid)
        probe.context(0, 1024, host.add(vmid, minors={0}))
    probe.context(0, 4096, host.add(129, minors={0}))
    r = run(node, timeout=2.0)
    assert (r.outcome, r.exit_code) == ("clean", E.EXIT_OK) and pve.calls == [] and r.elapsed < 1.0
