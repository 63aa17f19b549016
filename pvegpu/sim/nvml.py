"""Simulated NVML that behaves like the driver where it matters to pvegpu.

A CUDA context lives while any process holding it is alive: its owner, or a child that inherited the
owner's device fds. While it lives, its memory counts in ``used`` and its *owner's* pid is listed,
even after the owner died (the fork-after-init trap); a child that inherited it is never listed.
``leak_mib`` is memory no process holds. ``fail`` makes a GPU unreadable; ``hang`` makes reads slow.
``driver_ready: false`` on any GPU is a node whose driver is not loaded yet (boot): NVML cannot start.
Health knobs (absent = NVML cannot tell): ``reserved_mib``, ``remap_pending``, ``remap_failed``,
``retired_pages_pending``, ``mig_enabled``, ``driver_version``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from ..errors import GpuQueryError
from ..model import MIB, GpuHealth, GpuInfo, GpuSample, NvmlProcess
from ..procstat import read_stat
from .state import SimState


def proc_alive(pid: int, start: int) -> bool:
    """That very process exists and is not a zombie (``/proc/<pid>/stat``)."""
    st = read_stat(pid)
    return st is not None and st.state not in ("Z", "X") and st.start_ticks == start


class SimNvml:
    def __init__(self, state: SimState) -> None:
        self.state = state
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
                        str(g.get("bus_id", f"0000:{0x41 + int(g['minor']):02x}:00.0")), str(g.get("name", "Simulated GPU")),
                        int(g.get("total_mib", 81920)) * MIB) for i, g in enumerate(gpus) if not g.get("lost")]

    def live_contexts(self) -> list[dict[str, object]]:
        holders = self.state.holders()
        live = []
        for ctx in self.state.contexts():
            owner, start = int(ctx["owner"]), int(ctx["start"])
            kept = proc_alive(owner, start) or any(
                int(h["owner"]) == owner and proc_alive(int(h["pid"]), int(h["start"])) for h in holders)
            if kept:
                live.append(ctx)
            else:  # the driver frees the context once its last holder is gone
                self.state.drop("ctx", owner)
                for h in holders:
                    if int(h["owner"]) == owner:
                        self.state.drop("holders", int(h["pid"]))
        return live

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        gpus = {int(g["minor"]): g for g in self.state.gpus()}
        live = self.live_contexts()
        out: dict[int, GpuSample] = {}
        for minor in minors:
            g = gpus.get(minor)
            if g is None or g.get("lost"):
                out[minor] = GpuSample(minor, None, None, "NVML: GPU not found" if g is None else "NVML: GPU is lost")
                continue
            if g.get("hang"):
                time.sleep(float(g["hang"]))
            if g.get("fail"):
                out[minor] = GpuSample(minor, None, None, f"NVML: {g['fail']}")
                continue
            ctxs = [c for c in live if int(c["gpu"]) == minor]  # type: ignore[call-overload]
            used = sum(int(c["bytes"]) for c in ctxs) + int(g.get("leak_mib", 0)) * MIB  # type: ignore[call-overload]
            procs = tuple(NvmlProcess(int(c["owner"]), int(c["bytes"])) for c in ctxs)  # type: ignore[call-overload]
            out[minor] = GpuSample(minor, used, procs)
        return out

    def health(self, minor: int) -> GpuHealth:
        """The scenario's health knobs for that GPU; a knob left out is unknown (None)."""
        g = next((g for g in self.state.gpus() if int(g["minor"]) == minor), {})

        def flag(name: str) -> bool | None:
            return None if g.get(name) is None else bool(g[name])

        reserved = g.get("reserved_mib")
        return GpuHealth(None if reserved is None else int(reserved) * MIB, flag("retired_pages_pending"), flag("remap_pending"),
                         flag("remap_failed"), flag("mig_enabled"), None if g.get("driver_version") is None else str(g["driver_version"]))
