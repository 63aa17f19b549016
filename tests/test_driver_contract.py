"""Contract: the driver model (``pvegpu/sim/driver.py``) shows what the real driver shows, through NVML's reader as
each command opens it. The same cases run against the model everywhere and against the GPU (marker ``gpu``) on the device
machine: per-context gap in ``used``, memory back within the release latency after SIGKILL, 0 with no context."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pvegpu.core.model import MIB
from pvegpu.sim.driver import GAP_BASE, GAP_PER_CONTEXT, RELEASE_LATENCY, DriverModel, context_gap
from tests.fakes import FakeClock
from tests.test_gpu import _nvml_ok

HOLD = ("import torch, time; x = torch.empty({mib} << 20, dtype=torch.uint8, device='cuda'); x.fill_(1); "
        "torch.cuda.synchronize(); print('ok', flush=True); time.sleep(600)")


def _gap(sample) -> int:
    return sample.used_bytes - sum(p.used_bytes or 0 for p in sample.processes)


# -- the cases, on the model (always) -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 4])
def test_model_gap_and_release(n):
    """Model: n contexts show the measured gap; after SIGKILL the memory is back within RELEASE_LATENCY, gap 0."""
    clock, alive = FakeClock(), set()
    m = DriverModel(clock, lambda ident: ident in alive, (0,))
    for pid in range(n):
        alive.add((pid, 1))
        m.open_context(0, 256 * MIB, (pid, 1))
    assert _gap(m.sample([0])[0]) == context_gap(n) == GAP_BASE + n * GAP_PER_CONTEXT
    alive.clear()
    m.sample([0])
    clock.sleep(RELEASE_LATENCY + 0.01)
    s = m.sample([0])[0]
    assert s.used_bytes == 0 and not s.processes


# -- the same cases, on the GPU ---------------------------------------------------------------------------------

def _torch_ok() -> bool:
    return subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True).returncode == 0




def _probes():
    """nvidia-ml-py's reader itself, then as the gate and reset open it (bounded, begun early) and as the audit does."""
    from pvegpu import wiring
    from pvegpu.adapters.nvml import NvmlProbe
    from pvegpu.core.settings import Settings

    begun, audit = wiring.nvml_reader(Settings()), wiring.nvml_reader(Settings(), details=True)
    begun.begin()
    audit.start()
    return [NvmlProbe(), begun, audit]


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_ok(), reason="no NVIDIA GPU/NVML here (runs on the device machine)")
def test_gpu_gap_and_release_match_the_model(n):
    """GPU, each reader: n CUDA contexts show the model's gap (within 1.5 MiB); after SIGKILL the memory is back
    within 0.2 s + one poll, with gap 0 (the model's latency is 0.15 s)."""
    if not _torch_ok():
        pytest.skip("torch with CUDA is not installed here")
    probes = _probes()
    minor = probes[0].gpus()[0].minor
    base = probes[0].sample([minor])[minor]
    if base.processes:
        pytest.skip("the GPU is in use by other processes")
    procs = [subprocess.Popen([sys.executable, "-c", HOLD.format(mib=256)], stdout=subprocess.PIPE, text=True) for _ in range(n)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ok"
        for probe in probes:
            s = probe.sample([minor])[minor]
            assert {q.pid for q in s.processes} >= {p.pid for p in procs}
            assert abs(_gap(s) - context_gap(n)) <= 1.5 * MIB, (_gap(s) / MIB, context_gap(n) / MIB)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        t0 = time.monotonic()
        while probes[0].sample([minor])[minor].used_bytes > base.used_bytes and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        waited = time.monotonic() - t0
        assert waited <= 0.2 + 0.05, waited
        for probe in probes:
            s = probe.sample([minor])[minor]
            assert not s.processes and s.used_bytes == base.used_bytes
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for probe in probes:
            close = getattr(probe, "close", None)
            if close:
                close()


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_ok(), reason="no NVIDIA GPU/NVML here (runs on the device machine)")
def test_gpu_the_audits_reader_names_every_gpu_and_reads_its_health():
    """GPU: the audit's reader (``wiring.nvml_reader`` with details) names every GPU as nvidia-ml-py's reader does
    (index, minor, uuid, bus id, name, total), each with a bus id and a total, and reads its health (the driver
    version known; what the GPU cannot tell is None, never a made-up value)."""
    from pvegpu import wiring
    from pvegpu.adapters.nvml import NvmlProbe
    from pvegpu.core.settings import Settings

    full, audit = NvmlProbe(details=True), wiring.nvml_reader(Settings(), details=True)
    try:
        audit.start()
        gpus = full.gpus()
        assert audit.gpus() == gpus and gpus and all(g.bus_id and g.bus_id != "?" and g.total_bytes for g in gpus)
        for g in gpus:
            h = audit.health(g.minor)
            assert h == full.health(g.minor) and h.driver_version
    finally:
        full.close()
        audit.close()
