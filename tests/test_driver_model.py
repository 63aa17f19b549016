"""The one driver model behind every NVML stand-in: its measured defaults and its knobs (fake clock)."""

from __future__ import annotations

import pytest

from pvegpu.core.model import MIB
from pvegpu.sim.driver import RELEASE_LATENCY, DriverModel, context_gap
from tests.fakes import FakeClock


def model(minors=(0,)):
    clock = FakeClock()
    alive: set[tuple[int, int]] = set()
    return clock, alive, DriverModel(clock, lambda ident: ident in alive, minors)


@pytest.mark.parametrize("n,measured_mib", [(0, 0.0), (1, 8.8), (2, 14.4), (4, 25.6), (8, 47.9), (16, 94.6), (32, 187.9)])
def test_per_context_gap_matches_the_measurement(n, measured_mib):
    """used - sum(per process) is the H200's figure (within 1.5 MiB) for 0..32 live contexts, and 0 with none."""
    _, alive, m = model()
    for pid in range(n):
        alive.add((pid + 100, 1))
        m.open_context(0, 1024 * MIB, (pid + 100, 1))
    s = m.sample([0])[0]
    gap = s.used_bytes - sum(p.used_bytes for p in s.processes)
    assert gap == context_gap(n) and abs(gap / MIB - measured_mib) <= 1.5


def test_memory_returns_only_after_the_release_latency_and_the_dead_owner_stays_listed():
    """After the last holder dies the context's memory and its dead owner's pid stay for ~0.15 s, then both go."""
    clock, alive, m = model()
    alive.add((100, 1))
    m.open_context(0, 2048 * MIB, (100, 1))
    alive.clear()
    s = m.sample([0])[0]
    assert [p.pid for p in s.processes] == [100] and s.used_bytes > 2048 * MIB
    clock.sleep(RELEASE_LATENCY / 2)
    assert m.sample([0])[0].processes
    clock.sleep(RELEASE_LATENCY)
    s = m.sample([0])[0]
    assert s.processes == () and s.used_bytes == 0


def test_fork_child_keeps_the_context_and_only_the_dead_owner_is_listed():
    """A child that inherited the context keeps it alive after the owner died; NVML lists the owner, never the child."""
    clock, alive, m = model()
    alive.update({(100, 1), (101, 1)})
    m.open_context(0, 1024 * MIB, (100, 1), (101, 1))
    alive.discard((100, 1))
    clock.sleep(1.0)
    assert [p.pid for p in m.sample([0])[0].processes] == [100]


def test_pinned_and_leaking_contexts():
    """A pinned context (fd in flight) lives with no holder; a leaking one leaves its memory with no pid listed."""
    clock, _alive, m = model()
    m.open_context(0, 512 * MIB, (100, 1), pinned=True)
    m.open_context(0, 256 * MIB, (101, 1), leaks=True)
    clock.sleep(1.0)
    m.sample([0])
    clock.sleep(1.0)
    s = m.sample([0])[0]
    assert [p.pid for p in s.processes] == [100] and s.used_bytes == 768 * MIB + context_gap(1)


def test_lost_gpu_is_named_and_a_failing_read_is_an_error_row():
    """A GPU lost at enumeration is left out of gpus() but named in failed; one failing at read is an error sample
    while the others are read."""
    _, _, m = model((0, 1, 2))
    m.lost.add(1)
    m.fail[2] = "Unknown Error"
    assert [g.minor for g in m.gpus()] == [0, 2] and m.failed and "minor 1" in m.failed[0]
    s = m.sample([0, 1, 2])
    assert s[0].known and not s[1].known and s[2].error == "NVML: Unknown Error"
