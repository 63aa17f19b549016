"""Build the ports for a command from the settings: the real node, or a simulated one."""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError
from ..settings import Settings
from .clock import SystemClock
from .etcpve import EtcPve, NodePve


def resolve_backend(s: Settings) -> str | None:
    """local (pvesh as root on a node), https, or None when no API can be used."""
    if s.api.backend != "auto":
        return s.api.backend
    if s.api.host:
        return "https"
    if EtcPve.present(s.pve_root) and os.geteuid() == 0:
        return "local"
    return None


def build_pve(s: Settings, need_api: bool = True) -> Any:
    """The PveApi: /etc/pve reads when on a node, the API for power actions (and reads elsewhere)."""
    if s.simulate:
        from ..sim.scenario import SimNode

        return SimNode(s.simulate).ports()[0]
    local = EtcPve(s.pve_root, node=s.node) if EtcPve.present(s.pve_root) else None
    api = None
    backend = resolve_backend(s) if need_api else None
    if backend:
        from dataclasses import replace

        from .pve import ProxmoxerPve, connect

        cfg = s.api
        if backend == "local":  # pvesh runs stop/start synchronously: never kill it before the task deadline
            cfg = replace(cfg, timeout=max(cfg.timeout, s.reset.task_timeout + 10))
        api = ProxmoxerPve(connect(cfg, backend), node=s.node or (local.local_node() if local else "") or "")
    if local is None and api is None:
        raise ConfigError(f"no Proxmox here: {s.pve_root}/.vmlist not found and no API configured",
                          "run on a PVE node as root, set api.host + token, or try `pvegpu demo`")
    return NodePve(local, api)


def build_probe(s: Settings) -> Any:
    if s.simulate:
        from ..sim.nvml import SimNvml
        from ..sim.state import SimState

        return SimNvml(SimState(s.simulate))
    from .nvml import NvmlProbe

    return NvmlProbe()


def build_host(s: Settings) -> Any:
    if s.simulate:
        from ..sim.host import SessionHost
        from ..sim.state import SimState

        return SessionHost(SimState(s.simulate))
    from .procfs import ProcHost

    return ProcHost()


def build_clock() -> SystemClock:
    return SystemClock()
