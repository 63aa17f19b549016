"""`pvegpu` as a user runs it, on the bench node of ``bench_audit_sbs.py``, with a stand-in NVML (no GPU here).

Usage: python3 bench/audit_cli.py STATE [PVEGPU ARGS...]   (e.g. ``STATE audit --json``; PVEGPU_PVE_ROOT names the node's tree)

Nothing of pvegpu is imported ahead of the command: the patches are applied by an import hook only when pvegpu
itself imports their module, so every import and its cost stays where the command puts it:

- ``pynvml`` (nvidia-ml-py, the NVML reader the audit opens): each call it makes answers as
  ``bench_audit.StandInNvml`` does (8 GPUs, one owner pid with 1 GiB per holding container);
- ``pvegpu.adapters.devscan``: the device table without arguments maps the four stand-in devices to GPUs 0-3 (on a
  node it maps major 195);
- ``pvegpu.adapters.nodefiles``: ``/dev/nvidia*`` exist (the stand-ins), as on a GPU node;
- with ``BENCH_SCAN_WORKERS=N`` in the environment, ``pvegpu.adapters.procfs``: the whole-node scan uses at most N
  shares (1: serial), to time serial against forked workers as whole processes.

Then ``pvegpu.__main__.main`` runs, exactly as the ``pvegpu`` entry point does (it ends with ``os._exit``). Run as
``python -I -S audit_cli.py ...`` (what the .deb's launcher runs, ``packaging/launcher.py``), it puts the directories
named in ``BENCH_SITE_PATH`` after the standard library, as the launcher names the venv's site-packages.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAND_INS = ["/dev/full", "/dev/random", "/dev/urandom", "/dev/zero"]  # bench_audit.STAND_INS (not imported: it imports pvegpu)
GPUS, MIB = 8, 1 << 20


STATE = ""  # the bench node's state.json (argv[1])


def _owners() -> dict[int, list[int]]:
    """The owners by GPU: from ``STATE.marshal`` when the harness wrote one (``marshal`` is built in: the stand-in then
    imports nothing a node's NVML would not, where ``json`` brings ``re`` and ``enum``), else from the JSON."""
    try:
        import marshal

        with open(STATE + ".marshal", "rb") as f:
            return dict(marshal.load(f))
    except FileNotFoundError:
        import json

        with open(STATE) as f:
            return {int(k): v for k, v in json.load(f)["owners"].items()}


def patch_pynvml(N: object) -> None:  # noqa: C901 - one stand-in per call the adapter makes
    owners = _owners()

    class Obj:
        def __init__(self, **kw: object) -> None:
            self.__dict__.update(kw)

    def handle(i: int) -> int:
        if not 0 <= i < GPUS:
            raise N.NVMLError(N.NVML_ERROR_INVALID_ARGUMENT)  # type: ignore[attr-defined]
        return i

    def procs(h: int) -> list[Obj]:
        return [Obj(pid=p, usedGpuMemory=1024 * MIB) for p in owners.get(h, [])]

    def memory(h: int, version: object = None) -> Obj:
        return Obj(total=143771 * MIB, used=len(owners.get(h, [])) * 1024 * MIB, reserved=615 * MIB, free=0)

    def unsupported(*a: object) -> object:
        raise N.NVMLError(N.NVML_ERROR_NOT_SUPPORTED)  # type: ignore[attr-defined]

    table = {
        "nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetCount": lambda: GPUS,
        "nvmlDeviceGetHandleByIndex": handle, "nvmlDeviceGetMinorNumber": lambda h: h,
        "nvmlDeviceGetUUID": lambda h: f"GPU-bench-{h}", "nvmlDeviceGetName": lambda h: "Bench GPU",
        "nvmlDeviceGetPciInfo": lambda h: Obj(busIdLegacy=f"0000:{0x41 + h:02x}:00.0"),
        "nvmlDeviceGetMemoryInfo": memory, "nvmlDeviceGetComputeRunningProcesses": procs,
        "nvmlDeviceGetGraphicsRunningProcesses": lambda h: [], "nvmlDeviceGetMPSComputeRunningProcesses": lambda h: [],
        "nvmlDeviceGetRemappedRows": lambda h: (0, 0, 0, 0), "nvmlDeviceGetRetiredPagesPendingStatus": unsupported,
        "nvmlDeviceGetMigMode": lambda h: [0, 0], "nvmlSystemGetDriverVersion": unsupported,
    }
    for name, fn in table.items():
        setattr(N, name, fn)


def patch_devscan(mod: object) -> None:
    numbers = {(os.major(os.stat(d).st_rdev), os.minor(os.stat(d).st_rdev)): m for m, d in enumerate(STAND_INS)}
    cls = mod.DeviceTable  # type: ignore[attr-defined]
    init = cls.__init__

    def __init__(self: object, gpus: object = None, control: object = None, proc: str = "/proc") -> None:
        init(self, numbers if gpus is None else gpus, control, proc)

    cls.__init__ = __init__


def patch_nodefiles(mod: object) -> None:
    cls = mod.LocalNodeFiles  # type: ignore[attr-defined]
    exists = cls.exists

    def stand_in_exists(self: object, path: str) -> bool:
        return True if path.startswith("/dev/nvidia") else exists(self, path)

    cls.exists = stand_in_exists


def patch_procfs(mod: object) -> None:
    workers = os.environ.get("BENCH_SCAN_WORKERS")
    if not workers:
        return
    cls = mod.ProcHost  # type: ignore[attr-defined]
    init = cls.__init__

    def __init__(self: object, *a: object, **kw: object) -> None:
        init(self, *a, **kw)
        self.workers = int(workers)  # type: ignore[attr-defined]

    cls.__init__ = __init__


PATCHES = {"pynvml": patch_pynvml, "pvegpu.adapters.devscan": patch_devscan, "pvegpu.adapters.nodefiles": patch_nodefiles,
           "pvegpu.adapters.procfs": patch_procfs}


class _Loader:  # duck-typed (no importlib.abc: its import costs more than the code under test)
    def __init__(self, real: object, patch: object) -> None:
        self.real, self.patch = real, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> object:
        return self.real.create_module(spec)  # type: ignore[attr-defined]

    def exec_module(self, module: object) -> None:
        self.real.exec_module(module)  # type: ignore[attr-defined]
        self.patch(module)  # type: ignore[operator]


class _Finder:
    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)  # type: ignore[arg-type]
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, patch)  # type: ignore[assignment]
        return spec


if __name__ == "__main__":
    sys.meta_path.insert(0, _Finder())
    STATE = sys.argv[1]
    sys.argv = ["pvegpu", *sys.argv[2:]]
    if sys.flags.safe_path:  # -I (-P): no script directory first; as the .deb's launcher, the site-packages are named
        sys.path.insert(0, REPO)
        sys.path.extend(p for p in os.environ.get("BENCH_SITE_PATH", "").split(os.pathsep) if p)
    else:
        sys.path[0] = REPO  # as the installed entry point: pvegpu from the checkout, not bench/
    from pvegpu.__main__ import main

    main()
