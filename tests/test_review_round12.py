"""Review round 12 (issue 20, round 7's speed changes): what a reviewer found by trying to break them, kept fixed."""

from __future__ import annotations

import time

import pytest

from pvegpu.adapters.bounded import BoundedProbe
from pvegpu.adapters.procfs import ProcessScan, ProcHost
from pvegpu.audit.run import _health, _HealthAhead
from pvegpu.core.holders import inspect_gpus
from pvegpu.core.model import GpuInfo, GpuSample, Holding
from pvegpu.testing import FakeClock, FakeHost, FakeProbe, FakeProc

GPU0 = [GpuInfo(0, 0, "GPU-fake-0", "0000:00:00.0")]


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


def _recycled_setup(vmid_of_victim: int | None):
    host = _RecycledDuringScan(FakeClock())
    probe = FakeProbe(host)
    victim = host.add(vmid_of_victim, minors={0})
    probe.context(0, 4096, victim)
    host.victim = victim.pid
    return host, probe, victim


def test_a_listed_pid_recycled_during_the_whole_node_scan_is_not_made_a_holder_audit():
    """A whole-node reading without a prefetched scan: NVML lists P; during the scan P exits and a process of CT 200
    that holds no GPU takes its pid. P's second look comes after the scan: a recycled pid (a ghost), never CT 200's
    process holding the GPU with P's memory."""
    host, probe, victim = _recycled_setup(None)
    facts = inspect_gpus(None, GPU0, host=host, probe=probe, whole_host=True)[0]
    holders = [(h.pid, h.info.placement.vmid) for h in facts.other_holders + facts.ct_holders]
    assert (victim.pid, 200) not in holders, f"new process in CT 200 reported as GPU holder: {holders}"
    assert victim.pid in facts.recycled


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
    """Health read for all GPUs in one worker still gives each GPU its own deadline: 4 GPUs at 0.3 s each under a
    0.5 s deadline are all read, as one bounded health() each reads them."""
    minors = [0, 1, 2, 3]
    before = {m: _health(BoundedProbe(_SlowHealth(0.3), deadline=0.5).health, m) for m in minors}  # the old per-GPU path
    ahead = _HealthAhead(BoundedProbe(_SlowHealth(0.3), deadline=0.5))
    ahead.sample(minors)
    assert before == {m: ("health", m) for m in minors}
    assert ahead.read == before


def test_a_vmlist_nested_too_deeply_is_a_pve_error_not_a_traceback(tmp_path):
    """A .vmlist nested past the recursion limit is a PveApiError (one line, a hint), never a RecursionError."""
    from pvegpu.adapters.etcpve import EtcPve
    from pvegpu.core.errors import PveApiError

    (tmp_path / ".vmlist").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PveApiError):
        EtcPve(str(tmp_path)).guests()


class _Boom(ProcessScan):
    """A scan of one process that raises (a bug in the reader), for pid ``bad`` only."""

    bad = -1

    def run(self, proc, pid, deep=False):  # noqa: ANN001, ANN201 - the ProcessScan signature
        if pid == self.bad:
            raise ZeroDivisionError("a bug in the scan")
        return Holding(pid, frozenset({0}), frozenset({"fd"}))


def test_a_process_whose_reading_raises_is_unreadable_and_the_scan_goes_on(tmp_path, monkeypatch):
    """A bug while reading one process makes that process unreadable (unknown), the others are still read, and
    nothing is raised (PVEGPU_DEBUG=1 raises it)."""
    monkeypatch.delenv("PVEGPU_DEBUG", raising=False)
    _Boom.bad = 2
    host = ProcHost(proc=str(tmp_path), scan=_Boom, workers=1)
    got = host.holdings([1, 2, 3])
    assert got[1].minors == {0} and got[3].minors == {0}
    assert "unreadable" in got[2].via and not got[2].minors
    monkeypatch.setenv("PVEGPU_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        ProcHost(proc=str(tmp_path), scan=_Boom, workers=1).holdings([1, 2, 3])
