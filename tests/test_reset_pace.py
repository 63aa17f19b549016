"""The pacing of reset's waits after the signals, on a fake clock: fast while the release is awaited and readings
are cheap, the settle window closed as soon as the rule allows, and every safety rule of verify unchanged."""

from __future__ import annotations

import pytest

from pvegpu.core import errors as E
from pvegpu.core.model import MIB
from pvegpu.reset import Ports, ResetPolicy, reset
from pvegpu.reset.poll import Pace
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve

SETTLE, POLL, FAST = 0.25, 0.02, 0.005


@pytest.fixture
def node():
    """CT 129 with its init on a fake node (clock, host, NVML on the driver model, PVE)."""
    clock = FakeClock()
    host = FakeHost(clock)
    probe = FakeProbe(host)
    pve = FakePve(host)
    pve.add_ct(129)
    host.add(129, init=True, comm="init")
    return clock, host, probe, pve




def _readings(node):
    """Record (start, end) of every GPU reading on the fake clock."""
    clock, _, probe, _ = node
    reads: list[tuple[float, float]] = []
    sample = probe.sample

    def timed(minors):
        t = clock.t
        out = sample(minors)
        reads.append((t, clock.t))
        return out

    probe.sample = timed
    return reads


def _memory(node, spans, exit_delay=0.1):
    """CT 129's holder (exits ``exit_delay`` after SIGTERM) leaves its 2 GiB behind until the first fake time in
    ``spans``; ``spans`` alternates: memory back at spans[0], left again at spans[1], back at spans[2]... (seconds
    after the reset began). Returns the fake time the reset begins."""
    clock, host, probe, _ = node
    probe.model.release_latency = 0.0  # the memory's return is set by ``spans``, not the driver model
    p = host.add(129, minors={0}, exit_delay=exit_delay)
    probe.context(0, 2048, p, leaks=True)
    t0 = clock.t
    marks = [t0 + s for s in spans]

    def tick(t):
        back = sum(1 for m in marks if t >= m) % 2 == 1  # odd number of marks passed: memory back
        if back:
            probe.leak.pop(0, None)
        elif probe.leak.get(0) is None and sum(1 for m in marks if t >= m):
            probe.leak[0] = 2048 * MIB

    clock.listeners.append(tick)
    return t0


def _run(node, **policy):
    clock, host, probe, pve = node
    return reset(129, Ports(pve, probe, host, clock), ResetPolicy(**{"settle": SETTLE, "poll": POLL, "restart": False, **policy}))


def _first_clean(reads, back_at):
    return next(r for r in reads if r[0] >= back_at)


def test_pace_is_fast_while_cheap_then_poll():
    """Pace: ``fast`` early, never shorter than the last reading's cost, never longer than poll, poll after fast_for."""
    clock = FakeClock()
    pace = Pace(clock, POLL, FAST, 0.5)
    assert pace.after(0.0) == FAST and pace.after(0.012) == 0.012 and pace.after(0.2) == POLL
    clock.t += 0.5
    assert pace.after(0.0) == POLL
    assert Pace(clock, 0.002, FAST, 0.5).after(0.0) == 0.002  # a poll shorter than fast wins


@pytest.mark.parametrize("offset", [0.0, 0.004, 0.008, 0.012, 0.016])
def test_release_is_seen_within_one_fast_poll(node, offset):
    """Memory back at any moment of the first half second is seen by a reading at most 5 ms later (cheap readings)."""
    reads = _readings(node)
    t0 = _memory(node, [0.2 + offset])
    r = _run(node)
    assert (r.outcome, r.exit_code) == ("clean", 0)
    start, _ = _first_clean(reads, t0 + 0.2 + offset)
    assert start - (t0 + 0.2 + offset) <= FAST + 1e-9


@pytest.mark.parametrize("read_secs", [0.0, 0.003])
def test_verdict_comes_when_the_settle_window_ends(node, read_secs):
    """The reading that closes the window starts at the first clean reading's end + settle (no poll of overshoot),
    and it is the last reading of the reset."""
    reads = _readings(node)
    t0 = _memory(node, [0.3])
    node[2].read_secs = read_secs
    r = _run(node)
    assert r.exit_code == 0
    first = _first_clean(reads, t0 + 0.3)
    closing = reads[-1]
    assert closing[0] >= first[1] + SETTLE - 1e-9  # held for the whole window, counted from the end of a reading
    assert closing[0] - (first[1] + SETTLE) <= 0.002  # ... and not longer (fake sleeps are >= 1 ms)


def test_settle_window_is_still_read_every_poll(node):
    """While clean is settling, readings go on every poll (a respawn or returning memory is seen), no more often."""
    reads = _readings(node)
    t0 = _memory(node, [0.3])
    _run(node)
    first = _first_clean(reads, t0 + 0.3)
    during = [s for s, _ in reads if s >= first[0]]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(during) >= SETTLE / POLL and max(gaps) <= POLL + 1e-9 and min(gaps[:-1]) >= POLL - 1e-9


