"""The audit's prefetched whole-node reading describes each holder it finds beside its holding, in the scan's watched
thread and its forked workers (``ProcHost._describing``); ``describe()`` hands each description out once, a pid read
again (NVML's listed pids) is described again, and a signal never acts on a scan's description. A description is
display text: one that stalls never costs a proven holding its GPU, and ``describe()`` returns within a bound."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from pvegpu.adapters.devscan import ScanBudget
from pvegpu.adapters.procfs import ProcHost
from pvegpu.core.model import Place, Placement, ProcIdentity, ProcInfo, SignalResult
from tests.test_scan_ahead import _table, small_shares, stall_workers, tree  # noqa: F401 - fixtures


def _placed(root, cg, vmid: int) -> list[int]:
    """Every holder of ``root`` (an fd on the stand-in) placed in CT ``vmid``, with a status and a command line."""
    holders = []
    (cg / "lxc" / str(vmid) / "ns").mkdir(parents=True, exist_ok=True)
    for d in sorted(root.iterdir()):
        if d.name.isdigit() and (d / "fd" / "3").exists():
            (d / "cgroup").write_bytes(b"0::/lxc/%d/ns\n" % vmid)
            (d / "status").write_bytes(b"Name:\tjob\nUid:\t0\t0\t0\t0\nNSpid:\t%s\t5\n" % d.name.encode())
            (d / "cmdline").write_bytes(b"job\0")
            holders.append(int(d.name))
    return holders


@pytest.mark.parametrize("who", ["workers", "here"])
def test_a_prefetched_reading_hands_out_each_holders_description_once(small_shares, tree, tmp_path, monkeypatch, who):  # noqa: F811
    """Descriptions read by the workers (this process claims nothing) or here (the workers stall): the first
    describe() of a holder after the reading says what the scan read (CT 301), the next one what is true now (302).
    (A stalled worker is given up at the scan's deadline, 1 s here; its share was scanned here meanwhile.)"""
    cg = tmp_path / "cg"
    holders = _placed(tree, cg, 301)
    if who == "here":
        stall_workers(monkeypatch, 30)
    else:  # this process claims nothing from the back: the worker scans (and describes) the whole segment
        from pvegpu.adapters import scanpool

        monkeypatch.setattr(scanpool, "_behind", lambda hints, i, b: lambda r: True)
    host = ProcHost(_table(), proc=str(tree), cgroup_root=str(cg), workers=2, budget=ScanBudget(total=1.0))
    host.prefetch()
    held = host.holdings()
    assert set(holders) <= set(held)
    _placed(tree, cg, 302)
    first = [host.describe(p) for p in holders]
    assert all(i is not None and i.placement == Placement(Place.CONTAINER, 301) and i.ns_pid == 5 and i.cmdline == "job"
               for i in first)
    assert all((i := host.describe(p)) is not None and i.placement.vmid == 302 for p in holders)
    host.cancel_prefetch()


def test_a_pid_read_again_is_described_again(small_shares, tree, tmp_path):  # noqa: F811
    """A pid the next reading names again (inspect_gpus' second look at NVML's listed pids) is described as it is
    now, not as the prefetched scan read it; the whole-node reading after that hands out nothing of the old one."""
    cg = tmp_path / "cg"
    holders = _placed(tree, cg, 301)
    host = ProcHost(_table(), proc=str(tree), cgroup_root=str(cg), workers=2)
    host.prefetch()
    host.holdings()
    _placed(tree, cg, 302)
    host.holdings(holders[:2])
    assert [host.describe(p).placement.vmid for p in holders[:2]] == [302, 302]  # type: ignore[union-attr]
    host.holdings()  # not prefetched: a plain reading, no descriptions kept
    assert host.describe(holders[3]).placement.vmid == 302  # type: ignore[union-attr]


@pytest.mark.root(reason="needs root: a pidfd to a process and its cgroup")
def test_a_signal_never_acts_on_a_scans_description(small_shares):  # noqa: F811
    """Whatever a reading described, signal() re-reads the process it pins: a description placing it in the target CT
    (here forged into what describe() would hand out) does not let a host process be signalled."""
    p = subprocess.Popen(["sleep", "30"])
    try:
        host = ProcHost(_table())
        st = open(f"/proc/{p.pid}/stat", "rb").read()
        ticks = int(st[st.rfind(b")") + 2:].split()[19])
        ident = ProcIdentity(p.pid, ticks)
        host._seen[p.pid] = ProcInfo(ident, "sleep", "S", Placement(Place.CONTAINER, 777), "/lxc/777/ns", 9)
        assert host.signal(ident, signal.SIGTERM, 777) is SignalResult.MOVED
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_a_pid_both_sides_read_gets_neither_sides_description(small_shares, tree, tmp_path, monkeypatch):  # noqa: F811
    """Hints that never stop either side: every holder is read by the worker and here, and none of the two
    descriptions is handed out (which reading was kept decides; they could be of two processes): described anew."""
    from pvegpu.adapters import scanpool

    monkeypatch.setattr(scanpool, "_ahead", lambda hints, i, a: lambda j: False)
    monkeypatch.setattr(scanpool, "_behind", lambda hints, i, b: lambda r: False)
    cg = tmp_path / "cg"
    holders = _placed(tree, cg, 301)
    host = ProcHost(_table(), proc=str(tree), cgroup_root=str(cg), workers=2)
    host.prefetch()
    assert set(holders) <= set(host.holdings())
    _placed(tree, cg, 302)
    assert {host.describe(p).placement.vmid for p in holders} == {302}  # type: ignore[union-attr]


# -- a description that stalls ---------------------------------------------------------------------------


def _release(fifo: str) -> None:
    """Let every reader blocked opening ``fifo`` go on (a writer opens it and closes at once: end of file)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _holder_with_stalling_cmdline(root, pid: int) -> str:
    """A process of ``root`` holding the stand-in by fd whose ``cmdline`` blocks its reader (a FIFO): its path."""
    d = root / str(pid)
    (d / "fd").mkdir(parents=True, exist_ok=True)
    (d / "stat").write_bytes(b"%d (job) S 1 0 0 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 123 0 0 0\n" % pid)
    (d / "maps").write_bytes(b"7f00-7f01 r--p 00000000 fd:01 100 /lib/x.so\n")
    if not (d / "fd" / "3").exists():
        (d / "fd" / "3").symlink_to("/dev/full")
    fifo = str(d / "cmdline")
    if os.path.exists(fifo):
        os.unlink(fifo)
    os.mkfifo(fifo)
    return fifo


@pytest.mark.parametrize("when", ["listed", "later"])
def test_a_proven_holder_whose_description_stalls_keeps_its_gpu(small_shares, tree, when):  # noqa: F811
    """A holder proven by its fd whose description blocks (cmdline read on a wedged mm lock) keeps GPU 0 in a prefetched reading."""
    pid = 7003 if when == "listed" else 7100  # listed: in the tree (every third pid holds); later: started after the listing
    fifo = _holder_with_stalling_cmdline(tree, pid) if when == "listed" else ""
    try:
        plain = ProcHost(_table(), proc=str(tree), workers=1)
        if when == "listed":
            assert plain.holdings([pid], deep=True)[pid].minors == {0}  # the scan alone proves it
        host = ProcHost(_table(), proc=str(tree), workers=2)
        host.prefetch(deep=True)
        assert host._early is not None
        if when == "later":
            fifo = _holder_with_stalling_cmdline(tree, pid)
        got = host.holdings(deep=True)
        assert 0 in got[pid].minors, got[pid]
    finally:
        for _ in range(3):
            _release(fifo)


def test_describe_has_a_deadline(tmp_path):
    """describe() of a process whose cmdline read blocks (a wedged mm lock: a FIFO here) returns within a bound."""
    fifo = _holder_with_stalling_cmdline(tmp_path, 8100)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(ProcHost(_table(), proc=str(tmp_path)).describe(8100)), daemon=True)
    try:
        t.start()
        t.join(5.0)
        assert not t.is_alive(), "describe() still blocked after 5 s"
    finally:
        for _ in range(3):
            _release(fifo)
        t.join(5.0)
