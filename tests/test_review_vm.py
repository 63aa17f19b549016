"""A review's findings on the VM reset (pvegpu/vm/reset.py): a VM stopped by its admin, a 403 on agent/exec, a paused
VM, signals, SIGKILL to respawns and a slow guest; with an in-process fake VmApi and a fake clock, and through the
real command line against fakepve (tests/test_vm_agent.py's fixture)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from fakepve.model import PveError

from pvegpu.core import errors as E
from pvegpu.core.model import Guest, TaskResult
from pvegpu.vm.guest import KILL_SCRIPT, NVSMI_APPS, NVSMI_GPUS, SCAN_SCRIPT, AgentForbidden, AgentUnavailable
from pvegpu.vm.reset import VmOutcome, VmPolicy, reset_vm
from tests import test_vm_agent as agent_tests
from tests.test_faults import REPO

api = agent_tests.api  # the fakepve fixture: (fakepve, add(vm), config(**reset))
POWER = {"shutdown", "stop", "start"}


class Clock:
    def __init__(self):
        self.t = 0.0

    def monotonic(self):
        return self.t

    def sleep(self, s):
        self.t += max(s, 0.001)


class FakeVm:
    """A running VM 200 whose guest shows pid 4242 holding the GPU (fd+maps); knobs for faults."""

    def __init__(self, clock, *, status=None, exec_error=None, holder_line="holder 4242 777 fd,maps python3", exec_cost=0.0,
                 kill_ignored=False):
        self.clock, self.calls = clock, []
        self.status = status or {"status": "running"}
        self.exec_error, self.holder_line, self.exec_cost, self.kill_ignored = exec_error, holder_line, exec_cost, kill_ignored
        self.execs, self.n, self.alive = {}, 0, True
        self.guest = Guest(200, "pve1", "qemu")

    def where(self, vmid):
        return self.guest

    def vm_config(self, g):
        return {"hostpci0": "0000:41:00.0,pcie=1", "agent": "1", "ostype": "l26"}

    def vm_status(self, g):
        return dict(self.status)

    def agent_ping(self, g):
        self.calls.append("ping")

    def agent_exec(self, g, argv):
        self.calls.append(("exec", argv[0] if argv[0] != "sh" else argv[3]))
        if self.exec_error:
            raise self.exec_error
        self.n += 1
        self.execs[self.n] = list(argv)
        return self.n

    def agent_exec_status(self, g, pid):
        self.clock.t += self.exec_cost
        argv = self.execs[pid]
        if tuple(argv) == NVSMI_APPS:
            return {"exited": 1, "exitcode": 0, "out-data": "4242, 1024\n" if self.alive else ""}
        if tuple(argv) == NVSMI_GPUS:
            return {"exited": 1, "exitcode": 0, "out-data": "0, 00000000:01:00.0, 1024\n"}
        if argv[:3] == ["sh", "-c", SCAN_SCRIPT]:
            return {"exited": 1, "exitcode": 0, "out-data": (self.holder_line + "\n" if self.alive else "") + "scan-done\n"}
        if argv[:3] == ["sh", "-c", KILL_SCRIPT]:
            if not self.kill_ignored:
                self.alive = False
            return {"exited": 1, "exitcode": 0, "out-data": "sent 4242\nkill-done\n"}
        raise AssertionError(argv)

    def _power(self, what, state):
        self.calls.append(what)
        self.status["status"] = state
        return f"UPID:{what}"

    def vm_shutdown(self, g, timeout):
        return self._power("shutdown", "stopped")

    def vm_stop(self, g):
        return self._power("stop", "stopped")

    def vm_start(self, g):
        return self._power("start", "running")

    def wait_task(self, node, upid, *, timeout, what):
        return TaskResult(upid, "OK")


def _power(vm):
    return POWER & {c for c in vm.calls if isinstance(c, str)}


# -- 1: a VM its admin stopped is left alone ----------------------------------------------------------------


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


def test_cli_vm_stopped_by_its_admin_mid_reset_is_left_stopped(api):
    """Through fakepve: the VM is stopped during pvegpu's first exec: exit 0 'not running', the VM stays stopped."""
    fake, add, config = api
    inner = agent_tests.scripted()

    def answers(vm, command, values):
        if command == "exec" and vm.status == "running" and vm.started_at == vm.first_start:
            vm.status = vm.qmpstatus = "stopped"
            raise PveError(500, "VM 200 not running")
        return inner(vm, command, values)

    v = add(answers=answers)
    r = agent_tests.run(config())
    assert r.rc == 0 and r.report["outcome"] == "not running" and v.status == "stopped", (r.rc, r.report["steps"])
    assert not [s for s in r.report["steps"] if s["name"] == "restart"]