def _gaps_while_memory_held(node, read_secs: float) -> list[float]:
    """Time between reading starts while the memory is still held (0.45 s), each reading costing ``read_secs``."""
    reads = _readings(node)
    t0 = _memory(node, [0.45])
    node[2].read_secs = read_secs
    _run(node)
    before = [s for s, _ in reads if s < t0 + 0.45 and s > reads[0][1]]
    return [b - a for a, b in zip(before, before[1:])]


def test_readings_take_at_most_half_the_fast_phase(node):
    """A costly reading (12 ms: a crowded container) is followed by a pause at least as long: fast polls are bounded."""
    gaps = _gaps_while_memory_held(node, 0.012)
    assert gaps and min(gaps) >= 2 * 0.012 - 1e-9


def test_reading_dearer_than_poll_is_paced_by_poll(node):
    """A reading that costs more than poll gets today's poll pause, never a shorter one."""
    gaps = _gaps_while_memory_held(node, 0.03)
    assert gaps and min(gaps) >= 0.03 + POLL - 1e-9


def test_fast_phase_ends_after_half_a_second(node):
    """After the first half second of the wait, the memory is read every poll, not every 5 ms."""
    reads = _readings(node)
    t0 = _memory(node, [3.0])
    r = _run(node)
    assert r.exit_code == 0
    late = [s for s, _ in reads if t0 + 1.0 <= s < t0 + 3.0]
    gaps = [b - a for a, b in zip(late, late[1:])]
    assert min(gaps) >= POLL - 1e-9 and len(late) <= 2.0 / POLL + 1


def test_memory_back_again_inside_the_window_is_not_clean(node):
    """Memory that comes back 1 ms before the window closes is seen by the closing reading: the window starts over,
    and clean is said only a full window after the memory left again."""
    reads = _readings(node)
    t0 = _memory(node, [0.3, 0.3 + SETTLE - 0.001, 0.7])
    r = _run(node)
    assert r.exit_code == 0
    v = next(s for s in r.steps if s.name == "verify")
    assert v.detail["seconds"] >= 0.7 - 0.2  # clean counted from the second return (verify began after the holder went)
    assert reads[-1][0] >= t0 + 0.7 + SETTLE - 1e-9


def test_memory_back_inside_the_last_window_before_the_deadline_is_unsettled(node):
    """Memory back 0.1 s before the deadline: the wait ends at the deadline, not verified (exit 5), never clean."""
    _memory(node, [0.9])
    r = _run(node, timeout=0.8)
    v = next(s for s in r.steps if s.name == "verify")
    assert v.outcome == "unsettled" and r.exit_code == E.EXIT_GPU_UNKNOWN


def test_slow_reading_never_stretches_clean(node):
    """With 0.1 s readings, clean counts from the end of the first clean reading to the start of the closing one."""
    reads = _readings(node)
    t0 = _memory(node, [0.3])
    node[2].read_secs = 0.1
    r = _run(node)
    assert r.exit_code == 0
    first = _first_clean(reads, t0 + 0.3)
    assert reads[-1][0] - first[1] >= SETTLE - 1e-9


def test_verify_with_fast_polls_keeps_its_deadline(node):
    """Memory that never comes back: verify ends at its deadline (within one reading), fast phase or not."""
    _memory(node, [])
    r = _run(node, timeout=0.3)
    v = next(s for s in r.steps if s.name == "verify")
    assert v.outcome == "timeout" and v.detail["seconds"] <= 0.3 + 0.002 and r.exit_code == E.EXIT_MEMORY_LEFT


def test_holder_gone_after_sigterm_is_seen_within_a_fast_poll(node):
    """A holder that exits 107 ms after SIGTERM is seen gone (the next reading starts) at most 1 ms (``exit_poll``) later."""
    reads = _readings(node)
    _memory(node, [0.3], exit_delay=0.107)
    r = _run(node)
    sent = r.signalled[0]["t"]
    after = next(s for s, _ in reads if s > sent)
    assert after - (sent + 0.107) <= ResetPolicy().exit_poll + 0.001  # the signal's time is rounded to 1 ms in the report


def test_sigterm_ignored_still_waits_the_whole_grace(node):
    """The fast phase of the grace wait never shortens the grace: SIGKILL comes at grace, not before."""
    _, host, probe, _ = node
    p = host.add(129, minors={0}, on_term="ignore")
    probe.context(0, 512, p)
    r = _run(node, grace=1.0)
    term, kill = r.signalled[0], r.signalled[1]
    assert (term["signal"], kill["signal"]) == ("SIGTERM", "SIGKILL") and kill["t"] - term["t"] >= 1.0 - 0.001
    assert r.exit_code == 0
