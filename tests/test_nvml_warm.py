"""NVML started in a thread for the start gate (adapters/nvml_warm.py): what the reader makes of it."""

from __future__ import annotations

import threading
import time

import pytest

from pvegpu.errors import GpuQueryError


def test_a_missing_library_is_the_readers_error_not_a_crash():
    """A warm-up that cannot load libnvidia-ml leaves the reader raising the same GpuQueryError as without it."""
    from pvegpu.adapters.nvml_lite import NvmlLite
    from pvegpu.adapters.nvml_warm import NvmlWarmup

    with pytest.raises(GpuQueryError) as direct:
        NvmlLite("libnvidia-ml-does-not-exist.so.1")
    with pytest.raises(GpuQueryError) as warm:
        NvmlLite(warm=NvmlWarmup("libnvidia-ml-does-not-exist.so.1"))
    assert warm.value.exit_code == direct.value.exit_code and warm.value.message == direct.value.message


def test_no_scan_worker_is_forked_while_the_warm_up_runs(monkeypatch):
    """While NVML is being started in its thread, scanpool.forkable() is False (fork copies one thread); after
    the reader took it over (join), a scan may fork again."""
    import ctypes

    from pvegpu.adapters import scanpool
    from pvegpu.adapters.nvml_warm import NvmlWarmup

    release = threading.Event()

    class StuckLib:  # nvmlInit_v2 sits in the driver until the test lets it go
        def nvmlInit_v2(self):
            release.wait(30)
            return 9  # NVML_ERROR_DRIVER_NOT_LOADED

    monkeypatch.setattr(ctypes, "CDLL", lambda name: StuckLib())
    warm = NvmlWarmup()
    try:
        assert not scanpool.forkable()
    finally:
        release.set()
    warm.join()
    assert warm.init_rc == 9 and warm.error is None
    assert scanpool.forkable() == (threading.active_count() == 1)


def test_the_warm_up_thread_ends_with_its_answer():
    """After join the warm-up is done, no longer counted as running, and says why it did not start."""
    from pvegpu.adapters.nvml_warm import NvmlWarmup

    warm = NvmlWarmup("libnvidia-ml-does-not-exist.so.1").join()
    from pvegpu.adapters import workers

    assert warm.finished and not workers.running() and warm.lib is None and isinstance(warm.error, OSError)


def test_resets_reader_takes_the_warm_up_over_once(monkeypatch):
    """LazyNvml.warm_up starts NVML once; the first reading takes it over (no second nvmlInit), and a reopen
    after close starts NVML afresh: every start has its one shutdown."""
    import ctypes

    from pvegpu import wiring
    from pvegpu.settings import Settings
    from tests.test_nvml_per_gpu import FakeLib

    calls = {"init": 0, "shutdown": 0}

    class Counting(FakeLib):
        def nvmlInit_v2(self):
            calls["init"] += 1
            return 0

        def nvmlShutdown(self):
            calls["shutdown"] += 1
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Counting())
    lazy = wiring.LazyNvml(Settings())
    lazy.warm_up()
    lazy.warm_up()  # a second call starts nothing more
    assert [g.minor for g in lazy.gpus()] and calls["init"] == 1
    lazy.close()
    assert calls == {"init": 1, "shutdown": 1}
    lazy.gpus()
    lazy.close()
    assert calls == {"init": 2, "shutdown": 2}


def test_the_command_lines_reset_closes_nvml_behind_without_waiting(monkeypatch):
    """reset_ports(exiting=True) (the CLI, which exits right after its report) leaves nvmlShutdown (~3-8 ms on the
    H200) to a thread of its own: the ``with`` ends before it returns; any other user of reset_ports (the post-stop
    reclaim, the library) closes NVML in its own thread at the end."""
    import ctypes
    import threading

    from pvegpu import wiring
    from pvegpu.settings import Settings
    from tests.test_nvml_per_gpu import FakeLib

    shutdowns: list[int] = []
    release = threading.Event()

    class Counting(FakeLib):
        def nvmlShutdown(self):
            shutdowns.append(threading.get_ident())
            release.wait(5)
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Counting())
    for exiting in (True, False):
        shutdowns.clear()
        release.clear()
        if not exiting:
            release.set()
        world = wiring.NodeWorld(Settings(), False, None, None, None, None, (lambda lazy=wiring.LazyNvml(Settings()): lazy), lambda: None)
        with world.reset_ports(exiting=exiting) as ports:
            ports.probe.gpus()
        if exiting:  # out of the with at once; the shutdown runs (and waits) in another thread
            deadline = time.monotonic() + 5
            while not shutdowns and time.monotonic() < deadline:
                time.sleep(0.01)
            assert shutdowns and shutdowns[0] != threading.get_ident()
            release.set()
        else:
            assert shutdowns == [threading.get_ident()]
