"""gpu-reset's waits longer than a second each say what they wait for (through ``on_step``), once."""

from __future__ import annotations

import pytest

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



class _SlowSmi:
    """nvidia-smi that takes seconds for each call (fake time); records what had been said when each call began."""

    def __init__(self, clock: FakeClock, said: list) -> None:
        self.clock, self.said = clock, said
        self.seen: list[list[str]] = []

    def persistence(self, gpu: GpuInfo, on: bool) -> None:
        self.seen.append([s.detail["msg"] for s in self.said])
        self.clock.sleep(3.0)


class _NoHolders:
    self_pid = 1

    def holdings(self) -> dict:
        return {}


def test_each_persistence_call_is_said_before_nvidia_smi_runs(monkeypatch):
    """``nvidia-smi -pm 0`` and ``-pm 1`` can take seconds: the command is shown before it runs, not only after."""
    from pvegpu.gpureset import procedure

    run, said = _run(absent=0.0)
    smi = _SlowSmi(run.p.clock, said)  # type: ignore[arg-type]
    run.p.control, run.p.host = smi, _NoHolders()  # type: ignore[assignment]
    run.r.persistence_before = True
    monkeypatch.setattr(procedure, "_run_reset", lambda r: None)
    procedure._reset(run)
    assert smi.seen[0][-1] == f"nvidia-smi -i {GPU.uuid} -pm 0"
    assert smi.seen[1][-1] == f"nvidia-smi -i {GPU.uuid} -pm 1"


def test_a_lock_the_filesystem_refuses_is_a_usage_error_not_a_traceback(tmp_path, monkeypatch):
    """An flock error other than "held by another" (ENOLCK on a filesystem without locks) is a one-line UsageError."""
    import errno as _errno
    import fcntl

    from pvegpu.adapters import drain
    from pvegpu.core.errors import UsageError

    def no_locks(fd, op):
        raise OSError(_errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    d = tmp_path / "drain"
    d.mkdir(mode=0o700)
    with pytest.raises(UsageError):
        with drain.gpu_lock(str(d), 0, "GPU 0"):
            pass
