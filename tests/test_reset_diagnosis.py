"""The reset diagnosis's closed vocabulary: every ``Kind`` comes out of one situation, and its wording is tested
here, once per kind (other tests assert kinds). Neighbours are information, never a problem with an action."""

from __future__ import annotations

import pytest

from pvegpu.cli.render import reset_human, reset_json
from pvegpu.core import errors as E
from pvegpu.core.holders import GpuFacts
from pvegpu.core.leftover import LeftoverRule
from pvegpu.core.model import MIB, GpuInfo, GpuSample, Holder, Place, Placement, ProcIdentity, ProcInfo
from pvegpu.core.ports import NoInterrupts, NullLockPort
from pvegpu.reset import Diagnosis, Kind, Ports, ResetPolicy, reset
from pvegpu.reset.diagnosis import diagnose, diagnose_respawns, diagnose_unsettled
from pvegpu.reset.vocab import Respawn
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve

GPU = GpuInfo(0, 0, "GPU-0", "0000:01:00.0")
RULE = LeftoverRule()


def _node():
    clock = FakeClock()
    host = FakeHost(clock)
    probe, pve = FakeProbe(host), FakePve(host)
    pve.add_ct(129)
    pve.add_ct(130)
    host.add(129, init=True, comm="init")
    host.add(130, init=True, comm="init")
    return clock, host, probe, pve


def _run(n, lock=None, interrupts=None, **policy):
    clock, host, probe, pve = n
    ports = Ports(pve, probe, host, clock, lock=lock or NullLockPort(), interrupts=interrupts or NoInterrupts())
    return reset(129, ports, ResetPolicy(**policy)).diagnosis


def _leak(n, vmid=129, mib=1024, **kw):
    _, host, probe, _ = n
    p = host.add(vmid, minors={0}, **kw)
    probe.context(0, mib, p, leaks=True)
    return p


def _init_holds(n):
    _, host, probe, _ = n
    init = next(p for p in host.procs.values() if p.init and p.vmid == 129)
    init.minors = {0}
    probe.context(0, 700, init)


def _holder(pid, vmid):
    info = ProcInfo(ProcIdentity(pid, pid), "python3", "S", Placement(Place.CONTAINER, vmid), "/", 7)
    return Holder(info, frozenset({0}), frozenset({"fd", "maps", "nvml"}))


def _facts(**kw):
    used = kw.pop("used", 0)
    return {0: GpuFacts(GPU, GpuSample(0, used, []), **kw)}


def gpu_unreadable():
    n = _node()
    n[2].fail.add(0)
    _leak(n)
    return _run(n, restart=False, timeout=0.5)


def holder_left():
    n = _node()
    p = n[1].add(129, minors={0}, respawn={})
    n[2].context(0, 1024, p)
    return _run(n, rounds=1, restart=False, timeout=1.0)


def stuck():
    n = _node()
    p = n[1].add(129, minors={0}, state="D")
    n[2].context(0, 1024, p)
    return _run(n, restart=False, timeout=0.5)


def init_holds():
    n = _node()
    _init_holds(n)
    return _run(n, restart=False, timeout=0.5)


def driver_leak():
    n = _node()
    _leak(n)
    return _run(n, restart=False, timeout=0.5)


def held_stopped():
    n = _node()
    _init_holds(n)
    _leak(n)
    return _run(n, timeout=1.0)


def left_stopped():
    n = _node()
    _init_holds(n)
    n[3].status[129]["stop_secs"] = 12
    return _run(n, timeout=1.0, task_timeout=10, state_wait=5)


def may_stop():
    n = _node()
    _init_holds(n)
    n[3].status[129]["stop_secs"] = 1000
    return _run(n, timeout=1.0, task_timeout=10, state_wait=5)


def state_unknown():
    n = _node()
    _init_holds(n)
    pve = n[3]
    pve.status[129]["ha"] = True
    stop = pve.ct_stop

    def ct_stop(g):
        upid = stop(g)
        pve.broken["ct_status"] = -1
        return upid

    pve.ct_stop = ct_stop
    return _run(n, timeout=1.0, task_timeout=10, state_wait=5)


def restart_failed():
    n = _node()
    n[3].status[129]["lock"] = "backup"
    _leak(n)
    return _run(n, timeout=0.5)


def task_log():
    n = _node()
    _init_holds(n)
    n[3].status[129]["start_error"] = "hookscript error for 129 on pre-start: exit code 10"
    return _run(n, timeout=1.0)


class _Earlier(NullLockPort):
    def earlier(self):
        return "an earlier pvegpu reset of CT 129 asked for its stop and ended before it ran again"


def earlier_stop():
    n = _node()
    n[3].status[129]["status"] = "stopped"
    return _run(n, lock=_Earlier(), dry_run=True)