# -- 2: a 403 (or another API error) is not a reason to reboot -------------------------------------------------


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


def test_cli_forbidden_exec_does_not_reboot_the_vm(api):
    """fakepve answers agent/exec with PVE's 403: exit 4, no restart step, the VM is not rebooted."""
    fake, add, config = api
    inner = agent_tests.scripted()

    def answers(vm, command, values):
        if command == "exec":
            raise PveError(403, "Permission check failed (/vms/200, VM.GuestAgent.Unrestricted)")
        return inner(vm, command, values)

    v = add(answers=answers)
    r = agent_tests.run(config())
    assert r.rc == 4 and not [s for s in r.report["steps"] if s["name"] == "restart"], (r.rc, r.report["steps"])
    assert v.started_at == v.first_start and v.status == "running"


# -- 3: a paused VM is refused ---------------------------------------------------------------------------------


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


def test_cli_paused_vm_is_not_stopped(api):
    """Through fakepve: a paused VM whose agent hangs: exit 4 at once, no restart step, the VM stays paused."""
    fake, add, config = api
    v = add(qmpstatus="paused", agent_hangs=True)
    r = agent_tests.run(config())
    assert r.rc == 4 and not [s for s in r.report["steps"] if s["name"] == "restart"], (r.rc, r.report["steps"])
    assert v.qmpstatus == "paused" and r.wall < 10


# -- 4: signals as for a container -----------------------------------------------------------------------------


def _reset_signalled(config, sends):
    """Run `pvegpu reset 200` (human output); ``sends``: (line fragment, signal) pairs, each sent once its line shows."""
    p = subprocess.Popen([sys.executable, "-m", "pvegpu", "--config", config, "reset", "200"], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    seen, todo = [], list(sends)
    assert p.stdout is not None
    for line in p.stdout:
        seen.append(line)
        if todo and todo[0][0] in line:
            time.sleep(0.1)
            p.send_signal(todo.pop(0)[1])
            if not todo:
                break
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    return p.returncode, "".join(seen) + out, err


def test_cli_sigint_during_the_reboot_finishes_it_and_exits_130(api):
    """SIGINT after the shutdown request: the reboot is finished, the report says interrupted, exit 130, the VM runs."""
    fake, add, config = api
    v = add(shutdown_secs=0.5, start_secs=1)
    rc, out, err = _reset_signalled(config(), [("shutting VM 200 down", signal.SIGINT)])
    assert rc == 130 and "[interrupted]" in out and v.status == "running", (rc, out[-800:], err[-800:])


def test_cli_second_signal_abandons_the_reboot(api):
    """A second signal (during the start) abandons the reboot: exit 130 and the report still comes, naming where the VM is."""
    fake, add, config = api
    add(shutdown_secs=0.5, start_secs=3)
    rc, out, err = _reset_signalled(config(), [("shutting VM 200 down", signal.SIGINT), ("starting it", signal.SIGINT)])
    assert rc == 130 and "[interrupted]" in out and "VM 200:" in out, (rc, out[-800:], err[-800:])


def test_cli_sigterm_before_any_power_action_leaves_the_vm_running(api):
    """SIGTERM while pvegpu still works inside the guest: exit 143 at once, the VM never shut down."""
    fake, add, config = api
    v = add()
    rc, out, err = _reset_signalled(config(grace=5), [("SIGTERM →", signal.SIGTERM)])
    assert rc == 143 and "[restart]" not in out and v.status == "running" and v.started_at == v.first_start, (rc, out, err)


# -- 5: SIGKILL only to the survivors of SIGTERM -----------------------------------------------------------------


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


# -- 6: deadlines with a slow guest -----------------------------------------------------------------------------


def test_deadlines_hold_with_a_slow_guest():
    """Each command takes 9 s, a holder never goes, --no-restart: done within grace + kill_wait + timeout + two looks; exit 6."""
    clock = Clock()
    vm = FakeVm(clock, kill_ignored=True, exec_cost=9.0)
    pol = VmPolicy(restart=False)
    progress: list[str] = []
    rep = reset_vm(200, vm, clock, pol, on_progress=progress.append)
    assert rep.elapsed <= pol.grace + pol.kill_wait + pol.timeout + 2 * 3 * 9.0, rep.elapsed
    assert rep.exit_code == E.EXIT_HOLDERS_LEFT and progress
