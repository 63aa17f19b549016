"""The audit's whole-node scan started ahead (``ProcHost.prefetch``) and split between workers and this process
(``scanpool.Split``): the answer is the serial scan's whatever the shared hints say, a prefetch is taken once, only
while fresh and within its one deadline, no worker outlives it (an interrupt, a signal to pvegpu), a holding found is
never dropped, an NVML-listed pid the early scan lacks is looked at again, and a listed pid recycled during or after
the scan is a ghost, never the new process's holding; and when a reading needs the whole node at all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pvegpu.adapters import procfs, scanpool
from pvegpu.adapters.devscan import BUDGET, ScanBudget
from pvegpu.adapters.procfs import DeviceTable, ProcHost
from pvegpu.core.holders import inspect_gpus
from pvegpu.core.model import GpuInfo, Holding, Via
from pvegpu.testing import FakeClock, FakeHost, FakeProbe, FakeProc
from tests.pvelike import REPO, kill_and_reap


@pytest.fixture
def small_shares(monkeypatch):
    """Shares of a few pids, so that a small tree is spread over workers."""
    monkeypatch.setattr(scanpool, "MIN_PER_WORKER", 5)
    monkeypatch.setattr(scanpool, "CHUNK", 3)


def _table() -> DeviceTable:
    full = os.stat("/dev/full").st_rdev
    return DeviceTable({(os.major(full), os.minor(full)): 0})


def _stat_text(pid: int) -> bytes:
    return b"%d (sleep) S 1 0 0 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 123 0 0 0\n" % pid


@pytest.fixture
def tree(tmp_path):
    """A /proc-like tree that does not change: 80 processes, every third holding the stand-in GPU by fd, every
    seventh with unreadable maps."""
    for i in range(80):
        pid = 7000 + i
        d = tmp_path / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "stat").write_bytes(_stat_text(pid))
        (d / "maps").write_bytes(b"7f00-7f01 r--p 00000000 fd:01 %d /lib/x.so\n" % (100 + i % 4))
        if i % 3 == 0:
            (d / "fd" / "3").symlink_to("/dev/full")
        if i % 7 == 0:
            (d / "maps").unlink()
            (d / "maps").mkdir()  # EISDIR: unknown, never "holds nothing"
    return tmp_path


def stall_workers(monkeypatch, seconds: float = 30.0) -> None:
    """Forked scan workers sleep ``seconds`` before each stretch of their scan; this process scans as usual."""
    parent, real = os.getpid(), ProcHost._scan_watched

    def slow(self, todo, start, deep, out, end, stop=None):
        if os.getpid() != parent:
            time.sleep(seconds)
        return real(self, todo, start, deep, out, end, stop)

    monkeypatch.setattr(ProcHost, "_scan_watched", slow)


def _children() -> set[int]:
    """This process's children now, zombies too (a worker never reaped is one); compare with the set before a test:
    other tests of this run may leave children of their own."""
    from pvegpu.adapters.procstat import read_stat

    out = set()
    for p in os.listdir("/proc"):
        if p.isdigit() and (st := read_stat(int(p))) is not None and st.ppid == os.getpid():  # zombies too: never reaped
            out.add(int(p))
    return out


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("hints", ["true", "worker-stops-at-once", "here-stops-at-once", "both-stop-at-once", "never-stop"])
def test_split_gives_the_serial_answer_whatever_the_hints_say(small_shares, tree, monkeypatch, workers, hints):
    """Whatever the shared hints make either side do (stop at once, never stop), the split scan gives exactly the
    serial scan's holdings in the same order: what neither side scanned is scanned here, what both did is merged."""
    serial = ProcHost(_table(), proc=str(tree), workers=1).holdings()
    assert len(serial) > 20 and any(Via.UNREADABLE in h.via for h in serial.values())
    real_ahead, real_behind = scanpool._ahead, scanpool._behind
    if hints in ("worker-stops-at-once", "both-stop-at-once"):
        monkeypatch.setattr(scanpool, "_ahead", lambda hints, i, a: lambda j: True)
    if hints in ("here-stops-at-once", "both-stop-at-once"):
        monkeypatch.setattr(scanpool, "_behind", lambda hints, i, b: lambda r: True)
    if hints == "never-stop":
        monkeypatch.setattr(scanpool, "_ahead", lambda hints, i, a: lambda j: False)
        monkeypatch.setattr(scanpool, "_behind", lambda hints, i, b: lambda r: False)
    host = ProcHost(_table(), proc=str(tree), workers=workers + 1)
    todo = host.all_pids()
    split = scanpool.Split(host, todo, False, time.monotonic() + 60, workers)
    assert list(split.finish().items()) == list(serial.items())
    assert scanpool._ahead is real_ahead or hints != "true"
    assert real_behind is not None


