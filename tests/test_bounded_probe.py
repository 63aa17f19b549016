"""BoundedProbe: a GPU read that does not return in time comes back unknown, and later reads do not queue behind it;
a slow but answering read is not one (each GPU's health read has its own deadline)."""

from __future__ import annotations

import threading
import time

import pytest

from pvegpu.adapters.bounded import BoundedProbe
from pvegpu.audit.run import _health, _HealthAhead
from pvegpu.core.errors import GpuQueryError
from pvegpu.core.model import GpuInfo, GpuSample


@pytest.fixture(autouse=True)
def no_thread_left():
    """A read a test left hung is released by that test; its thread is waited for here, so none runs on into the next
    test (scanpool.forkable() counts the live threads)."""
    yield
    for t in threading.enumerate():
        if t.name == "pvegpu-nvml":
            t.join(5)


class Probe:
    """A GpuProbe whose reads block until ``release`` is set (or answer at once when it is set)."""

    def __init__(self, block: bool) -> None:
        self.release = threading.Event()
        if not block:
            self.release.set()
        self.calls = 0

    def gpus(self):
        self.calls += 1
        self.release.wait()
        return [GpuInfo(0, 0, "GPU-x", "0000:01:00.0")]

    def sample(self, minors):
        self.calls += 1
        self.release.wait()
        return {m: GpuSample(m, 0, ()) for m in minors}


def test_answers_pass_through():
    """A probe that answers in time is returned unchanged."""
    b = BoundedProbe(Probe(block=False), deadline=5)
    assert b.gpus()[0].uuid == "GPU-x"
    assert b.sample([0, 1]) == {0: GpuSample(0, 0, ()), 1: GpuSample(1, 0, ())}


def test_hung_sample_is_unknown_not_zero():
    """A sample() that never returns is abandoned: every asked GPU is unknown with the reason, never 0."""
    p = Probe(block=True)
    got = BoundedProbe(p, deadline=0.2).sample([0, 3])
    assert set(got) == {0, 3}
    assert all(not s.known and s.used_bytes is None and s.error == "NVML read did not return within 0.2 s" for s in got.values())
    p.release.set()


def test_later_reads_do_not_pile_up_behind_a_hung_one():
    """While one read is stuck, later calls answer unknown without starting another read; once it returns, reads resume."""
    p = Probe(block=True)
    b = BoundedProbe(p, deadline=0.2)
    b.sample([0])
    second = b.sample([0])
    assert p.calls == 1 and "earlier NVML read has not returned" in (second[0].error or "")
    p.release.set()
    assert b._busy is not None and b._busy.returned(5)
    assert b.sample([0])[0].known and p.calls == 2


def test_hung_gpu_list_is_gpu_query_error():
    """A gpus() that never returns is a GpuQueryError (exit 5) with a driver hint."""
    p = Probe(block=True)
    with pytest.raises(GpuQueryError, match="did not return within 0.2 s") as exc:
        BoundedProbe(p, deadline=0.2).gpus()
    assert exc.value.exit_code == 5 and "dmesg" in (exc.value.hint or "")
    p.release.set()


def test_errors_of_the_inner_probe_are_raised():
    """An error raised by the inner probe reaches the caller unchanged."""
    class Broken(Probe):
        def gpus(self):
            raise GpuQueryError("NVML could not start", "load the driver")

    with pytest.raises(GpuQueryError, match="could not start"):
        BoundedProbe(Broken(block=False), deadline=5).gpus()


class HealthProbe:
    """A probe whose health reads answer at once, fail (``broken``) or block on ``release`` (``stuck``)."""

    def __init__(self, broken: int | None = None, stuck: int | None = None) -> None:
        self.release = threading.Event()
        self.broken, self.stuck = broken, stuck
        self.calls: list[int] = []

    def health(self, minor):
        self.calls.append(minor)
        if minor == self.broken:
            raise GpuQueryError(f"GPU {minor} cannot be read", "see dmesg")
        if minor == self.stuck:
            self.release.wait()
        return ("health", minor)


def test_health_many_reads_every_gpu_in_one_worker_and_leaves_a_failed_one_out():
    """health_many answers each GPU's health; a GPU whose read fails is left out (unknown), the others are read."""
    p = HealthProbe(broken=1)
    got = BoundedProbe(p, deadline=5).health_many([0, 1, 2])
    assert got == {0: ("health", 0), 2: ("health", 2)} and p.calls == [0, 1, 2]


