"""A minimal ctypes NVML reader: the start gate's, reset's and audit's.

The hookscript runs on every container start and should cost about what ``nvidia-smi --query-gpu=...``
costs; importing nvidia-ml-py alone takes ~26 ms on the H200 host, as long as the rest of the gate
(BENCHMARKS.md), and ~13 ms of every ``pvegpu audit``. This reader binds only the calls pvegpu makes, with
the same struct layouts as nvidia-ml-py (memory v2, process info v3/v2, PCI info v3), and the same policy:
a reading that fails is unknown (None), never zero. ``details`` (audit) also reads each GPU's PCI bus id and
total memory, and ``health()`` its row remapping, retired pages, MIG mode and driver, as
``adapters/nvml.py`` reads them through nvidia-ml-py; tests check that both readers agree (on a stand-in
driver, and on the H200).
"""

from __future__ import annotations

import ctypes

from ..errors import GpuQueryError
from ..model import GpuHealth, GpuInfo, GpuSample, NvmlProcess

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from .nvml_warm import NvmlWarmup

SUCCESS, NOT_SUPPORTED, INSUFFICIENT_SIZE, FUNCTION_NOT_FOUND = 0, 3, 7, 13
NOT_AVAILABLE = 2**64 - 1
_HINT = "is the NVIDIA driver loaded on the host? try `nvidia-smi`; pvegpu needs libnvidia-ml.so.1"  # as adapters/nvml.py


class _MemV2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong), ("reserved", ctypes.c_ulonglong),
                ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _MemV1(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _Proc(ctypes.Structure):  # nvmlProcessInfo_v2_t == _v3_t
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class _ProcV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class _Pci(ctypes.Structure):  # nvmlPciInfo_t (nvmlDeviceGetPciInfo_v3)
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint), ("bus", ctypes.c_uint),
                ("device", ctypes.c_uint), ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("busId", ctypes.c_char * 32)]


MEM_V2 = ctypes.sizeof(_MemV2) | (2 << 24)  # nvmlMemory_v2, as nvidia-ml-py defines it
MIG_ENABLE = 1  # NVML_DEVICE_MIG_ENABLE