def test_both_sides_scan_part_of_a_segment(small_shares, tree, monkeypatch):
    """With true hints both sides do part of the work: the worker reports it got past the segment's start, and this
    process scanned some pids itself."""
    seen: list[int] = []
    real = scanpool._collect

    def spy(host, worker, deadline, first=0):
        got = real(host, worker, deadline, first)
        seen.append(-1 if got is None else got[1])
        return got

    monkeypatch.setattr(scanpool, "_collect", spy)
    host = ProcHost(_table(), proc=str(tree), workers=2)
    todo = host.all_pids()
    here_before = []
    real_serial = scanpool._serial

    def count(host_, part, deep, end, out, stop=None):
        if os.getpid() == parent and stop is not None:  # the worker under way first (on a busy machine a fork may start
            wait = time.monotonic() + 10              # after this side has scanned the whole segment)
            while scanpool._SLOT.unpack_from(split.hints, 0)[0] == 0 and time.monotonic() < wait:
                time.sleep(0.001)
        n = real_serial(host_, part, deep, end, out, stop)
        if os.getpid() == parent and stop is not None:
            here_before.append(n)
        return n

    parent = os.getpid()
    monkeypatch.setattr(scanpool, "_serial", count)
    split = scanpool.Split(host, todo, False, time.monotonic() + 60, 1)
    split.finish()
    assert seen and 0 < seen[0] <= len(todo) and here_before and here_before[0] >= 0


def test_prefetch_is_taken_once_and_gives_the_serial_answer(small_shares, tree):
    """A prefetched scan is what the next whole-node holdings() returns (the serial answer); the call after that
    scans afresh, and no worker is left behind."""
    before = _children()
    serial = ProcHost(_table(), proc=str(tree), workers=1).holdings()
    host = ProcHost(_table(), proc=str(tree), workers=2)
    host.prefetch()
    assert host._early is not None
    assert list(host.holdings().items()) == list(serial.items())
    assert host._early is None
    assert list(host.holdings().items()) == list(serial.items())
    scanpool.reap_exited()  # what the audit's done() does (cancel_prefetch): answered workers reaped
    assert _children() <= before


def test_a_prefetch_past_its_freshness_or_of_another_depth_is_not_used(small_shares, tree, monkeypatch):
    """A prefetch older than PREFETCH_FRESH, or read at another depth than asked, is discarded and the node scanned
    again: a holder that appeared since is found."""
    before = _children()
    for stale in ("old", "deep"):
        host = ProcHost(_table(), proc=str(tree), workers=2)
        host.prefetch()
        new = tree / "7999"
        (new / "fd").mkdir(parents=True)
        (new / "stat").write_bytes(_stat_text(7999))
        (new / "fd" / "3").symlink_to("/dev/full")
        if stale == "old":
            monkeypatch.setattr(procfs, "PREFETCH_FRESH", -1.0)
        held = host.holdings(deep=stale == "deep")
        assert 7999 in held and held[7999].minors == {0}
        monkeypatch.setattr(procfs, "PREFETCH_FRESH", 5.0)
        (new / "fd" / "3").unlink()
        (new / "fd").rmdir()
        (new / "stat").unlink()
        new.rmdir()
    scanpool.reap_exited()  # what the audit's done() does (cancel_prefetch): answered workers reaped
    assert _children() <= before


