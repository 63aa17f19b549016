"""Following a container's state (``reset.follow``): failed reads are readings, the deadline ends every wait."""

from __future__ import annotations

from pvegpu.core import errors as E
from pvegpu.core.model import CtStatus, Guest
from pvegpu.reset import Ports, ResetPolicy
from pvegpu.reset.follow import follow
from pvegpu.reset.run import ResetRun
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve


class _Pve(FakePve):
    def __init__(self, host, answers):
        super().__init__(host)
        self.answers = answers

    def ct_status(self, g):
        a = self.answers.pop(0) if self.answers else "unknown"
        if a == "fail":
            raise E.PveNoAnswer("no answer", "")
        return CtStatus(a)


def _run(answers):
    clock = FakeClock()
    host = FakeHost(clock)
    run = ResetRun(129, Ports(_Pve(host, answers), FakeProbe(host), host, clock), ResetPolicy())
    run.located = type("L", (), {"guest": Guest(129, "lxc", "pve1")})()
    return clock, run


def test_follow_returns_the_decision_and_the_reading_that_made_it():
    """A failed read is a reading (state unknown, its error kept); the first reading judged decisive ends the wait."""
    clock, run = _run(["fail", "stopped", "running"])
    seen = []
    done, last = follow(run, lambda r: seen.append(r.state) or (r.state if r.state == "running" else None),
                        within=10, poll=0.5, waiting="w")
    assert done == "running" and seen == ["unknown", "stopped", "running"] and last is not None and last.at == clock.t


def test_follow_ends_at_its_deadline_with_the_last_reading():
    """Nothing decisive: the wait ends within its bound, after a read, and says no decision was made."""
    clock, run = _run(["fail"] * 100)
    t0 = clock.t
    done, last = follow(run, lambda r: None, within=2.0, poll=0.5, waiting="w")
    assert done is None and last is not None and last.error and 2.0 <= clock.t - t0 <= 2.5
