"""Host NVML through nvidia-ml-py: pvegpu's one NVML reader (the start gate, reset and audit).

Memory is read with ``nvmlDeviceGetMemoryInfo`` version 2 (``used`` = allocated, without the driver's
reserved share), falling back to v1 only where the driver lacks v2. A failed reading is None plus a
reason, never zero; a GPU that fails never hides the others. Every call can sit in the driver: commands read
through ``adapters/bounded.py`` (``wiring.nvml_reader``), which also runs ``NvmlProbe()`` (``nvmlInit``) under
its deadline. Manual equivalent: ``nvidia-smi --query-gpu=index,minor_number,uuid,memory.used``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pvegpu.core.errors import GpuQueryError
from pvegpu.core.model import RECOVERY_ACTIONS, GpuHealth, GpuInfo, GpuSample, NvmlProcess

# nvidia-ml-py that cannot be imported (its directory gone from the guard's fast path, a broken install) is NVML that
# cannot start: each reading says so (the gate refuses with its code, every other phase passes), not an ImportError
# that fails every command and every hookscript phase before a word is said
try:
    import pynvml
except Exception as exc:  # noqa: BLE001 - whatever the import raised is the reason given
    pynvml = None  # type: ignore[assignment]
    _UNIMPORTABLE: str | None = f"{type(exc).__name__}: {exc}"
else:
    _UNIMPORTABLE = None

_HINT = "is the NVIDIA driver loaded on the host? try `nvidia-smi`; pvegpu needs libnvidia-ml.so.1"
_IMPORT_HINT = ("reinstall pvegpu (nvidia-ml-py is its dependency), then `pvegpu hook install` to write the guard's "
                "import path again")


class NvmlProbe:
    """GpuProbe backed by the real driver; raises GpuQueryError when NVML cannot start. Use as a context manager,
    or call close().

    ``details`` (audit): ``gpus()`` also reads each GPU's PCI bus id and total memory, any identity read failing
    making its samples unknown; without it (the gate, reset) only the UUID counts, and the name is display only."""

    def __init__(self, *, details: bool = False) -> None:
        self.N: Any = pynvml  # the module, looked up now: a test puts a stand-in driver in its place
        self.details = details
        if self.N is None:
            raise GpuQueryError(f"NVML could not start: nvidia-ml-py (pynvml) cannot be imported ({_UNIMPORTABLE})", _IMPORT_HINT)
        try:
            self.N.nvmlInit()
        except self.N.NVMLError as exc:
            raise GpuQueryError(f"NVML could not start: {exc}", _HINT) from exc
        self._handles: dict[int, Any] = {}
        self.lost: dict[int, str] = {}  # NVML index -> why: GPUs the last gpus() could not name (no handle, no minor)
        self._broken: dict[int, str] = {}  # minor -> why: listed, but an identity read failed: every sample is unknown
        self._v2 = True

    def close(self) -> None:
        try:
            self.N.nvmlShutdown()
        except self.N.NVMLError:
            pass

    def __enter__(self) -> NvmlProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def gpus(self) -> list[GpuInfo]:
        """Every GPU NVML can name, by index. One that fails does not hide the others: a GPU whose handle or minor
        number cannot be read (lost, fallen off the bus) is left out and named in ``lost`` (index -> why); one whose
        other identity reads fail is listed with what is known, and every ``sample()`` of it is unknown with the
        reason. Raises only when NVML cannot count the GPUs, or none can be read."""
        N = self.N
        try:
            count = int(N.nvmlDeviceGetCount())
        except N.NVMLError as exc:
            raise GpuQueryError(f"NVML could not list the GPUs: {exc}", _HINT) from exc
        out: list[GpuInfo] = []
        self.lost, self._broken = {}, {}
        for i in range(count):
            try:
                h = N.nvmlDeviceGetHandleByIndex(i)
                minor = int(N.nvmlDeviceGetMinorNumber(h))
            except N.NVMLError as exc:
                self.lost[i] = f"GPU {i}: {exc or type(exc).__name__}"
                continue
            self._handles[minor] = h
            out.append(self._identity(i, minor, h))
        if count and not out:
            raise GpuQueryError("no GPU can be read: " + "; ".join(self.failed), _HINT)
        return out

    def _identity(self, i: int, minor: int, h: Any) -> GpuInfo:
        N = self.N
        reads: dict[str, Any] = {"uuid": N.nvmlDeviceGetUUID, "name": N.nvmlDeviceGetName}
        if self.details:
            reads |= {"bus": lambda h: N.nvmlDeviceGetPciInfo(h).busIdLegacy, "total": lambda h: N.nvmlDeviceGetMemoryInfo(h).total}
        known: dict[str, Any] = {}
        for key, read in reads.items():
            try:
                known[key] = read(h)
            except N.NVMLError as exc:
                if key != "name" or self.details:  # without details the name is display only: no failure
                    self._broken.setdefault(minor, f"NVML: GPU {i} {key}: {exc or type(exc).__name__}")
        total = known.get("total")
        bus = _s(known.get("bus", "?")).lower() if self.details else ""
        return GpuInfo(i, minor, _s(known.get("uuid", "?")), bus, _s(known.get("name", "")), None if total is None else int(total))

    @property
    def failed(self) -> list[str]:
        """Why each GPU the last ``gpus()`` left out could not be read."""
        return list(self.lost.values())

    def _memory_used(self, h: Any) -> int:
        N = self.N
        if self._v2:
            try:
                return int(N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2).used)
            except N.NVMLError_FunctionNotFound:
                self._v2 = False  # driver < 510: v1 'used' includes the reserved share
        return int(N.nvmlDeviceGetMemoryInfo(h).used)

    def _procs(self, name: str, h: Any, kind: str, optional: bool) -> list[NvmlProcess]:
        N = self.N
        try:
            items = getattr(N, name)(h)
        except N.NVMLLibraryMismatchError:
            items = getattr(N, name + "_v2")(h)
        except N.NVMLError_NotSupported:
            if optional:  # the GPU has no such engine (graphics/MPS): nothing can run there
                return []
            raise
        return [NvmlProcess(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory), kind) for p in items]

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        """Memory used and the processes NVML lists, per GPU; a GPU that cannot be read is unknown with the reason."""
        N = self.N
        out: dict[int, GpuSample] = {}
        for minor in minors:
            try:
                h = self._handles.get(minor)
                if h is None:
                    self.gpus()
                    h = self._handles[minor]
                if minor in self._broken:
                    out[minor] = GpuSample(minor, None, None, self._broken[minor])
                    continue
                used = self._memory_used(h)
                procs = (
                    self._procs("nvmlDeviceGetComputeRunningProcesses", h, "C", False)
                    + self._procs("nvmlDeviceGetGraphicsRunningProcesses", h, "G", True)
                    + self._procs("nvmlDeviceGetMPSComputeRunningProcesses", h, "M", True)
                )
                seen: dict[int, NvmlProcess] = {}
                for p in procs:
                    seen.setdefault(p.pid, p)
                out[minor] = GpuSample(minor, used, tuple(seen.values()))
            except KeyError:
                out[minor] = GpuSample(minor, None, None, "NVML: GPU not found")
            except (N.NVMLError, GpuQueryError) as exc:
                out[minor] = GpuSample(minor, None, None, f"NVML: {getattr(exc, 'message', None) or exc or type(exc).__name__}")
        return out

    def _try(self, fn: str, *args: Any, lost: list[bool] | None = None) -> Any:
        """One NVML call; None when the GPU or driver cannot tell (NotSupported, any NVML error): unknown, never 0.
        ``lost`` gets True appended when the driver answered that the GPU is lost."""
        try:
            return getattr(self.N, fn)(*args)
        except self.N.NVMLError as exc:
            if lost is not None and getattr(exc, "value", None) == getattr(self.N, "NVML_ERROR_GPU_IS_LOST", 15):
                lost.append(True)
            return None
        except AttributeError:
            return None

    def _recovery_action(self, h: Any, lost: list[bool]) -> str | None:
        """``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` by name; None where the driver has no such field (older than R565)."""
        N = self.N
        field_id = getattr(N, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        got = None if field_id is None else self._try("nvmlDeviceGetFieldValues", h, [field_id], lost=lost)
        if not got or getattr(got[0], "nvmlReturn", 1) != getattr(N, "NVML_SUCCESS", 0):
            return None
        v = got[0].value
        raw = {0: v.dVal, 1: v.uiVal, 2: v.ulVal, 3: v.ullVal, 4: v.sllVal, 5: v.siVal}.get(int(got[0].valueType), v.uiVal)
        return RECOVERY_ACTIONS.get(int(raw), f"unknown-{int(raw)}")

    def _handle(self, minor: int) -> Any:
        """The GPU's NVML handle, the GPUs listed first if they were not yet; None when NVML cannot name it."""
        if minor not in self._handles:
            try:
                self.gpus()
            except GpuQueryError:
                return None
        return self._handles.get(minor)

    def health(self, minor: int) -> GpuHealth:
        """``nvidia-smi -q -i <minor> -d MEMORY,ROW_REMAPPER,PAGE_RETIREMENT`` + ``--query-gpu=mig.mode.current``; for the audit."""
        N = self.N
        if (h := self._handle(minor)) is None:
            raise GpuQueryError(f"GPU minor {minor}: NVML cannot name it, its health is unknown", _HINT)
        lost: list[bool] = []
        mem = self._try("nvmlDeviceGetMemoryInfo", h, N.nvmlMemory_v2, lost=lost) if self._v2 else None
        reserved = getattr(mem, "reserved", None)
        remap = self._try("nvmlDeviceGetRemappedRows", h, lost=lost)  # (corrected, uncorrected, isPending, failureOccurred)
        retired = self._try("nvmlDeviceGetRetiredPagesPendingStatus", h, lost=lost)
        mig = self._try("nvmlDeviceGetMigMode", h, lost=lost)  # [current, pending]
        driver = self._try("nvmlSystemGetDriverVersion")
        ecc = self._try("nvmlDeviceGetTotalEccErrors", h, getattr(N, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                        getattr(N, "NVML_VOLATILE_ECC", 0), lost=lost)
        persistence = self._try("nvmlDeviceGetPersistenceMode", h, lost=lost)
        action = self._recovery_action(h, lost)
        return GpuHealth(
            reserved_bytes=None if reserved is None else int(reserved),
            retired_pages_pending=None if retired is None else bool(retired),
            remap_pending=None if remap is None else bool(remap[2]),
            remap_failed=None if remap is None else bool(remap[3]),
            mig_enabled=None if mig is None else bool(mig[0] == getattr(N, "NVML_DEVICE_MIG_ENABLE", 1)),
            driver_version=None if driver is None else _s(driver),
            recovery_action=action,
            ecc_volatile_uncorrected=None if ecc is None else int(ecc),
            persistence_mode=None if persistence is None else bool(persistence == getattr(N, "NVML_FEATURE_ENABLED", 1)),
            lost=True if lost else None,
        )

    def nvlinks(self, minor: int) -> int | None:
        """How many of the GPU's NVLinks are active (``nvidia-smi nvlink -s -i <minor>``); None when it cannot tell: no
        handle, an error, or NotSupported for the first link (a GPU without NVLink says so, but so does an NVLinked
        SXM GPU alone in a VM: unknown, never "none"). NotSupported or InvalidArgument past the first: its last link."""
        N = self.N
        if (h := self._handle(minor)) is None:
            return None
        active = 0
        for link in range(int(getattr(N, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                state = N.nvmlDeviceGetNvLinkState(h, link)
            except N.NVMLError as exc:
                code = getattr(exc, "value", None)
                if link and code in (getattr(N, "NVML_ERROR_NOT_SUPPORTED", 3), getattr(N, "NVML_ERROR_INVALID_ARGUMENT", 2)):
                    break  # past the GPU's last link
                return None
            except AttributeError:
                return None
            active += int(state == getattr(N, "NVML_FEATURE_ENABLED", 1))
        return active


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