def test_cancel_prefetch_leaves_no_worker(small_shares, tree, monkeypatch):
    """A prefetch no scan takes is ended by cancel_prefetch(): its workers are killed and reaped, even one that
    would scan for a minute."""
    before = _children()
    stall_workers(monkeypatch, 60)
    host = ProcHost(_table(), proc=str(tree), workers=3)
    host.prefetch()
    assert _children() - before
    t = time.monotonic()
    host.cancel_prefetch()
    assert _children() <= before and host._early is None and time.monotonic() - t < 5
    host.cancel_prefetch()  # nothing left: a no-op


def test_a_crashed_prefetch_worker_share_is_scanned_here(small_shares, tree, monkeypatch):
    """A prefetch worker that dies has its whole segment scanned here: the answer is still the serial one."""
    before = _children()
    serial = ProcHost(_table(), proc=str(tree), workers=1).holdings()

    def crash(host, part, deep, end, w, r, mask, stop=None):
        os._exit(3)

    monkeypatch.setattr(scanpool, "_worker", crash)
    host = ProcHost(_table(), proc=str(tree), workers=2)
    host.prefetch()
    assert list(host.holdings().items()) == list(serial.items())
    scanpool.reap_exited()  # what the audit's done() does (cancel_prefetch): answered workers reaped
    assert _children() <= before


def test_the_audit_ports_end_an_untaken_prefetch(small_shares, tree, monkeypatch):
    """``audit_ports(scan_ahead=True)`` starts the scan on a real host and ``done()`` ends it when no reading took it;
    on a host without prefetch (the simulated node) both are no-ops."""
    from pvegpu import wiring
    from pvegpu.core.settings import Settings

    before = _children()
    host = ProcHost(_table(), proc=str(tree), workers=2)
    world = wiring.NodeWorld(Settings(), False, object(), host, object(), object(), lambda: None, lambda: None)  # type: ignore[arg-type]
    ports = world.audit_ports(scan_ahead=True)
    assert host._early is not None
    ports.done()
    assert host._early is None and _children() <= before
    fake = FakeHost(FakeClock())
    plain = wiring.NodeWorld(Settings(), True, object(), fake, object(), object(), lambda: None, lambda: None)  # type: ignore[arg-type]
    plain.audit_ports(scan_ahead=True).done()


class _EarlyScan(FakeHost):
    """A host whose whole-node answer was read before the last processes started (a prefetched scan)."""

    snapshot: dict | None = None

    def holdings(self, pids=None, *, deep=False):
        if pids is None and self.snapshot is not None:
            return dict(self.snapshot)
        return super().holdings(pids, deep=deep)


def test_a_listed_pid_the_early_scan_missed_is_a_holder_not_a_ghost():
    """A process that opened its CUDA context after the whole-node scan began (so NVML lists it, the scan lacks it) is
    looked at again: a live holder with its memory, never a dead or recycled listed pid (a false "attention")."""
    clock = FakeClock()
    host = _EarlyScan(clock)
    probe = FakeProbe(host)
    old = host.add(300, minors={0})
    probe.context(0, 1024, old)
    host.snapshot = host.holdings()  # the scan, started ahead
    new = host.add(301, minors={0})
    probe.context(0, 2048, new)
    facts = inspect_gpus(None, [GpuInfo(0, 0, "GPU-fake-0", "0000:00:00.0")], host=host, probe=probe, whole_host=True)[0]
    assert new.pid not in facts.ghosts and new.pid not in facts.recycled
    assert {h.pid for h in facts.other_holders} == {old.pid, new.pid}
    assert all(Via.NVML in h.via for h in facts.other_holders)
    host.snapshot = {}  # the early scan saw nothing at all: every listed pid is looked at again
    facts = inspect_gpus(None, [GpuInfo(0, 0, "GPU-fake-0", "0000:00:00.0")], host=host, probe=probe, whole_host=True)[0]
    assert not facts.ghosts and {h.pid for h in facts.other_holders} == {old.pid, new.pid}