def test_health_many_stuck_on_one_gpu_keeps_what_came_before_within_the_deadline():
    """A health read stuck in the driver: the GPUs read before it keep their health, the rest are left out, and the
    call returns at its deadline; later reads do not queue behind the stuck one."""
    p = HealthProbe(stuck=1)
    b = BoundedProbe(p, deadline=0.2)
    got = b.health_many([0, 1, 2])
    assert got == {0: ("health", 0)}
    assert b.health_many([2]) == {} and p.calls == [0, 1]
    p.release.set()


class _SlowHealth:
    """A driver whose health reads are slow, not stuck: each GPU's takes ``each`` seconds."""

    def __init__(self, each: float) -> None:
        self.each = each

    def sample(self, minors):
        return {m: GpuSample(m, 1 << 30, ()) for m in minors}

    def health(self, minor):
        time.sleep(self.each)
        return ("health", minor)


def test_slow_but_answering_health_reads_are_not_turned_unknown():
    """The audit's health reads ahead, for all GPUs in one worker, give each GPU its own deadline: slow reads are all read."""
    minors = [0, 1, 2, 3]
    before = {m: _health(BoundedProbe(_SlowHealth(0.3), deadline=0.5).health, m) for m in minors}  # one bounded health() per GPU
    ahead = _HealthAhead(BoundedProbe(_SlowHealth(0.3), deadline=0.5))
    ahead.sample(minors)
    assert before == {m: ("health", m) for m in minors}
    assert ahead.read == before

class Opened(Probe):
    """A probe whose opening and closing are written to ``log``."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(block=False)
        self.log = log
        log.append("open")

    def close(self):
        self.log.append("close")


def test_begin_opens_in_its_thread_and_the_first_reading_takes_it_over():
    """begin() opens the probe in a thread while the caller goes on; the first reading uses that opening (one open),
    a second begin() starts nothing more; close() closes it, and a later opening starts afresh."""
    log: list[str] = []
    go = threading.Event()

    def opener():
        go.wait(5)
        return Opened(log)

    b = BoundedProbe(None, deadline=5, opener=opener)
    b.begin()
    b.begin()
    assert log == []  # the opening waits in its thread; this one went on
    go.set()
    assert b.gpus()[0].uuid == "GPU-x" and b.sample([0])[0].known and log == ["open"]
    b.close()
    assert log == ["open", "close"]
    b.begin()  # after a close, a new run of the same reader begins afresh
    assert b.gpus() and log == ["open", "close", "open"]


def test_a_begun_opening_that_hangs_is_unknown_within_the_deadline_and_never_queued_behind():
    """NVML's start stuck in the driver: the first reading answers unknown within its deadline, the next at once."""
    release = threading.Event()

    def opener():
        release.wait(30)
        return Probe(block=False)

    b = BoundedProbe(None, deadline=0.2, opener=opener)
    b.begin()
    try:
        first, second = b.sample([0]), b.sample([0])
        assert not first[0].known and "did not return within 0.2 s" in (first[0].error or "")
        assert not second[0].known and "earlier NVML read has not returned" in (second[0].error or "")
        with pytest.raises(GpuQueryError):
            b.gpus()
    finally:
        release.set()


def test_an_opening_that_fails_is_the_readings_error_never_zero():
    """NVML that cannot start: gpus() raises the opener's GpuQueryError, sample() gives every GPU unknown with its
    reason, and start() raises it too."""
    def opener():
        raise GpuQueryError("NVML could not start: Driver Not Loaded", "load the driver")

    b = BoundedProbe(None, deadline=5, opener=opener)
    b.begin()
    with pytest.raises(GpuQueryError, match="Driver Not Loaded"):
        b.gpus()
    got = b.sample([0, 1])
    assert all(not x.known and x.used_bytes is None and "Driver Not Loaded" in (x.error or "") for x in got.values())
    with pytest.raises(GpuQueryError, match="Driver Not Loaded"):
        BoundedProbe(None, deadline=5, opener=opener).start()


def test_no_scan_worker_is_forked_while_nvml_is_being_opened():
    """While NVML's start runs in its thread (begin()), scanpool.forkable() is False (a fork copies one thread and
    any lock it holds); once the first reading has taken it over, a scan may fork again."""
    from pvegpu.adapters import scanpool

    release = threading.Event()

    def opener():
        release.wait(30)
        return Probe(block=False)

    before = scanpool.forkable()
    b = BoundedProbe(None, deadline=5, opener=opener)
    b.begin()
    try:
        assert not scanpool.forkable()
    finally:
        release.set()
    assert b.gpus()
    assert scanpool.forkable() == before
