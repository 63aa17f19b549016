"""Review round 7: the audit's NVML reader on a failing driver, and the whole-node scan started ahead."""

from __future__ import annotations

import os
import time

import pytest

from pvegpu.adapters import scanpool
from pvegpu.adapters.devscan import ScanBudget
from pvegpu.adapters.procfs import ProcHost
from pvegpu.audit.run import run_audit
from pvegpu.core import errors as E
from tests.test_audit import NODES, FakeFiles
from tests.test_nvml_per_gpu import LOST, READ, _Err, _node, fake_pynvml, use
from tests.test_scan_ahead import _children, _stat_text, _table, small_shares, stall_workers, tree  # noqa: F401 - fixtures

ONE = [{"minor": 0, "uuid": "GPU-ok-0"}]


def _audit_reader(monkeypatch, m):
    """The reader ``pvegpu audit`` opens (``world(s).audit_probe``: details, started) over the stand-in pynvml ``m``."""
    from pvegpu import wiring
    from pvegpu.core.settings import Settings

    use(monkeypatch, m)
    probe = wiring.nvml_reader(Settings(), details=True)
    probe.start()
    return probe


def test_a_driver_without_pci_info_is_an_unknown_gpu_not_an_internal_error(monkeypatch):
    """A driver whose NVML lacks the PCI info call: the audit lists the GPU with bus '?' and unknown samples, never
    an error that ends the whole audit."""
    m = fake_pynvml(ONE)

    def pci(h):
        raise m.NVMLError_FunctionNotFound("Function Not Found")

    m.nvmlDeviceGetPciInfo = pci
    probe = _audit_reader(monkeypatch, m)
    (g,) = probe.gpus()
    assert g.bus_id == "?" and not probe.sample([0])[0].known
    host, pve = _node()
    pve.add_ct(129)
    rep = run_audit(pve=pve, probe=_audit_reader(monkeypatch, m), host=host, files=FakeFiles(NODES))
    assert [g.minor for g in rep.gpus] == [0]


def test_a_gpu_whose_minor_read_fails_is_named_lost_by_its_index(monkeypatch):
    """The audit's lost-GPU row text for a failing minor read: 'GPU 0: GPU is lost'."""
    m = fake_pynvml(ONE)

    def minor(h):
        raise _Err(LOST)

    m.nvmlDeviceGetMinorNumber = minor
    audit = _audit_reader(monkeypatch, m)
    with pytest.raises(E.GpuQueryError, match="no GPU can be read: GPU 0: GPU is lost"):
        audit.gpus()
    assert audit.lost == {0: "GPU 0: GPU is lost"}


def test_a_failing_gpu_count_is_reported_with_the_drivers_words(monkeypatch):
    """NVML that cannot count the GPUs: the audit's error says so, with the driver's words."""
    m = fake_pynvml(ONE)

    def count():
        raise _Err(READ)

    m.nvmlDeviceGetCount = count
    with pytest.raises(E.GpuQueryError) as exc:
        _audit_reader(monkeypatch, m).gpus()
    assert exc.value.message == f"NVML could not list the GPUs: {READ}"


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