@pytest.fixture
def tree_host(small_shares, tree, monkeypatch):
    """``wiring.proc_host`` builds a host of the still tree (this machine's /proc stays out of it)."""
    from pvegpu import wiring

    monkeypatch.setattr(wiring, "_AHEAD", [])
    real = wiring.proc_host

    def host():
        if wiring._AHEAD:
            return real()
        return ProcHost(_table(), proc=str(tree), workers=2)

    monkeypatch.setattr(wiring, "proc_host", host)
    return wiring


def test_scan_ahead_hands_its_host_to_the_node_and_ends_what_nobody_took(tree_host):
    """``scan_ahead`` starts this node's scan before the settings are read and ``proc_host`` hands that host on (once);
    ``end_scan_ahead`` kills a scan nobody took; a simulated node (``--simulate``) starts none."""
    from pvegpu.wiring import GlobalOptions

    wiring = tree_host
    before = _children()
    wiring.scan_ahead(GlobalOptions(simulate="/tmp/nowhere"))
    assert not wiring._AHEAD
    wiring.scan_ahead(GlobalOptions())
    (host,) = wiring._AHEAD
    assert host._early is not None
    assert wiring.proc_host() is host and not wiring._AHEAD
    host.cancel_prefetch()
    wiring.scan_ahead(GlobalOptions())
    assert wiring._AHEAD and _children() - before
    wiring.end_scan_ahead()
    assert not wiring._AHEAD and _children() <= before


def test_an_audit_whose_settings_fail_leaves_no_scan_running(tree_host, tmp_path):
    """``pvegpu audit`` starts the scan first; settings that cannot be read end the command with their error, and the
    scan started for it is killed (no worker left, nothing held for a later command)."""
    from pvegpu.cli import audit as auditcmd
    from pvegpu.core import errors as E
    from pvegpu.wiring import GlobalOptions

    wiring = tree_host
    before = _children()
    bad = tmp_path / "pvegpu.toml"
    bad.write_text("[gate\n")
    bad.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    with pytest.raises(E.PvegpuError):
        auditcmd.run(GlobalOptions(config=str(bad)))
    assert not wiring._AHEAD and _children() <= before


class _CountingHost(FakeHost):
    """A FakeHost that records every holdings() call's pids (None: the whole node)."""

    def __init__(self, clock):
        super().__init__(clock)
        self.asked: list = []

    def holdings(self, pids=None, *, deep=False):
        self.asked.append(None if pids is None else sorted(pids))
        return super().holdings(pids, deep=deep)


def target_job(host_type: type[FakeHost] = FakeHost):
    """A reset's first reading of CT 129, whose one job holds GPU 0 with 1 GiB: (clock, host, probe, job, gpus, first,
    that reading's facts of GPU 0)."""
    from pvegpu.core.holders import FirstReading

    clock = FakeClock()
    host = host_type(clock)
    probe = FakeProbe(host)
    job = host.add(129, minors={0})
    probe.context(0, 1024, job)
    gpu = [GpuInfo(0, 0, "GPU-fake-0", "0000:00:00.0")]
    first = FirstReading()
    facts = inspect_gpus(129, gpu, host=host, probe=probe, first=first)[0]
    return clock, host, probe, job, gpu, first, facts


