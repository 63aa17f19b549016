"""Simulated NVML that behaves like the driver where it matters to pvegpu.

A CUDA context lives while any process holding it is alive: its owner, or a child that inherited the
owner's device fds. While it lives, its memory counts in ``used`` and its *owner's* pid is listed,
even after the owner died (the fork-after-init trap); a child that inherited it is never listed. The
bookkeeping is the one driver model (``sim/driver.py``) with its measured defaults: the per-context gap
in ``used``, and memory that returns ~0.15 s after the last holder died (the dead owner listed until then).
``leak_mib`` is memory no process holds. ``fail`` makes a GPU unreadable; ``hang`` makes reads slow.
``driver_ready: false`` on any GPU is a node whose driver is not loaded yet (boot): NVML cannot start.
Health knobs (absent = NVML cannot tell): ``reserved_mib``, ``remap_pending``, ``remap_failed``,
``retired_pages_pending``, ``mig_enabled``, ``driver_version``, ``recovery_action`` (``none``, ``gpu-reset``,
``node-reboot``, ...), ``ecc_volatile_uncorrected``, ``persistence_mode``; ``lost``: NVML cannot name the GPU; ``nvlink_active`` (active NVLinks; absent: unknown).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.procstat import read_stat
from pvegpu.core.errors import GpuQueryError
from pvegpu.core.model import MIB, GpuHealth, GpuInfo, GpuSample
from pvegpu.core.ports import Clock
from pvegpu.sim.driver import Context, DriverModel
from pvegpu.sim.state import SimState


def sim_bus_id(g: dict[str, Any]) -> str:
    """A simulated GPU's PCI bus id (as its NVML names it; its Xids in the node's kernel log name it too)."""
    return str(g.get("bus_id", f"0000:{0x41 + int(g['minor']):02x}:00.0"))


def proc_alive(pid: int, start: int) -> bool:
    """That very process exists and is not a zombie (``/proc/<pid>/stat``)."""
    st = read_stat(pid)
    return st is not None and st.state not in ("Z", "X") and st.start_ticks == start


class SimNvml:
    """NVML of the simulated node: the contexts the workloads registered, read through the one driver model
    (``sim/driver.py``: per-context gap, release latency, dead owners listed). The state lives in files (every
    pvegpu process of the simulated node sees the same driver), so the time a context's last holder was seen
    dead is kept in its file (``CLOCK_MONOTONIC`` is one clock for every process of the host)."""

    def __init__(self, state: SimState, clock: Clock | None = None) -> None:
        self.state = state
        self.clock: Clock = clock or SystemClock()
        self.failed: list[str] = []

    def gpus(self) -> list[GpuInfo]:
        """Every GPU but a ``lost`` one, which NVML cannot even name (``failed`` says so)."""
        gpus = self.state.gpus()
        if not gpus:
            raise GpuQueryError("NVML could not start: no GPU in the simulated node", "add gpus to the scenario")
        if any(g.get("driver_ready") is False for g in gpus):
            raise GpuQueryError("NVML could not start: Driver Not Loaded", "is the NVIDIA driver loaded on the host? try `nvidia-smi`")
        self.failed = [f"GPU {g.get('index', i)}: GPU is lost" for i, g in enumerate(gpus) if g.get("lost")]
        return [GpuInfo(int(g.get("index", i)), int(g["minor"]), str(g.get("uuid", f"GPU-sim-{g['minor']}")),
                        sim_bus_id(g), str(g.get("name", "Simulated GPU")),
                        int(g.get("total_mib", 81920)) * MIB) for i, g in enumerate(gpus) if not g.get("lost")]

    def _model(self) -> DriverModel:
        gpus = self.state.gpus()
        model = DriverModel(self.clock, lambda ident: proc_alive(*ident), [int(g["minor"]) for g in gpus])
        model.lost = {int(g["minor"]) for g in gpus if g.get("lost")}
        model.fail = {int(g["minor"]): str(g["fail"]) for g in gpus if g.get("fail")}
        model.leak = {int(g["minor"]): int(g.get("leak_mib", 0)) * MIB for g in gpus}
        holders = self.state.holders()
        for ctx in self.state.contexts():
            owner = (int(ctx["owner"]), int(ctx["start"]))
            kids = [(int(h["pid"]), int(h["start"])) for h in holders if int(h["owner"]) == owner[0]]
            c = model.open_context(int(ctx["gpu"]), int(ctx["bytes"]), owner, *kids, leaks=bool(ctx.get("leaks")), key=str(owner[0]))
            c.dead_since = None if ctx.get("dead_since") is None else float(ctx["dead_since"])
        return model

    def live_contexts(self) -> list[Context]:
        """The contexts the driver holds now; a released one's files are removed, a dying one's time of death kept."""
        model = self._model()
        before = list(model.contexts)
        live = model.live()
        kept = {id(c) for c in live}
        for c in before:
            if id(c) not in kept:
                if self.state.drop("ctx", c.owner_pid) and c.leaks:  # the one process that released it records the leak
                    self.state.set_gpus([g | {"leak_mib": int(g.get("leak_mib", 0)) + c.nbytes // MIB}
                                         if int(g["minor"]) == c.gpu else g for g in self.state.gpus()])
                for h in c.holders:
                    self.state.drop("holders", h[0])
            elif c.dead_since is not None:
                self.state.mark_context(c.owner_pid, c.dead_since)
        return live

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        minors = list(minors)
        gpus = {int(g["minor"]): g for g in self.state.gpus()}
        for m in minors:
            if (g := gpus.get(m)) is not None and g.get("hang") and not g.get("lost"):
                time.sleep(float(g["hang"]))
        self.live_contexts()
        return self._model().sample(minors)

    def health(self, minor: int) -> GpuHealth:
        """The scenario's health knobs for that GPU; a knob left out is unknown (None). A GPU it cannot name, or one
        with ``health_error``, fails the reading as the real adapter does (GpuQueryError)."""
        g = next((g for g in self.state.gpus() if int(g["minor"]) == minor), None)
        if g is None or g.get("health_error"):
            why = g.get("health_error") if g is not None else "NVML cannot name it"
            raise GpuQueryError(f"GPU minor {minor}: {why}, its health is unknown", "`nvidia-smi -q` shows what the driver says")

        def flag(name: str) -> bool | None:
            return None if g.get(name) is None else bool(g[name])

        reserved = g.get("reserved_mib")
        ecc = g.get("ecc_volatile_uncorrected")
        return GpuHealth(None if reserved is None else int(reserved) * MIB, flag("retired_pages_pending"), flag("remap_pending"),
                         flag("remap_failed"), flag("mig_enabled"), None if g.get("driver_version") is None else str(g["driver_version"]),
                         recovery_action=None if g.get("recovery_action") is None else str(g["recovery_action"]),
                         ecc_volatile_uncorrected=None if ecc is None else int(ecc), persistence_mode=flag("persistence_mode"),
                         lost=True if g.get("lost") else None)

    def nvlinks(self, minor: int) -> int | None:
        """The scenario's ``nvlink_active`` for that GPU; left out: NVML cannot tell (None)."""
        g = next((g for g in self.state.gpus() if int(g["minor"]) == minor), {})
        return None if g.get("nvlink_active") is None else int(g["nvlink_active"])
