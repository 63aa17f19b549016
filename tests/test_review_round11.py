"""Review of round 11 (speed changes that must keep behaviour identical): what does not."""

from __future__ import annotations

import copy
import pickle
import threading

from pvegpu.adapters.procstat import Stat, parse_stat

STAT_LINE = b"42 (a b) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 3 0 12345 0 0\n"


def test_stat_copies_and_pickles_as_the_namedtuple_did():
    """``Stat`` copies, deep-copies and pickles to an equal Stat, as ``namedtuple("Stat", ...)`` did."""
    st = parse_stat(STAT_LINE)
    assert st is not None and st.threads == 3 and st.start_ticks == 12345
    assert copy.copy(st) == st and copy.deepcopy(st) == st
    assert pickle.loads(pickle.dumps(st)) == st and type(pickle.loads(pickle.dumps(st))) is Stat


def test_stat_keeps_the_namedtuple_helpers():
    """``_replace``, ``_asdict``, ``_make`` and ``__match_args__`` are still there, as on the namedtuple."""
    st = parse_stat(STAT_LINE)
    assert st is not None
    assert st._replace(ppid=7).ppid == 7
    assert st._asdict()["comm"] == b"a b"
    assert Stat._make(tuple(st)) == st
    assert Stat.__match_args__ == Stat._fields


def test_a_guest_without_a_gpu_is_answered_while_nvml_is_still_starting(tmp_path, monkeypatch):
    """A CT whose config grants no NVIDIA GPU is allowed without waiting for NVML's start (a hung driver delays only GPU guests)."""
    from pvegpu.cli import hook
    from pvegpu.core.settings import Settings
    from tests.test_nvml_per_gpu import fake_pynvml, use

    conf = tmp_path / "nodes" / "n1" / "lxc"
    conf.mkdir(parents=True)
    (tmp_path / ".vmlist").write_text('{"version": 1, "ids": {"100": {"node": "n1", "type": "lxc", "version": 1}}}')
    (conf / "100.conf").write_text("hostname: plain\n")
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
    from pvegpu.cli import hook
    from pvegpu.core.settings import Settings
    from tests.test_nvml_per_gpu import fake_pynvml, use

    conf = tmp_path / "nodes" / "n1" / "lxc"
    conf.mkdir(parents=True)
    (tmp_path / ".vmlist").write_text('{"version": 1, "ids": {"100": {"node": "n1", "type": "lxc", "version": 1}}}')
    (conf / "100.conf").write_text("hostname: gpu\ndev0: /dev/nvidia0,gid=44\n")
    m = use(monkeypatch, fake_pynvml())

    def init():
        raise m.NVMLError("Driver Not Loaded")

    m.nvmlInit = init
    verdict = hook._verdict(100, Settings(node="n1", pve_root=str(tmp_path)))
    assert verdict["allow"] is False and verdict["json"]["gpus"][0]["state"] == "unknown"