def test_a_dead_listed_pid_that_was_the_targets_widens_no_scan():
    """A reset's readings after its holder died, while NVML still lists the dead pid (the release latency): the pid
    was the target's at the first reading, so its memory is the target's leftover and no heir is looked for on the
    rest of the node (no whole-node scan per poll); a dead listed pid of unknown origin still widens the scan."""
    from pvegpu.core.holders import FirstReading

    _clock, host, probe, job, gpu, first, _f0 = target_job(_CountingHost)
    del host.procs[job.pid]  # SIGKILLed; NVML lists it until the release latency has passed
    host.asked.clear()
    facts = inspect_gpus(129, gpu, host=host, probe=probe, first=first)[0]
    assert job.pid in facts.ghosts and job.pid in facts.target_ghosts
    assert None not in host.asked
    other = host.add(300, minors={0})  # a neighbour's job, dead before any reading of this reset
    probe.context(0, 512, other)
    del host.procs[other.pid]
    host.asked.clear()
    fresh = FirstReading()
    facts = inspect_gpus(129, gpu, host=host, probe=probe, first=fresh)[0]
    assert other.pid in facts.ghosts and None in host.asked


def test_a_split_without_a_shared_page_still_gives_the_serial_answer(small_shares, tree, monkeypatch):
    """No shared page for the hints (mmap refused): the workers and this process never see each other's progress,
    and the answer is still the serial scan's (the hints are only hints), never an error of the scan."""
    import mmap

    def refused(*a, **kw):
        raise OSError(12, "Cannot allocate memory")

    serial = ProcHost(_table(), proc=str(tree), workers=1).holdings()
    monkeypatch.setattr(mmap, "mmap", refused)
    host = ProcHost(_table(), proc=str(tree), workers=2)
    assert list(scanpool.Split(host, host.all_pids(), False, time.monotonic() + 60, 1).finish().items()) == list(serial.items())


def test_answered_workers_are_reaped_by_the_next_split_or_when_done(small_shares, tree):
    """A worker that answered is not waited for while it exits, but never accumulates: after five split readings
    at most the last one's worker is left, and none once the host is done (``cancel_prefetch``, the audit's done())."""
    before = _children()
    host = ProcHost(_table(), proc=str(tree), workers=2)
    for _ in range(5):
        assert 7000 in host.holdings()
    assert len(_children() - before) <= 1
    host.cancel_prefetch()
    assert _children() <= before


def _proc(root, pid: int, holds: bool) -> None:
    """A process of the /proc-like tree ``root``, holding the stand-in GPU by fd if ``holds``."""
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_bytes(_stat_text(pid))
    (d / "maps").write_bytes(b"7f00-7f01 r--p 00000000 fd:01 100 /lib/x.so\n")
    if holds:
        (d / "fd" / "3").symlink_to("/dev/full")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def test_a_holder_started_after_the_prefetch_is_in_the_taken_answer(small_shares, tree):
    """A GPU holder that starts between prefetch() and the holdings() that takes it is found, as a scan started then finds it."""
    host = ProcHost(_table(), proc=str(tree), workers=2)
    host.prefetch()
    assert host._early is not None
    _proc(tree, 7999, True)  # e.g. a fork child keeping a dead listed pid's context, an nvidia-smi
    held = host.holdings()
    assert 7999 in held and held[7999].minors == {0}


def test_a_taken_prefetch_keeps_one_scan_deadline(small_shares, tree, monkeypatch):
    """holdings() taking a prefetch is bounded by the prefetch's one budget.total (+ GRACE), never a second fresh one."""
    monkeypatch.setattr(scanpool, "GRACE", 0.2)
    real = ProcHost._scan_watched

    def to_the_deadline(self, todo, start, deep, out, end, stop=None):  # every side is stuck until its deadline
        time.sleep(max(0.0, end - time.monotonic()))
        return real(self, todo, start, deep, out, end, stop)

    monkeypatch.setattr(ProcHost, "_scan_watched", to_the_deadline)
    before = _children()
    host = ProcHost(_table(), proc=str(tree), workers=2, budget=ScanBudget(total=1.5))
    t = time.monotonic()
    host.prefetch()
    assert host._early is not None
    _proc(tree, 7999, True)  # started after the prefetch listed /proc
    host.holdings()
    took = time.monotonic() - t
    assert took < 1.5 + 0.2 + 0.5, f"one whole-node scan took {took:.1f} s against a 1.5 s budget"
    scanpool.reap_exited()  # what the audit's done() does (cancel_prefetch): answered workers reaped
    assert _children() <= before


