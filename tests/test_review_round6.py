"""Review round 6: the audit's scan started ahead (``ProcHost.prefetch``) and split (``scanpool.Split``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pvegpu.adapters import scanpool
from pvegpu.adapters.devscan import BUDGET
from pvegpu.adapters.procfs import ProcHost
from pvegpu.core.holders import inspect_gpus
from pvegpu.core.model import GpuInfo, Holding, Via
from pvegpu.testing import FakeClock, FakeHost, FakeProbe, FakeProc
from tests.pvelike import kill_and_reap
from tests.test_scan_ahead import _EarlyScan, _stat_text, _table, small_shares, stall_workers  # noqa: F401 - a fixture

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _proc(root, pid: int, holds: bool) -> None:
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_bytes(_stat_text(pid))
    (d / "maps").write_bytes(b"7f00-7f01 r--p 00000000 fd:01 100 /lib/x.so\n")
    if holds:
        (d / "fd" / "3").symlink_to("/dev/full")


@pytest.fixture
def tree(tmp_path):
    """A still /proc-like tree of 40 processes, every third holding the stand-in GPU by fd."""
    for i in range(40):
        _proc(tmp_path, 7000 + i, i % 3 == 0)
    return tmp_path


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _children() -> set[int]:
    from pvegpu.adapters.procstat import read_stat

    return {int(p) for p in os.listdir("/proc") if p.isdigit() and (st := read_stat(int(p))) is not None
            and st.ppid == os.getpid()}


def test_a_holder_started_after_the_prefetch_is_in_the_taken_answer(small_shares, tree):  # noqa: F811 - a fixture
    """A GPU holder that starts between prefetch() and the holdings() that takes it is found, as a scan started then finds it."""
    host = ProcHost(_table(), proc=str(tree), workers=2)
    host.prefetch()
    assert host._early is not None
    _proc(tree, 7999, True)  # e.g. a fork child keeping a dead listed pid's context, an nvidia-smi
    held = host.holdings()
    assert 7999 in held and held[7999].minors == {0}


def test_a_listed_pid_recycled_after_the_early_scan_is_a_ghost_not_a_holder():
    """A listed pid the early scan saw holding the GPU, then reused by a process elsewhere before NVML's reading, is a
    recycled ghost (as a serial scan after NVML says), never the new process blamed with the dead one's memory."""
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


def _plain(host: _EarlyScan) -> FakeHost:
    class Live:
        def __getattr__(self, name):
            return getattr(host, name)

        def holdings(self, pids=None, *, deep=False):
            return FakeHost.holdings(host, pids, deep=deep)

    return Live()  # type: ignore[return-value]


def test_a_partial_reading_keeps_its_gpu_over_the_other_sides_deadline():
    """A worker's reading that found GPU 0 before the process's own budget ran out keeps GPU 0 when this process's
    side ran past the whole scan's deadline and marked the segment "not reached": a real holding is never dropped."""
    out = {5: Holding(5, frozenset({0}), frozenset({Via.UNREADABLE, BUDGET}))}  # the worker: 40,000 fds, the GPU fd among the first
    scanpool._merge(out, {5: Holding(5, frozenset(), frozenset({Via.UNREADABLE, BUDGET}))})  # here: past the deadline
    assert 0 in out[5].minors and Via.UNREADABLE in out[5].via


def test_an_interrupted_finish_leaves_no_worker(small_shares, tree, monkeypatch):  # noqa: F811 - a fixture
    """A Ctrl-C (or any exception) while the taken prefetch is finished here kills and reaps its workers: none
    scans on for the rest of the deadline."""
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


SCRIPT = textwrap.dedent("""
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
    """`kill PID` / a hangup of `pvegpu audit` (only the parent signalled, as systemd or `timeout` do) leaves no
    prefetch worker scanning /proc for the rest of the deadline."""
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tree)], stdout=subprocess.PIPE, env=env, cwd=REPO)
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


def test_an_interrupt_while_the_workers_are_forked_leaves_none(small_shares, tree, monkeypatch):  # noqa: F811 - a fixture
    """A Ctrl-C between two forks of prefetch() (signals are open again there) kills the workers already started:
    the exception leaves no worker that neither ``_early`` nor ``cancel_prefetch()`` knows of."""
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
