"""NVML started in a thread while the caller does its own work (the start gate's imports, ``/etc/pve``, ``/proc``).

Loading ``libnvidia-ml.so.1``, ``nvmlInit_v2`` and attaching each GPU (``nvmlDeviceGetHandleByIndex_v2``) cost
about 20 ms on the H200 (BENCHMARKS.md), all of it in C: ctypes releases the GIL for each call, so the thread
runs beside Python code on another core. ``NvmlLite(warm=...)`` waits for it (``join``) and goes on from its
state: the same reader, the same error texts; nothing is read here but the GPU count and the handles, and a
failure is kept for the reader to report (never a zero). The thread is a ``workers.Worker`` (``_thread``, no
``threading``: 3-5 ms before the thread could start); ``ctypes`` is imported before it starts: the thread starts
before the caller imports anything else, and then makes C calls only. A hang
inside the driver stays a hang of this process, so it is for code already under a deadline (the gate's forked
child, ``adapters/child.py``; a reset's reads are bounded by ``adapters/bounded.py``).
"""

from __future__ import annotations

from .workers import Worker

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:
    from typing import Any

LIBRARY = "libnvidia-ml.so.1"


class NvmlWarmup:
    """The library loaded and NVML initialised (once: the reader that takes it over shuts it down once)."""

    def __init__(self, library: str = LIBRARY) -> None:
        self.library = library
        self.lib: Any = None
        self.init_rc: int | None = None  # nvmlInit_v2's return code (0: started)
        self.error: BaseException | None = None  # the library could not be loaded (OSError), or lacks a call
        try:  # ctypes here, not in the thread: there its import waits for turns at the GIL between the caller's
            import ctypes  # noqa: F401 - imports (5.5 ms against 2.5 ms alone on the H200); the thread runs C calls only
        except ImportError:  # the thread meets it again and keeps it for the reader
            pass
        self._worker = Worker(self._run)

    def _run(self) -> None:
        try:
            import ctypes

            lib = ctypes.CDLL(self.library)
            rc = int(lib.nvmlInit_v2())
            self.lib, self.init_rc = lib, rc
            if rc == 0:  # attach every GPU now (the reader asks for the handles again: then they are at hand)
                count = ctypes.c_uint()
                if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0:
                    for i in range(count.value):
                        lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(ctypes.c_void_p()))
        except BaseException as exc:  # noqa: BLE001 - kept for the reader, which reports it
            self.error = exc

    def join(self) -> NvmlWarmup:
        """Wait until the thread has done its work (no deadline here: the caller's process is under one)."""
        self._worker.join()
        return self

    @property
    def finished(self) -> bool:
        return not self._worker.alive