def test_a_partial_reading_keeps_its_gpu_over_the_other_sides_deadline():
    """A worker's partial reading that found GPU 0 keeps it when this side ran past the deadline: a holding is never dropped."""
    out = {5: Holding(5, frozenset({0}), frozenset({Via.UNREADABLE, BUDGET}))}  # the worker: 40,000 fds, the GPU fd among the first
    scanpool._merge(out, {5: Holding(5, frozenset(), frozenset({Via.UNREADABLE, BUDGET}))})  # here: past the deadline
    assert 0 in out[5].minors and Via.UNREADABLE in out[5].via


# -- no worker outlives an interrupt or a signal ------------------------------------------------------------


def test_an_interrupted_finish_leaves_no_worker(small_shares, tree, monkeypatch):
    """A Ctrl-C (or any exception) while the taken prefetch is finished here kills and reaps its workers."""
    parent = os.getpid()
    stall_workers(monkeypatch)

    def interrupted(host, part, deep, end, out, stop=None):
        if os.getpid() == parent:
            raise KeyboardInterrupt
        return 0

    host = ProcHost(_table(), proc=str(tree), workers=3)
    host.prefetch()
    pids = [w[0] for w in host._early.split.workers if w is not None]
    monkeypatch.setattr(scanpool, "_serial", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            host.holdings()
        host.cancel_prefetch()  # what auditcmd's finally does
        assert not any(_alive(p) for p in pids)
    finally:
        kill_and_reap(*pids)


def test_an_interrupt_while_a_prefetch_is_taken_leaves_no_worker(small_shares, tree, monkeypatch):
    """An interrupt while holdings() lists /proc again to take the prefetch: its workers are still ended, none left running."""
    stall_workers(monkeypatch)
    before = _children()
    host = ProcHost(_table(), proc=str(tree), workers=2)
    host.prefetch()
    assert _children() - before

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(host, "all_pids", interrupted)
    with pytest.raises(KeyboardInterrupt):
        host.holdings()
    host.cancel_prefetch()  # ports.done()
    leaked = _children() - before
    for pid in leaked:  # clean up what the break left
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except OSError:
            pass
    assert not leaked, f"workers {sorted(leaked)} left running"


def test_an_interrupt_while_the_workers_are_forked_leaves_none(small_shares, tree, monkeypatch):
    """A Ctrl-C between two forks of prefetch() kills the workers already started: none is left that nobody knows of."""
    real_start = scanpool._start
    started: list[int] = []
    stall_workers(monkeypatch)

    def start(*a, **kw):
        if started:
            raise KeyboardInterrupt
        w = real_start(*a, **kw)
        if w is not None:
            started.append(w[0])
        return w

    monkeypatch.setattr(scanpool, "_start", start)
    host = ProcHost(_table(), proc=str(tree), workers=3)
    try:
        with pytest.raises(KeyboardInterrupt):
            host.prefetch()
        host.cancel_prefetch()
        time.sleep(0.2)
        assert started and not any(_alive(p) for p in started)
    finally:
        kill_and_reap(*started)


_PREFETCH_AND_WAIT = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a hangup ends it, as for a service, also when the tests run under nohup
    from pvegpu.adapters import procfs, scanpool
    from pvegpu.adapters.procfs import DeviceTable, ProcHost
    scanpool.MIN_PER_WORKER = 5
    parent = os.getpid()
    real = ProcHost._scan_watched
    def slow(self, todo, start, deep, out, end, stop=None):
        if os.getpid() != parent:
            time.sleep(30)
        return real(self, todo, start, deep, out, end, stop)
    ProcHost._scan_watched = slow
    host = ProcHost(DeviceTable({}), proc=sys.argv[1], workers=3)
    host.prefetch()
    print(" ".join(str(w[0]) for w in host._early.split.workers if w is not None), flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_workers_die_with_a_pvegpu_killed_by_a_signal(tree, sig):
    """`kill PID` / a hangup of `pvegpu audit` (only the parent signalled) leaves no prefetch worker scanning /proc."""
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.Popen([sys.executable, "-c", _PREFETCH_AND_WAIT, str(tree)], stdout=subprocess.PIPE, env=env, cwd=REPO)
    workers: list[int] = []
    try:
        assert p.stdout is not None
        workers = [int(w) for w in p.stdout.readline().split()]
        assert workers
        os.kill(p.pid, sig)
        p.wait(10)
        end = time.monotonic() + 3
        while time.monotonic() < end and any(_alive(w) for w in workers):
            time.sleep(0.05)
        assert not [w for w in workers if _alive(w)]
    finally:
        p.kill()
        p.wait()
        for w in workers:
            if _alive(w):
                try:
                    os.kill(w, signal.SIGKILL)
                except ProcessLookupError:
                    pass


# -- a listed pid recycled during or after the scan ----------------------------------------------------------


def _plain(host: _EarlyScan) -> FakeHost:
    """``host`` without its early answer: every whole-node reading is made now (the serial scan)."""

    class Live:
        def __getattr__(self, name):
            return getattr(host, name)

        def holdings(self, pids=None, *, deep=False):
            return FakeHost.holdings(host, pids, deep=deep)

    return Live()  # type: ignore[return-value]


def test_a_listed_pid_recycled_after_the_early_scan_is_a_ghost_not_a_holder():
    """A listed pid the early scan saw holding, reused elsewhere before NVML's reading, is a recycled ghost, never a holder."""
    clock = FakeClock()
    host = _EarlyScan(clock)
    probe = FakeProbe(host)
    old = host.add(300, minors={0})
    probe.context(0, 1024, old)
    host.snapshot = host.holdings()  # the scan, started ahead, sees pid `old` holding GPU 0
    del host.procs[old.pid]  # it exits (NVML still lists it for a while) and a neighbour's process gets its pid
    host.procs[old.pid] = FakeProc(old.pid, 400, start=old.start + 777, ppid=1)
    gpu = GpuInfo(0, 0, "GPU-fake-0", "0000:00:00.0")
    serial = inspect_gpus(None, [gpu], host=_plain(host), probe=probe, whole_host=True)[0]
    facts = inspect_gpus(None, [gpu], host=host, probe=probe, whole_host=True)[0]
    assert old.pid in serial.ghosts and old.pid in serial.recycled  # what the serial scan says
    assert old.pid in facts.ghosts and old.pid in facts.recycled
    assert all(h.pid != old.pid for h in facts.other_holders)


class _RecycledDuringScan(FakeHost):
    """During the whole-node reading, listed pid ``victim`` exits and a new process of CT ``vmid`` (no GPU) takes its pid."""

    victim: int = 0
    vmid: int = 200

    def holdings(self, pids=None, *, deep=False):
        got = super().holdings(pids, deep=deep)
        if pids is None and self.victim in self.procs and self.procs[self.victim].minors:
            old = self.procs.pop(self.victim)
            self.procs[old.pid] = FakeProc(old.pid, self.vmid, set(), start=old.start + 1, ppid=1)
        return got


def test_a_listed_pid_recycled_during_the_whole_node_scan_is_not_made_a_holder_audit():
    """A listed pid recycled by CT 200 during a whole-node scan (none prefetched) is a ghost, never CT 200's holding."""
    host = _RecycledDuringScan(FakeClock())
    probe = FakeProbe(host)
    victim = host.add(None, minors={0})
    probe.context(0, 4096, victim)
    host.victim = victim.pid
    facts = inspect_gpus(None, [GpuInfo(0, 0, "GPU-fake-0", "0000:00:00.0")], host=host, probe=probe, whole_host=True)[0]
    holders = [(h.pid, h.info.placement.vmid) for h in facts.other_holders + facts.ct_holders]
    assert (victim.pid, 200) not in holders, f"new process in CT 200 reported as GPU holder: {holders}"
    assert victim.pid in facts.recycled
