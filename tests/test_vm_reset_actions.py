"""What a VM reset does, on an in-process fake VM (tests/vm_fakes.py) and a fake clock: no power action for a VM its
admin stopped, for a 403 or another API error on agent/exec, or for a paused VM; the reboot path for an agent that
does not answer; SIGKILL only to processes that had SIGTERM; a VM waiting for its reset lock is named a VM."""

from __future__ import annotations

import pytest

from pvegpu.adapters.locks import ct_lock
from pvegpu.cli import reset as resetcmd
from pvegpu.core import errors as E
from pvegpu.vm.guest import KILL_SCRIPT, AgentForbidden, AgentUnavailable
from pvegpu.vm.reset import VmOutcome, VmPolicy, reset_vm
from tests.vm_fakes import Clock, FakeVm
from tests.vm_fakes import power_calls as _power

# -- a VM its admin stopped is left alone --------------------------------------------------------------------


def test_vm_stopped_by_its_admin_mid_reset_is_left_alone():
    """The VM is stopped while pvegpu looks inside (exec: 'VM 200 not running'): exit 0 'not running', no power action."""
    clock = Clock()
    vm = FakeVm(clock)

    def exec_(g, argv):
        vm.status["status"] = "stopped"
        raise E.PveApiError("run nvidia-smi in VM 200: 500 VM 200 not running", "")

    vm.agent_exec = exec_
    rep = reset_vm(200, vm, clock, VmPolicy())
    assert rep.outcome is VmOutcome.NOT_RUNNING and rep.exit_code == E.EXIT_OK and not _power(vm), vm.calls


def test_shutdown_refused_for_a_vm_already_down_is_not_followed_by_stop_or_start():
    """The admin stops the VM between pvegpu's status read and its shutdown request (refused): exit 0, no stop, no start."""
    clock = Clock()
    vm = FakeVm(clock, kill_ignored=True)

    def shutdown(g, timeout):
        vm.calls.append("shutdown")
        vm.status["status"] = "stopped"
        raise E.PveApiError("shut VM 200 down: 500 VM 200 not running", "")

    vm.vm_shutdown = shutdown
    rep = reset_vm(200, vm, clock, VmPolicy(grace=0.5, kill_wait=0.5, timeout=0.5))
    assert rep.outcome is VmOutcome.NOT_RUNNING and rep.exit_code == E.EXIT_OK and _power(vm) == {"shutdown"}, vm.calls


# -- a 403 (or another API error) is not a reason to reboot ----------------------------------------------------


def test_forbidden_agent_exec_is_exit_4_without_a_power_action():
    """exec answers 403 (no VM.GuestAgent.Unrestricted): exit 4, not verified, no shutdown/stop/start."""
    clock = Clock()
    vm = FakeVm(clock, exec_error=AgentForbidden("the API token may not use the guest agent of VM 200 (403)", ""))
    rep = reset_vm(200, vm, clock, VmPolicy())
    assert rep.exit_code == E.EXIT_PVE and rep.outcome is VmOutcome.NOT_VERIFIED and not _power(vm), vm.calls


def test_other_api_error_on_exec_is_exit_4_without_a_power_action():
    """Any API error on exec that is not 'the agent does not answer' (a plain 500): exit 4, no power action."""
    clock = Clock()
    vm = FakeVm(clock, exec_error=E.PveApiError("run nvidia-smi in VM 200: 500 something else", ""))
    rep = reset_vm(200, vm, clock, VmPolicy())
    assert rep.exit_code == E.EXIT_PVE and not _power(vm), vm.calls


def test_agent_that_does_not_answer_still_takes_the_reboot_path():
    """An agent configured but not answering (the VM running): the reboot path, as before."""
    clock = Clock()
    vm = FakeVm(clock, exec_error=AgentUnavailable("the guest agent of VM 200 does not answer", ""))
    reset_vm(200, vm, clock, VmPolicy(task_timeout=2))
    assert {"shutdown", "start"} <= _power(vm), vm.calls


# -- a paused VM is refused ---------------------------------------------------------------------------------


def test_paused_vm_is_refused_without_a_look_or_a_power_action():
    """status running, qmpstatus paused: exit 4 (resume it first), nothing run in the guest, no power action."""
    clock = Clock()
    vm = FakeVm(clock, status={"status": "running", "qmpstatus": "paused"})
    rep = reset_vm(200, vm, clock, VmPolicy())
    assert rep.exit_code == E.EXIT_PVE and not vm.calls, vm.calls


def test_vm_paused_mid_reset_is_not_stopped():
    """The VM is paused while pvegpu looks (its agent stops answering): exit 4, no power action."""
    clock = Clock()
    vm = FakeVm(clock)

    def exec_(g, argv):
        vm.status["qmpstatus"] = "paused"
        raise AgentUnavailable("the guest agent of VM 200 does not answer (got timeout)", "")

    vm.agent_exec = exec_
    rep = reset_vm(200, vm, clock, VmPolicy())
    assert rep.exit_code == E.EXIT_PVE and not _power(vm), vm.calls


# -- SIGKILL only to the survivors of SIGTERM -----------------------------------------------------------------


def test_sigkill_only_to_processes_that_got_sigterm():
    """A holder that appears after the SIGTERM (a respawn) gets its own SIGTERM first, never a SIGKILL straight away."""
    clock = Clock()
    vm = FakeVm(clock, kill_ignored=True)
    n = {"k": 0}
    orig = vm.agent_exec_status

    def status(g, pid):
        argv = vm.execs[pid]
        if argv[:3] == ["sh", "-c", KILL_SCRIPT]:
            n["k"] += 1
            vm.holder_line = "holder 5555 999 fd,maps python3"  # after the TERM: pid 4242 gone, 5555 respawned
            return {"exited": 1, "exitcode": 0, "out-data": "sent 4242\nkill-done\n" if n["k"] == 1 else "sent 5555\nkill-done\n"}
        return orig(g, pid)

    vm.agent_exec_status = status
    rep = reset_vm(200, vm, clock, VmPolicy(restart=False, grace=1, kill_wait=1, timeout=1))
    sig = [(s["pid"], s["signal"]) for s in rep.signalled]
    assert sig == [(4242, "SIGTERM"), (5555, "SIGTERM"), (5555, "SIGKILL")], sig
    assert any(s.name == "respawn" for s in rep.steps) and rep.exit_code == E.EXIT_HOLDERS_LEFT


# -- the reset lock ----------------------------------------------------------------------------------------


def test_a_vm_waiting_for_its_reset_lock_is_named_a_vm(tmp_path):
    """Another reset of VM 200 holds the lock: the busy error (exit 9) names VM 200, never CT 200."""
    locks = str(tmp_path / "locks")
    s = type("S", (), {"reset": type("R", (), {"lock_dir": locks, "lock_wait": 0.2})()})()
    with ct_lock(locks, 200, 0), resetcmd._Signals(200, "VM") as sigs, pytest.raises(E.BusyError) as err:
        resetcmd._vm_reset(s, 200, sigs, dry_run=False, json_out=True, verbose=False)
    assert err.value.exit_code == E.EXIT_BUSY and "VM 200" in err.value.message and "CT 200" not in err.value.message