class _Signalled(NoInterrupts):
    def received(self):
        return ("SIGTERM", 143)


def interrupted():
    n = _node()
    _init_holds(n)
    return _run(n, interrupts=_Signalled(), timeout=1.0)


CASES = {
    Kind.GPU_UNREADABLE: (gpu_unreadable, "could not be read"),
    Kind.HOLDER_LEFT: (holder_left, "still holds"),
    Kind.STUCK_IN_DRIVER: (stuck, "stuck in the driver (state D)"),
    Kind.INIT_HOLDS: (init_holds, "pvegpu never signals a container's init"),
    Kind.FDS_UNREADABLE: (lambda: diagnose(129, _facts(unreadable=[4321]), RULE), "could not read the open files of pid 4321"),
    Kind.NEIGHBOUR: (lambda: diagnose(129, _facts(other_holders=[_holder(4322, 130)]), RULE), "is also used by pid 4322"),
    Kind.TARGET_GHOST: (lambda: diagnose(129, _facts(ghosts=[4323], target_ghosts=[4323]), RULE), "its context lives on"),
    Kind.DRIVER_LEAK: (driver_leak, "a driver-level leak"),
    Kind.UNMEASURABLE: (lambda: diagnose(129, _facts(foreign_bytes=None), RULE), "cannot be measured"),
    Kind.UNEXPLAINED_GHOST: (lambda: diagnose(129, _facts(ghosts=[4324]), RULE), "was never CT 129's"),
    Kind.FOREIGN_GHOST: (lambda: diagnose(129, _facts(ghosts=[4325], foreign_ghosts=[4325]), RULE), "was alive outside CT 129"),
    Kind.FOREIGN_LEFTOVER: (lambda: diagnose(129, _facts(used=4096 * MIB, baseline_bytes=4096 * MIB), RULE),
                            "it was there before this reset"),
    Kind.RESPAWNED: (lambda: diagnose_respawns(129, [Respawn(4326, 7, "w", 1, 77, "supervisord", False, "pid 77 (supervisord)")]),
                     "were started again by pid 77 (supervisord)"),
    Kind.TIMEOUT_TOO_SHORT: (lambda: [diagnose_unsettled(1.0, 0.5)], "is not longer than settle"),
    Kind.UNSETTLED: (lambda: [diagnose_unsettled(0.25, 5.0)], "less than 0.25 s before"),
    Kind.HELD_STOPPED: (held_stopped, "not verified clean even with the container stopped"),
    Kind.LEFT_STOPPED: (left_stopped, "was left STOPPED"),
    Kind.MAY_STOP: (may_stop, "may stop it at any moment"),
    Kind.STATE_UNKNOWN: (state_unknown, "could not be read after pvegpu asked for its stop"),
    Kind.RESTART_FAILED: (restart_failed, "is locked (backup)"),
    Kind.TASK_LOG: (task_log, "the task's log ends with"),
    Kind.EARLIER_STOP: (earlier_stop, "is STOPPED now"),
    Kind.INTERRUPTED: (interrupted, "interrupted by SIGTERM"),
}


def test_every_kind_has_a_case():
    """The vocabulary is closed: each kind below comes from a situation of its own."""
    assert set(CASES) == set(Kind)


@pytest.mark.parametrize("kind", list(CASES), ids=str)
def test_wording_once_per_kind(kind):
    """The situation yields a line of this kind, worded for the admin (and an action unless it is information)."""
    make, words = CASES[kind]
    lines = [d for d in make() if d.kind is kind]
    assert lines, kind
    assert any(words in d.problem for d in lines), [d.problem for d in lines]
    assert all(bool(d.action) is not d.info for d in lines)


def test_a_neighbour_is_information_not_a_problem():
    """A neighbour on the GPU is a note in the human output and `info` in the JSON, with no action, and it
    leaves the exit code as the target's own memory decides."""
    n = _node()
    _, host, probe, _ = n
    other = host.add(130, minors={0})
    probe.context(0, 1024, other)
    _leak(n)
    clock, host, probe, pve = n
    r = reset(129, Ports(pve, probe, host, clock), ResetPolicy(restart=False, timeout=0.5))
    assert r.exit_code == E.EXIT_MEMORY_LEFT
    d = next(d for d in r.diagnosis if d.kind is Kind.NEIGHBOUR)
    assert d.info and d.action == "" and isinstance(d, Diagnosis)
    assert f"note: GPU minor 0 is also used by pid {other.pid}" in reset_human(r)
    j = next(x for x in reset_json(r)["diagnosis"] if x["kind"] == "neighbour")
    assert j["info"] is True and set(j) >= {"problem", "action"}
