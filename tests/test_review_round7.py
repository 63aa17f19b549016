"""Review round 7: the audit's ctypes NVML reader against nvidia-ml-py's, and the whole-node scan started ahead."""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from pvegpu import errors as E
from pvegpu.adapters import scanpool
from pvegpu.adapters.bounded import BoundedProbe
from pvegpu.adapters.devscan import ScanBudget
from pvegpu.adapters.procfs import ProcHost
from pvegpu.audit import run_audit
from tests.test_audit import NODES, FakeFiles
from tests.test_nvml_per_gpu import LOST, READ, FakeLib, _Err, _node, fake_pynvml
from tests.test_scan_ahead import _children, _stat_text, _table, small_shares, stall_workers, tree  # noqa: F401 - fixtures

ONE = [{"minor": 0, "uuid": "GPU-ok-0"}]


class _NoPciV3(FakeLib):
    """A driver whose NVML lacks nvmlDeviceGetPciInfo_v3 (ctypes raises AttributeError for a missing symbol)."""

    def __getattribute__(self, name):
        if name == "nvmlDeviceGetPciInfo_v3":
            raise AttributeError(f"libnvidia-ml.so.1: undefined symbol: {name}", name=name)
        return super().__getattribute__(name)


def _audit_reader(monkeypatch, lib):
    from pvegpu import wiring

    monkeypatch.setattr(ctypes, "CDLL", lambda name: lib)
    return wiring.open_nvml()


def test_a_driver_without_pci_info_v3_is_an_unknown_gpu_not_an_internal_error(monkeypatch):
    """A driver lacking nvmlDeviceGetPciInfo_v3: the audit lists the GPU with bus '?' and unknown samples (as
    nvidia-ml-py's FunctionNotFound made it), never an AttributeError that ends the whole audit."""
    probe = _audit_reader(monkeypatch, _NoPciV3(ONE))
    (g,) = probe.gpus()
    assert g.bus_id == "?" and not probe.sample([0])[0].known
    host, pve = _node()
    pve.add_ct(129)
    rep = run_audit(pve=pve, probe=BoundedProbe(_audit_reader(monkeypatch, _NoPciV3(ONE)), 5), host=host,
                    files=FakeFiles(NODES))
    assert [g.minor for g in rep.gpus] == [0]


class _MinorLost(FakeLib):
    def nvmlDeviceGetMinorNumber(self, h, minor):
        return self.LOST_RC


def test_a_gpu_whose_minor_read_fails_is_named_as_nvidia_ml_py_named_it(monkeypatch):
    """The audit's lost-GPU row text is unchanged by the reader swap: 'GPU 0: GPU is lost' for a failing minor read."""
    m = fake_pynvml(ONE)

    def minor(h):
        raise _Err(LOST)

    m.nvmlDeviceGetMinorNumber = minor
    monkeypatch.setitem(__import__("sys").modules, "pynvml", m)
    from pvegpu.adapters.nvml import NvmlProbe

    full = NvmlProbe()
    with pytest.raises(E.GpuQueryError):
        full.gpus()
    audit = _audit_reader(monkeypatch, _MinorLost(ONE))
    with pytest.raises(E.GpuQueryError):
        audit.gpus()
    assert audit.lost == full.lost


class _CountFails(FakeLib):
    def nvmlDeviceGetCount_v2(self, count):
        return self.UNKNOWN_RC


def test_a_failing_gpu_count_is_reported_as_before(monkeypatch):
    """NVML that cannot count the GPUs: the audit's error message is the one nvidia-ml-py's reader gave."""
    m = fake_pynvml(ONE)

    def count():
        raise _Err(READ)

    m.nvmlDeviceGetCount = count
    monkeypatch.setitem(__import__("sys").modules, "pynvml", m)
    from pvegpu.adapters.nvml import NvmlProbe

    with pytest.raises(E.GpuQueryError) as old:
        NvmlProbe().gpus()
    with pytest.raises(E.GpuQueryError) as new:
        _audit_reader(monkeypatch, _CountFails(ONE)).gpus()
    assert new.value.message == old.value.message


def _add_pid(root, pid):
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_bytes(_stat_text(pid))
    (d / "fd" / "3").symlink_to("/dev/full")


def test_a_taken_prefetch_keeps_one_scan_deadline(small_shares, tree, monkeypatch):  # noqa: F811
    """holdings() taking a prefetch is bounded by the one budget.total (+ GRACE) from the prefetch, as the docstring
    says: the processes started since are not given a second, fresh budget.total."""
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
    _add_pid(tree, 7999)  # started after the prefetch listed /proc
    host.holdings()
    took = time.monotonic() - t
    assert took < 1.5 + 0.2 + 0.5, f"one whole-node scan took {took:.1f} s against a 1.5 s budget"
    scanpool.reap_exited()  # what the audit's done() does (cancel_prefetch): answered workers reaped
    assert _children() <= before


def test_an_interrupt_while_a_prefetch_is_taken_leaves_no_worker(small_shares, tree, monkeypatch):  # noqa: F811
    """An interrupt (or any error) while holdings() lists /proc again to take the prefetch: the workers are still
    ended (by holdings itself, or by cancel_prefetch, what the audit's done() calls), none left running."""
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


def test_an_audit_whose_nvml_start_hangs_reports_it_within_the_read_deadline(monkeypatch):
    """``pvegpu audit``'s NVML, its nvmlInit stuck in the driver: the audit's probe gives up within the read deadline
    with an error (the audit still checks the configs), never a hang of the command."""
    from pvegpu import wiring
    from tests.test_review_round5 import while_nvml_start_hangs

    monkeypatch.setattr(wiring, "pve_port", lambda s: object())  # no /etc/pve here: the audit's NVML is what is tried
    finished, took, box = while_nvml_start_hangs(monkeypatch, lambda s: wiring.world(s).audit_probe())
    assert finished, f"the audit's NVML start was still waiting after {took:.1f} s"
    assert isinstance(box.get("error"), E.GpuQueryError)
