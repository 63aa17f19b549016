"""Contract: pvegpu.testing's fakes behave as the real adapters they stand for. The same cases run against the
fake and the real one: FakeHost and ProcHost (/proc, pidfd signals) here; FakeProbe and the NVML readers on a
GPU node (marker ``gpu``)."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from pvegpu.adapters.procfs import ProcHost
from pvegpu.core.model import Place, ProcIdentity, SignalResult
from pvegpu.testing import FakeClock, FakeHost, FakeProbe
from tests.test_gpu import _nvml_ok


class _Real:
    """ProcHost with real host processes (``sleep``), never in a container."""

    def __init__(self) -> None:
        self.host = ProcHost()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self) -> int:
        p = subprocess.Popen(["sleep", "60"])
        self.procs[p.pid] = p
        return p.pid

    def kill(self, pid: int) -> None:
        self.procs[pid].kill()
        self.procs[pid].wait(10)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


class _Fake:
    """FakeHost with host processes (``vmid`` None)."""

    def __init__(self) -> None:
        self.host = FakeHost(FakeClock())

    def spawn(self) -> int:
        return self.host.add(None).pid

    def kill(self, pid: int) -> None:
        del self.host.procs[pid]

    def close(self) -> None:
        pass


@pytest.fixture(params=["fake", "real"])
def side(request):
    s = _Fake() if request.param == "fake" else _Real()
    yield s
    s.close()


def test_host_describes_a_live_host_process(side):
    """describe(): a live host process has its pid in its identity and is placed outside every container."""
    pid = side.spawn()
    info = side.host.describe(pid)
    assert info is not None and info.ident.pid == pid and info.placement.vmid is None and info.placement.place is not Place.CONTAINER
    assert side.host.alive(info.ident)


def test_host_forgets_a_dead_process(side):
    """After death: describe() is None, alive() False, signal() GONE (never SENT to whoever comes next)."""
    pid = side.spawn()
    ident = side.host.describe(pid).ident
    side.kill(pid)
    deadline = time.monotonic() + 5
    while side.host.describe(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert side.host.describe(pid) is None and not side.host.alive(ident)
    assert side.host.signal(ident, signal.SIGKILL, 129) is SignalResult.GONE


def test_host_boot_ticks_orders_process_starts(side):
    """boot_ticks(): a process that started before the call has a start time no later than it; one started after
    the call (20 ms later: two clock ticks) a later one."""
    before = side.spawn()
    time.sleep(0.02)
    now = side.host.boot_ticks()
    time.sleep(0.02)
    after = side.spawn()
    assert side.host.describe(before).ident.start_ticks <= now < side.host.describe(after).ident.start_ticks


def test_host_never_signals_a_recycled_pid(side):
    """A live pid with another start time is another process: not alive, and signal() is GONE, it stays alive."""
    pid = side.spawn()
    ident = side.host.describe(pid).ident
    other = ProcIdentity(pid, ident.start_ticks + 1)
    assert not side.host.alive(other)
    assert side.host.signal(other, signal.SIGKILL, 129) is SignalResult.GONE
    assert side.host.alive(ident)


def test_host_never_signals_outside_the_target(side):
    """A host process asked to be signalled as CT 129's payload is MOVED, not signalled: it stays alive."""
    pid = side.spawn()
    ident = side.host.describe(pid).ident
    assert side.host.signal(ident, signal.SIGKILL, 129) is SignalResult.MOVED
    time.sleep(0.05)
    assert side.host.alive(ident)


def _probe_contract(probe) -> None:
    gpus = probe.gpus()
    assert gpus and len({g.minor for g in gpus}) == len(gpus) and len({g.uuid for g in gpus}) == len(gpus)
    minors = [g.minor for g in gpus]
    got = probe.sample(minors)
    assert set(got) == set(minors)
    for m, s in got.items():
        assert s.minor == m and (s.used_bytes is None) == (s.error is not None)  # unknown is None with a reason, never 0
        assert all(p.pid > 0 and (p.used_bytes is None or p.used_bytes >= 0) for p in s.processes)


def test_fake_probe_keeps_the_gpu_probe_contract():
    """FakeProbe: one GpuInfo per minor (unique uuid), a sample per asked minor; a lost GPU is unknown with a reason."""
    host = FakeHost(FakeClock())
    probe = FakeProbe(host, (0, 1))
    probe.context(0, 256, host.add(129, minors={0}))
    _probe_contract(probe)
    probe.fail = {1}
    lost = probe.sample([0, 1])[1]
    assert lost.used_bytes is None and lost.error


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_ok(), reason="no NVIDIA GPU/NVML here (runs on the device machine)")
def test_nvml_readers_keep_the_gpu_probe_contract():
    """GPU: NVML's reader keeps the GpuProbe contract FakeProbe keeps, raw and as every command opens it (bounded)."""
    from pvegpu import wiring
    from pvegpu.adapters.nvml import NvmlProbe
    from pvegpu.core.settings import Settings

    for probe in (NvmlProbe(), wiring.nvml_reader(Settings()), wiring.nvml_reader(Settings(), details=True)):
        try:
            _probe_contract(probe)
        finally:
            probe.close()
