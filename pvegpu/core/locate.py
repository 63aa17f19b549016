"""Find a container, its node and the GPUs its configuration grants.

Manual equivalent: ``pvesh get /cluster/resources --type vm`` to find the node, then
``cat /etc/pve/nodes/<node>/lxc/<vmid>.conf`` and ``nvidia-smi --query-gpu=index,minor_number``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pvegpu.core.errors import NotFoundError, UsageError
from pvegpu.core.lxcconf import CtConfig, parse_config
from pvegpu.core.model import GpuInfo, Guest
from pvegpu.core.ports import GpuProbe, PveReader


@dataclass(frozen=True)
class Located:
    guest: Guest
    config: CtConfig
    gpus: tuple[GpuInfo, ...]  # granted GPUs present on this node, by minor
    missing_minors: tuple[int, ...]  # granted in config, no such GPU on the node


def check_vmid(text: str | int) -> int:
    """A vmid as PVE accepts it (ASCII digits, 100..999999999), or a UsageError.

    ``int()`` alone would take full-width or Arabic-Indic digits, ``+129`` and ``1_29`` as 129."""
    digits = text if isinstance(text, int) and not isinstance(text, bool) else None
    if digits is None:
        s = str(text).strip()
        if not (s.isascii() and s.isdigit() and len(s) <= 10):
            raise UsageError(f"{str(text)!r} is not a container id", "give the numeric CT id, e.g. `pvegpu reset 129`")
        digits = int(s)
    vmid = digits
    if not 100 <= vmid <= 999_999_999:
        raise UsageError(f"{vmid} is not a valid Proxmox guest id", "guest ids are 100..999999999 (`pct list`)")
    return vmid


def find_guest(vmid: int, pve: PveReader, *, require_local: bool = True) -> Guest:
    """The container ``vmid``; refuses unknown ids, VMs, and (by default) other nodes, naming the node."""
    guest = pve.where(vmid)
    if guest is None:
        raise NotFoundError(f"no guest {vmid} in this cluster", "list containers with `pct list` or `pvesh get /cluster/resources --type vm`")
    if guest.type != "lxc":
        raise NotFoundError(
            f"guest {vmid} is a {guest.type} VM, not an LXC container",
            "pvegpu manages GPUs shared into LXC containers; a VM's passthrough GPU is not visible to host NVML",
        )
    local = pve.local_node()
    if require_local and local is not None and guest.node != local:
        raise NotFoundError(
            f"CT {vmid} lives on node {guest.node}, this is {local}",
            f"run it there: `ssh {guest.node} pvegpu reset {vmid}`",
        )
    return guest


def granted_gpus(config: CtConfig, node_gpus: list[GpuInfo]) -> tuple[tuple[GpuInfo, ...], tuple[int, ...]]:
    """Map the config's /dev/nvidiaN minors to NVML GPUs by minor number (not index)."""
    if config.gpus.all_gpus:
        return tuple(sorted(node_gpus, key=lambda g: g.minor)), ()
    by_minor = {g.minor: g for g in node_gpus}
    found = tuple(by_minor[m] for m in sorted(config.gpus.minors) if m in by_minor)
    missing = tuple(m for m in sorted(config.gpus.minors) if m not in by_minor)
    return found, missing


def locate(vmid: int, *, pve: PveReader, probe: GpuProbe, require_local: bool = True) -> Located:
    """Guest, parsed config and granted GPUs of container ``vmid``."""
    guest = find_guest(vmid, pve, require_local=require_local)
    config = parse_config(pve.ct_config(guest))
    if not config.gpus.minors and not config.gpus.all_gpus:
        raise NotFoundError(
            f"CT {vmid} has no NVIDIA GPU in its configuration",
            "pvegpu looks for devN: /dev/nvidiaN, lxc.mount.entry: /dev/nvidiaN ..., or lxc.cgroup2.devices.allow: c 195:* (pct config %d)" % vmid,
        )
    gpus, missing = granted_gpus(config, probe.gpus())
    return Located(guest, config, gpus, missing)
