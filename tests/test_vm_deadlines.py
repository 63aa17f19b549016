"""The VM reset's waits end by their deadlines, on an in-process fake VM (tests/vm_fakes.py) and a fake clock: every
wait is a Deadline on the Clock port, a silent agent is given up at task_timeout (said about once a second), a command
that never exits in the guest at its deadline, a holder that never goes and a slow guest within the waits' sum."""

from __future__ import annotations

import ast
import os

import pytest

from pvegpu.core import errors as E
from pvegpu.core.deadline import deadline_in
from pvegpu.testing import FakeClock
from pvegpu.vm.guest import AgentUnavailable, Guestside, GuestTimeout
from pvegpu.vm.reset import VmOutcome, VmPolicy, reset_vm
from tests.pvelike import REPO
from tests.vm_fakes import Clock, FakeVm


def test_vm_reset_computes_no_deadline_with_float_arithmetic():
    """vm/reset.py and vm/guest.py compute no deadline by hand (`monotonic() + x`, `x - monotonic()`): a Deadline does."""

    def is_now(node):
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "monotonic"

    for name in ("reset.py", "guest.py"):
        tree = ast.parse(open(os.path.join(REPO, "pvegpu", "vm", name), encoding="utf-8").read())
        bad = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.BinOp)
               and ((isinstance(n.op, ast.Add) and (is_now(n.left) or is_now(n.right))) or (isinstance(n.op, ast.Sub) and is_now(n.right)))]
        assert bad == [], (name, bad)


def test_agent_silent_after_the_reboot_is_given_up_at_task_timeout():
    """After the reboot the agent never answers: its pings stop at task_timeout exactly (never a 1 s pause past it)."""
    clock = FakeClock()
    vm = FakeVm(clock, kill_ignored=True)
    pings: list[float] = []

    def ping(g):
        pings.append(clock.t)
        raise AgentUnavailable("the guest agent of VM 200 does not answer", None)

    vm.agent_ping = ping
    pol = VmPolicy(grace=1, kill_wait=1, timeout=1, task_timeout=2.5)
    rep = reset_vm(200, vm, clock, pol)
    assert rep.outcome is VmOutcome.NOT_VERIFIED and rep.exit_code == E.EXIT_PVE and rep.restarted
    assert len(pings) >= 3 and pol.task_timeout - 1.0 < pings[-1] - pings[0] <= pol.task_timeout


def test_a_vm_reset_waiting_for_its_guest_agent_says_so_every_second():
    """A guest agent silent after the reboot is waited for with a progress line about once a second, never silently."""
    clock = FakeClock()
    vm = FakeVm(clock, kill_ignored=True)

    def ping(g):
        raise AgentUnavailable("the guest agent of VM 200 does not answer", None)

    vm.agent_ping = ping
    said: list[str] = []
    reset_vm(200, vm, clock, VmPolicy(grace=1, kill_wait=1, timeout=1, task_timeout=4.5), on_progress=said.append)
    lines = [t for t in said if "guest agent after the reboot" in t]
    assert len(lines) >= 3 and all(" of 4.5" in t for t in lines)


def test_every_command_in_the_guest_ends_by_its_deadline():
    """A command that never exits in the guest is given up at exec_timeout or the phase's earlier deadline, never later."""
    clock = FakeClock()
    vm = FakeVm(clock)
    vm.agent_exec_status = lambda g, pid: {"exited": 0}
    gs = Guestside(vm, vm.guest, clock, exec_timeout=3.0, poll=0.7)
    for phase, bound in ((None, 3.0), (1.25, 1.25), (10.0, 3.0)):
        t0 = clock.t
        with pytest.raises(GuestTimeout):
            gs.run(["true"], what="true", deadline=None if phase is None else deadline_in(clock, phase))
        assert bound - 0.7 < clock.t - t0 <= bound + 1e-9


def test_a_holder_that_never_goes_ends_the_vm_reset_by_its_deadlines():
    """A guest holder that ignores every signal, --no-restart: done within grace + kill_wait + timeout; exit 6."""
    clock = FakeClock()
    vm = FakeVm(clock, kill_ignored=True)
    pol = VmPolicy(restart=False, grace=1.5, kill_wait=1.0, timeout=2.0, poll=0.3)
    rep = reset_vm(200, vm, clock, pol)
    assert rep.exit_code == E.EXIT_HOLDERS_LEFT
    assert pol.timeout <= rep.elapsed <= pol.grace + pol.kill_wait + pol.timeout + 0.01, rep.elapsed


def test_deadlines_hold_with_a_slow_guest():
    """Each command takes 9 s, a holder never goes, --no-restart: done within grace + kill_wait + timeout + two looks; exit 6."""
    clock = Clock()
    vm = FakeVm(clock, kill_ignored=True, exec_cost=9.0)
    pol = VmPolicy(restart=False)
    progress: list[str] = []
    rep = reset_vm(200, vm, clock, pol, on_progress=progress.append)
    assert rep.elapsed <= pol.grace + pol.kill_wait + pol.timeout + 2 * 3 * 9.0, rep.elapsed
    assert rep.exit_code == E.EXIT_HOLDERS_LEFT and progress