class NvmlLite:
    """GpuProbe over libnvidia-ml.so.1 with ctypes; raises GpuQueryError when NVML cannot start."""

    def __init__(self, library: str = "libnvidia-ml.so.1", warm: NvmlWarmup | None = None, details: bool = False) -> None:
        """``warm``: NVML already being started in a thread (``adapters/nvml_warm.py``): waited for, taken over.
        ``details``: ``gpus()`` also reads each GPU's PCI bus id, name and total memory (audit), any of which failing
        makes its samples unknown, as nvidia-ml-py's reader does; without it (gate, reset) the name is display only."""
        self.details = details
        if warm is not None:
            library = warm.library
            warm.join()
        try:
            if warm is not None and warm.error is not None:
                raise warm.error
            self.lib: Any = warm.lib if warm is not None and warm.lib is not None else ctypes.CDLL(library)
            self.lib.nvmlErrorString.restype = ctypes.c_char_p
        except OSError as exc:  # the words nvidia-ml-py's reader used
            raise GpuQueryError("NVML could not start: NVML Shared Library Not Found", _HINT) from exc
        except AttributeError as exc:
            raise GpuQueryError(f"the driver's NVML lacks {exc.name or 'a call'}", "driver too old for pvegpu") from exc
        except Exception as exc:  # noqa: BLE001 - whatever the warm-up thread met: NVML did not start
            raise GpuQueryError(f"NVML could not start: {type(exc).__name__}: {exc}", _HINT) from exc
        rc = warm.init_rc if warm is not None and warm.init_rc is not None else self.lib.nvmlInit_v2()
        self._check(rc, "NVML could not start")
        self._handles: dict[int, ctypes.c_void_p] = {}
        self.lost: dict[int, str] = {}  # NVML index -> why: GPUs the last gpus() could not name (no handle, no minor)
        self._broken: dict[int, str] = {}  # minor -> why: listed, but an identity read failed: every sample is unknown

    def _err(self, rc: int) -> str:
        return (self.lib.nvmlErrorString(rc) or b"error %d" % rc).decode()

    def _check(self, rc: int, what: str) -> None:
        if rc != SUCCESS:
            raise GpuQueryError(f"{what}: {self._err(rc)}", _HINT)

    def _rc(self, name: str, *args: Any) -> int:
        """One NVML call's return code; FUNCTION_NOT_FOUND when this driver's library lacks the call (a failed
        read like any other: that GPU's reading is unknown, never the whole reader gone)."""
        fn = getattr(self.lib, name, None)
        return FUNCTION_NOT_FOUND if fn is None else int(fn(*args))

    def close(self) -> None:
        self.lib.nvmlShutdown()

    def _fn(self, *names: str) -> tuple[Any, str]:
        for name in names:
            try:
                return getattr(self.lib, name), name
            except AttributeError:
                continue
        raise GpuQueryError(f"the driver's NVML lacks {names[0]}", "driver too old for pvegpu")

    def gpus(self) -> list[GpuInfo]:
        """Every GPU NVML can name. One that fails does not hide the others: a GPU whose handle or minor number
        cannot be read (lost, fallen off the bus) is left out and named in ``lost`` (index -> why); one whose UUID
        cannot be read is listed, and every ``sample()`` of it is unknown with the reason. Raises only when NVML
        cannot count the GPUs, or none can be read."""
        count = ctypes.c_uint()
        self._check(self._rc("nvmlDeviceGetCount_v2", ctypes.byref(count)), "NVML could not list the GPUs")
        out: list[GpuInfo] = []
        self.lost, self._broken = {}, {}
        for i in range(count.value):
            try:
                out.append(self._gpu(i))
            except GpuQueryError as exc:
                self.lost[i] = exc.message
        if count.value and not out:
            raise GpuQueryError("no GPU can be read: " + "; ".join(self.failed), _HINT)
        return out

    @property
    def failed(self) -> list[str]:
        """Why each GPU the last ``gpus()`` left out could not be read."""
        return list(self.lost.values())

    def _gpu(self, i: int) -> GpuInfo:
        h = ctypes.c_void_p()
        self._check(self._rc("nvmlDeviceGetHandleByIndex_v2", i, ctypes.byref(h)), f"GPU {i}")
        minor, buf, name = ctypes.c_uint(), ctypes.create_string_buffer(96), ctypes.create_string_buffer(96)
        self._check(self._rc("nvmlDeviceGetMinorNumber", h, ctypes.byref(minor)), f"GPU {i}")
        self._handles[minor.value] = h
        rc = self._rc("nvmlDeviceGetUUID", h, buf, 96)
        if rc != SUCCESS:
            self._broken[minor.value] = f"NVML: GPU {i} uuid: {self._err(rc)}"
        name_rc = self._rc("nvmlDeviceGetName", h, name, 96)  # display only, unless details: an empty name is no failure
        if not self.details:
            return GpuInfo(i, minor.value, buf.value.decode() if rc == SUCCESS else "?", "", name.value.decode())
        pci, m1 = _Pci(), _MemV1()
        bus_rc = self._rc("nvmlDeviceGetPciInfo_v3", h, ctypes.byref(pci))
        total_rc = self._rc("nvmlDeviceGetMemoryInfo", h, ctypes.byref(m1))  # the total as nvidia-ml-py reads it (v1)
        for key, got in (("bus", bus_rc), ("name", name_rc), ("total", total_rc)):
            if got != SUCCESS:
                self._broken.setdefault(minor.value, f"NVML: GPU {i} {key}: {self._err(got)}")
        return GpuInfo(i, minor.value, buf.value.decode() if rc == SUCCESS else "?",
                       pci.busIdLegacy.decode().lower() if bus_rc == SUCCESS else "?",
                       name.value.decode() if name_rc == SUCCESS else "", int(m1.total) if total_rc == SUCCESS else None)

    def _memory(self, h: ctypes.c_void_p) -> _MemV2 | _MemV1:
        """The memory struct, v2 (``used`` without the driver's reserved share) where the driver has it, else v1."""
        try:
            fn, _ = self._fn("nvmlDeviceGetMemoryInfo_v2")
        except GpuQueryError:
            m1 = _MemV1()
            self._check(self.lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m1)), "memory")
            return m1
        m = _MemV2(version=MEM_V2)
        self._check(fn(h, ctypes.byref(m)), "memory")
        return m

    def health(self, minor: int) -> GpuHealth:
        """``nvidia-smi -q -i <minor> -d MEMORY,ROW_REMAPPER,PAGE_RETIREMENT`` + ``--query-gpu=mig.mode.current``;
        each value None when the GPU or driver cannot tell (unknown, never 0)."""
        h = self._handles.get(minor)
        if h is None:
            try:
                self.gpus()
            except GpuQueryError:
                return GpuHealth()
            h = self._handles.get(minor)
            if h is None:
                return GpuHealth()
        lib = self.lib

        def call(name: str, *args: Any) -> bool:
            fn = getattr(lib, name, None)
            return fn is not None and fn(*args) == SUCCESS

        try:
            mem = self._memory(h)
            reserved = getattr(mem, "reserved", None)
        except GpuQueryError:
            reserved = None
        corr, unc, pending, failed = (ctypes.c_uint() for _ in range(4))
        remap = call("nvmlDeviceGetRemappedRows", h, ctypes.byref(corr), ctypes.byref(unc), ctypes.byref(pending),
                     ctypes.byref(failed))
        retired = ctypes.c_uint()
        has_retired = call("nvmlDeviceGetRetiredPagesPendingStatus", h, ctypes.byref(retired))
        mig, mig_pending = ctypes.c_uint(), ctypes.c_uint()
        has_mig = call("nvmlDeviceGetMigMode", h, ctypes.byref(mig), ctypes.byref(mig_pending))
        driver = ctypes.create_string_buffer(80)
        has_driver = call("nvmlSystemGetDriverVersion", driver, ctypes.c_uint(80))
        return GpuHealth(
            reserved_bytes=None if reserved is None else int(reserved),
            retired_pages_pending=bool(retired.value) if has_retired else None,
            remap_pending=bool(pending.value) if remap else None,
            remap_failed=bool(failed.value) if remap else None,
            mig_enabled=mig.value == MIG_ENABLE if has_mig else None,
            driver_version=driver.value.decode() if has_driver else None,
        )

    def _used(self, h: ctypes.c_void_p) -> int:
        return int(self._memory(h).used)

    def _procs(self, h: ctypes.c_void_p, kind: str, optional: bool) -> list[NvmlProcess]:
        base = {"C": "nvmlDeviceGetComputeRunningProcesses", "G": "nvmlDeviceGetGraphicsRunningProcesses",
                "M": "nvmlDeviceGetMPSComputeRunningProcesses"}[kind]
        fn, name = self._fn(base + "_v3", base + "_v2", base)
        struct = _ProcV1 if name == base else _Proc
        count = ctypes.c_uint(0)
        rc = fn(h, ctypes.byref(count), None)
        if rc == SUCCESS:
            return []
        if rc == NOT_SUPPORTED and optional:
            return []
        if rc != INSUFFICIENT_SIZE:
            self._check(rc, f"{kind} process list")
        arr = (struct * (count.value * 2 + 5))()
        count = ctypes.c_uint(len(arr))
        self._check(fn(h, ctypes.byref(count), arr), f"{kind} process list")
        return [NvmlProcess(int(p.pid), None if p.usedGpuMemory == NOT_AVAILABLE else int(p.usedGpuMemory), kind)
                for p in arr[: count.value]]

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        out: dict[int, GpuSample] = {}
        for minor in minors:
            try:
                if minor not in self._handles:
                    self.gpus()
                h = self._handles[minor]
                if minor in self._broken:
                    out[minor] = GpuSample(minor, None, None, self._broken[minor])
                    continue
                used = self._used(h)
                seen: dict[int, NvmlProcess] = {}
                for kind, optional in (("C", False), ("G", True), ("M", True)):
                    for p in self._procs(h, kind, optional):
                        seen.setdefault(p.pid, p)
                out[minor] = GpuSample(minor, used, tuple(seen.values()))
            except (GpuQueryError, KeyError) as exc:
                out[minor] = GpuSample(minor, None, None, f"NVML: {getattr(exc, 'message', None) or 'GPU not found'}")
        return out
