"""``pvegpu audit``: which container holds which GPU, right now and by configuration.

Runtime (this node only, NVML is per node): every NVML-listed pid and every ``/dev/nvidia*`` holder,
placed by cgroup. Configuration (this node or the whole cluster): the ``devN``/``lxc.*`` grants of each
container. Manual equivalent: ``nvidia-smi`` + ``fuser -v /dev/nvidia*`` + ``grep nvidia /etc/pve/nodes/*/lxc/*.conf``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import PvegpuError
from .inspect import inspect_gpus
from .lxcconf import parse_config
from .model import MIB, Place
from .ports import GpuProbe, Host, PveApi


@dataclass
class AuditReport:
    node: str
    gpus: list[dict[str, Any]] = field(default_factory=list)  # runtime rows, this node
    configured: list[dict[str, Any]] = field(default_factory=list)  # CT -> minors, per node
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "gpus": self.gpus, "configured": self.configured, "problems": self.problems}


def _owner(h: Any) -> str:
    p = h.info.placement
    return {Place.CONTAINER: f"CT {p.vmid}", Place.MONITOR: f"monitor {p.vmid}", Place.VM: f"VM {p.vmid}"}.get(p.place, "host")


def audit(*, pve: PveApi, probe: GpuProbe | None, host: Host | None, cluster: bool = False) -> AuditReport:
    """The audit report; one unreadable GPU or config does not hide the others."""
    node = pve.local_node() or ""
    rep = AuditReport(node)
    granted: dict[int, list[int]] = {}
    for g in pve.guests():
        if g.type != "lxc" or (not cluster and g.node != node):
            continue
        try:
            conf = parse_config(pve.ct_config(g))
        except PvegpuError as exc:
            rep.problems.append(f"CT {g.vmid}: {exc.message}")
            continue
        if conf.gpus.minors or conf.gpus.all_gpus:
            rep.configured.append({"vmid": g.vmid, "node": g.node, "minors": sorted(conf.gpus.minors),
                                   "all_gpus": conf.gpus.all_gpus, "notes": list(conf.gpus.notes)})
            if g.node == node:
                for m in sorted(conf.gpus.minors):
                    granted.setdefault(m, []).append(g.vmid)
                if conf.gpus.all_gpus:
                    granted.setdefault(-1, []).append(g.vmid)
    if probe is None or host is None:
        return rep
    try:
        gpus = probe.gpus()
    except PvegpuError as exc:
        rep.problems.append(f"GPUs of {node} cannot be read: {exc.message}")
        return rep
    facts = inspect_gpus(None, gpus, host=host, probe=probe, whole_host=True)
    for gpu in gpus:
        f = facts[gpu.minor]
        holders: list[dict[str, Any]] = [{"pid": h.pid, "owner": _owner(h), "comm": h.info.comm, "via": sorted(h.via),
                    "used_mib": next((None if p.used_bytes is None else round(p.used_bytes / MIB)
                                      for p in f.sample.processes or () if p.pid == h.pid), None)}
                   for h in f.other_holders if h.pid != host.self_pid]
        owners = sorted({h["owner"] for h in holders})
        flags = []
        if f.ghosts:
            flags.append("ghost-pid")
        if f.residual_bytes is not None and f.residual_bytes > 64 * MIB:
            flags.append("unattributed-memory")
        if len([o for o in owners if o.startswith("CT")]) > 1:
            flags.append("shared")
        if not f.sample.known:
            flags.append("unreadable")
        elif f.residual_bytes is None:
            flags.append("usage-unknown")  # a process's memory is not reported (MIG): leftovers cannot be measured
        rep.gpus.append({"index": gpu.index, "minor": gpu.minor, "uuid": gpu.uuid, "bus_id": gpu.bus_id, "name": gpu.name,
                         "used_mib": None if f.used_bytes is None else round(f.used_bytes / MIB),
                         "unattributed_mib": None if f.residual_bytes is None else round(f.residual_bytes / MIB),
                         "holders": holders, "ghost_pids": f.ghosts, "configured_for": sorted(set(granted.get(gpu.minor, []) + granted.get(-1, []))),
                         "flags": flags, "error": f.sample.error})
    return rep
