"""Open review findings: the postinst's storage probes under a deadline, the wording before a guest is located,
the VM reset's waits on Deadline, and reset's and demo's human output in 80 columns."""

from __future__ import annotations

import json
import os
import signal

import pytest

from pvegpu import frontdoor, wiring
from pvegpu.model import Guest

# -- wording before the guest is located ---------------------------------------------------------------------


def _interrupted_reset(monkeypatch, capsys, guest, where_signal=False):
    """`pvegpu reset 129 --json` with a SIGINT in where() (``where_signal``) or, once located, as the lock is taken."""

    class Pve:
        def where(self, vmid):
            if where_signal:
                os.kill(os.getpid(), signal.SIGINT)
            return guest

    def lock(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the handler raises at the signal")

    journal: list[str] = []
    monkeypatch.setattr(wiring, "world", lambda s: type("W", (), {"pve": Pve()})())
    monkeypatch.setattr(wiring, "ct_lock", lock)
    monkeypatch.setattr(wiring, "vm_api", lambda s: None)
    monkeypatch.setattr(wiring, "journal_line", journal.append)
    code = frontdoor.main(["reset", "129", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 130 and doc["schema"] == "pvegpu-error" and doc["exit_code"] == 130
    assert journal == [doc["error"]]
    return doc["error"]


def test_a_signal_before_the_guest_is_located_says_guest_not_ct(monkeypatch, capsys):
    """SIGINT while the guest is being located (it is a VM): the error and the journal say "guest 129", never "CT 129"."""
    msg = _interrupted_reset(monkeypatch, capsys, Guest(129, "pve1", "qemu"), where_signal=True)
    assert "guest 129" in msg and "CT 129" not in msg and "VM 129" not in msg and "not stopped" in msg


@pytest.mark.parametrize(("type_", "word", "other"), [("lxc", "CT", "VM"), ("qemu", "VM", "CT")])
def test_a_signal_once_the_guest_is_located_uses_its_kind(monkeypatch, capsys, type_, word, other):
    """SIGINT after the guest was located (before any stop): the wording is the guest's kind, CT or VM."""
    msg = _interrupted_reset(monkeypatch, capsys, Guest(129, "pve1", type_))
    assert f"{word} 129" in msg and f"{other} 129" not in msg and "guest 129 was" not in msg and "not stopped" in msg


# -- the VM reset's waits: Deadline on the Clock port --------------------------------------------------------


def test_vm_reset_computes_no_deadline_with_float_arithmetic():
    """vmreset.py and vmguest.py hold no `monotonic() + x` nor `x - monotonic()` (a deadline or the time left by
    hand): every wait there is a Deadline on the Clock port (a duration, `monotonic() - t0`, is fine)."""
    import ast

    from tests.pvelike import REPO

    def is_now(node):
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "monotonic"

    for name in ("vmreset.py", "vmguest.py"):
        tree = ast.parse(open(os.path.join(REPO, "pvegpu", name), encoding="utf-8").read())
        bad = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.BinOp)
               and ((isinstance(n.op, ast.Add) and (is_now(n.left) or is_now(n.right))) or (isinstance(n.op, ast.Sub) and is_now(n.right)))]
        assert bad == [], (name, bad)


def test_agent_silent_after_the_reboot_is_given_up_at_task_timeout():
    """After the reboot the agent never answers: its pings stop at task_timeout exactly (never a 1 s pause past it)."""
    from pvegpu import errors as E
    from pvegpu.testing import FakeClock
    from pvegpu.vmguest import AgentUnavailable
    from pvegpu.vmreset import VmOutcome, VmPolicy, reset_vm
    from tests.test_review_vm import FakeVm

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


def test_every_command_in_the_guest_ends_by_its_deadline():
    """A command that never exits in the guest: given up at exec_timeout, or at the phase's deadline when that
    comes first, on the clock (GuestTimeout), never later."""
    from pvegpu.deadline import deadline_in
    from pvegpu.testing import FakeClock
    from pvegpu.vmguest import GuestTimeout, Guestside
    from tests.test_review_vm import FakeVm

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
    """A guest holder that ignores every signal, --no-restart: the waits (grace, kill_wait, the verify timeout)
    end by their deadlines on the fake clock, so the reset takes no more than their sum; exit 6."""
    from pvegpu import errors as E
    from pvegpu.testing import FakeClock
    from pvegpu.vmreset import VmPolicy, reset_vm
    from tests.test_review_vm import FakeVm

    clock = FakeClock()
    vm = FakeVm(clock, kill_ignored=True)
    pol = VmPolicy(restart=False, grace=1.5, kill_wait=1.0, timeout=2.0, poll=0.3)
    rep = reset_vm(200, vm, clock, pol)
    assert rep.exit_code == E.EXIT_HOLDERS_LEFT
    assert pol.timeout <= rep.elapsed <= pol.grace + pol.kill_wait + pol.timeout + 0.01, rep.elapsed
