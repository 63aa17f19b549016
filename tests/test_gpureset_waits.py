"""gpu-reset's waits longer than a second each say what they wait for (through ``on_step``), once."""

from __future__ import annotations

from pvegpu.core.model import GpuInfo, GpuSample
from pvegpu.gpureset.model import GpuResetPolicy, GpuResetPorts, GpuResetReport
from pvegpu.gpureset.procedure import _Run, _verify
from pvegpu.testing import FakeClock

GPU = GpuInfo(0, 0, "GPU-wait-0", "0000:01:00.0")


class _ComesBack:
    """NVML that does not list the GPU for the first ``absent`` seconds after the reset, then lists it idle."""

    def __init__(self, clock: FakeClock, absent: float) -> None:
        self.clock, self.back_at = clock, clock.t + absent

    def gpus(self) -> list[GpuInfo]:
        return [GPU] if self.clock.t >= self.back_at else []

    def sample(self, minors: object) -> dict[int, GpuSample]:
        return {0: GpuSample(0, 0, ())}


def _run(absent: float) -> tuple[_Run, list]:
    clock = FakeClock()
    said: list = []
    ports = GpuResetPorts(pve=None, probe=_ComesBack(clock, absent), host=None, clock=clock, control=None,  # type: ignore[arg-type]
                          on_step=said.append)
    return _Run(ports, GpuResetPolicy(), GpuResetReport(GPU)), said


def test_the_verify_wait_says_once_what_it_waits_for():
    """A GPU that takes seconds to come back after the reset: one progress line names the wait before the verdict."""
    run, said = _run(absent=5.0)
    _verify(run)
    waits = [s for s in said if s.name == "wait"]
    assert len(waits) == 1 and waits[0].outcome == "verify"
    assert "30 s" in waits[0].detail["msg"] and GPU.uuid in waits[0].detail["msg"]
    assert said.index(waits[0]) < next(i for i, s in enumerate(said) if s.name == "verify")


def test_a_gpu_back_at_once_shows_no_verify_wait():
    """No wait, no progress line."""
    run, said = _run(absent=0.0)
    _verify(run)
    assert not [s for s in said if s.name == "wait"]
