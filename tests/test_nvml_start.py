"""NVML that does not start (nvmlInit stuck in the driver, as after an Xid, or failing): a reset's first reading is
unknown and the audit's probe an error, each within the read deadline; the gate answers a guest granted no GPU
without waiting for NVML and refuses one granted a GPU (its GPU unknown)."""

from __future__ import annotations

import threading
import time

from pvegpu import wiring
from pvegpu.adapters.settingsfile import load
from pvegpu.cli import hook
from pvegpu.core import errors as E
from pvegpu.core.model import GpuSample
from pvegpu.core.settings import Settings
from tests.test_nvml_per_gpu import fake_pynvml, use


def _stuck_nvml(monkeypatch, release: threading.Event) -> None:
    """A pynvml whose nvmlInit sits in the driver (as after an Xid) until the test lets it go, then fails."""
    m = use(monkeypatch, fake_pynvml())

    def init() -> None:
        release.wait(30)
        raise m.NVMLError("Driver Not Loaded")

    m.nvmlInit = init


def while_nvml_start_hangs(monkeypatch, call, limit_extra: float = 5.0) -> tuple[bool, float, dict[str, object]]:
    """Run ``call(settings)`` in a thread while every nvmlInit sits in the driver: (whether it returned within the
    read deadline + ``limit_extra`` s, how long it took, ``{"value": ...}`` or ``{"error": ...}``); then NVML is let go."""
    release = threading.Event()
    _stuck_nvml(monkeypatch, release)
    s = load(None, env={}, snapshot_dir=None)
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call(s)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(wiring.read_deadline(s) + limit_extra)
    finished, took = not t.is_alive(), time.monotonic() - t0
    release.set()
    t.join(30)
    return finished, took, box


def test_a_reset_whose_nvml_start_hangs_gets_unknown_within_the_read_deadline(monkeypatch):
    """A reset's first GPU reading, with the warm-up's nvmlInit stuck in the driver, answers unknown within the read deadline."""

    def first_reading(s):
        probe = wiring.nvml_reader(s)
        probe.begin()
        return probe.sample([0])

    finished, took, box = while_nvml_start_hangs(monkeypatch, first_reading)
    assert finished, f"the reading was still waiting after {took:.1f} s"
    sample = box["value"]
    assert isinstance(sample, dict) and isinstance(sample[0], GpuSample) and sample[0].used_bytes is None


def test_an_audit_whose_nvml_start_hangs_reports_it_within_the_read_deadline(monkeypatch):
    """``pvegpu audit``'s probe, its nvmlInit stuck in the driver, gives up with an error within the read deadline."""
    monkeypatch.setattr(wiring, "pve_port", lambda s: object())  # no /etc/pve here: the audit's NVML is what is tried
    finished, took, box = while_nvml_start_hangs(monkeypatch, lambda s: wiring.world(s).audit_probe())
    assert finished, f"the audit's NVML start was still waiting after {took:.1f} s"
    assert isinstance(box.get("error"), E.GpuQueryError)


def _ct_100(tmp_path, conf: str) -> None:
    """An /etc/pve-like tree at ``tmp_path`` with CT 100 on node n1, its config ``conf``."""
    d = tmp_path / "nodes" / "n1" / "lxc"
    d.mkdir(parents=True)
    (tmp_path / ".vmlist").write_text('{"version": 1, "ids": {"100": {"node": "n1", "type": "lxc", "version": 1}}}')
    (d / "100.conf").write_text(conf)


def test_a_guest_without_a_gpu_is_answered_while_nvml_is_still_starting(tmp_path, monkeypatch):
    """A CT whose config grants no NVIDIA GPU is allowed without waiting for NVML's start (a hung driver delays only GPU guests)."""
    _ct_100(tmp_path, "hostname: plain\n")
    release, returned = threading.Event(), threading.Event()
    m = use(monkeypatch, fake_pynvml())

    def init():  # nvmlInit sits in the driver until the test lets it go
        release.wait(30)
        returned.set()
        raise m.NVMLError("Driver Not Loaded")

    m.nvmlInit = init
    try:
        verdict = hook._verdict(100, Settings(node="n1", pve_root=str(tmp_path)))
        answered_before_nvml = not returned.is_set()
    finally:
        release.set()
    assert verdict["allow"] is True and answered_before_nvml


def test_a_gpu_guest_is_refused_when_nvml_cannot_start(tmp_path, monkeypatch):
    """A CT granted a GPU is refused (its GPU unknown) when NVML's start fails."""
    _ct_100(tmp_path, "hostname: gpu\ndev0: /dev/nvidia0,gid=44\n")
    m = use(monkeypatch, fake_pynvml())

    def init():
        raise m.NVMLError("Driver Not Loaded")

    m.nvmlInit = init
    verdict = hook._verdict(100, Settings(node="n1", pve_root=str(tmp_path)))
    assert verdict["allow"] is False and verdict["json"]["gpus"][0]["state"] == "unknown"
