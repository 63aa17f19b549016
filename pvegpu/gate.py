"""The start gate: may container ``vmid`` start now onto its GPUs?

Pure decision (``decide``) over the facts ``inspect_gpus`` gathers. Refuses when a GPU holds memory that
live processes of other *running* containers do not account for, when NVML lists a pid that no longer
exists, when a process still sits in this container, when the container is exclusive and shares a GPU,
or when a GPU cannot be read (fail closed unless ``on_unknown = "allow"``).
Manual equivalent: ``nvidia-smi --query-gpu=index,memory.used`` + ``--query-compute-apps=pid,used_memory``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .inspect import GpuFacts
from .model import MIB, Place


@dataclass(frozen=True)
class GatePolicy:
    threshold_bytes: int = 64 * MIB
    on_unknown: str = "refuse"  # refuse | allow
    exclusive: bool = False


@dataclass
class GateDecision:
    allow: bool
    reasons: list[str] = field(default_factory=list)  # why refused (or warnings when allowed)
    fix: list[str] = field(default_factory=list)  # commands to run
    per_gpu: dict[int, str] = field(default_factory=dict)  # minor -> "clean" | "shared" | "refused" | "unknown"


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / MIB:.0f} MiB"


def decide(vmid: int, facts: dict[int, GpuFacts], ct_pids: list[int], policy: GatePolicy) -> GateDecision:
    d = GateDecision(True)
    if ct_pids:
        d.allow = False
        d.reasons.append(f"{len(ct_pids)} process(es) still sit in CT {vmid}'s cgroup (pids {', '.join(map(str, ct_pids[:8]))})")
        d.fix.append(f"pvegpu reset {vmid} --no-restart")
    for minor, f in sorted(facts.items()):
        g = f"GPU {f.gpu.index} (/dev/nvidia{minor}, {f.gpu.uuid})"
        if not f.sample.known:
            d.per_gpu[minor] = "unknown"
            msg = f"{g} cannot be read: {f.sample.error}"
            if policy.on_unknown == "allow":
                d.reasons.append(msg + " (allowed: gate.on_unknown = allow)")
            else:
                d.allow = False
                d.reasons.append(msg)
                d.fix.append("check `nvidia-smi`; to start anyway set gate.on_unknown = \"allow\" in /etc/pvegpu/pvegpu.toml")
            continue
        state = "clean"
        others = [h for h in f.other_holders if h.info.placement.place is Place.CONTAINER and "nvml" in h.via]
        host_users = [h for h in f.other_holders if h.info.placement.place is not Place.CONTAINER and "nvml" in h.via]
        if f.ghosts:
            state = "refused"
            d.reasons.append(f"{g}: NVML lists pid(s) {', '.join(map(str, f.ghosts))} that no longer exist (a child inherited the context, or a leak)")
            d.fix.append("pvegpu audit   # find the unlisted holder; then `pvegpu reset <its CT>`")
        res = f.residual_bytes
        if host_users:
            state = "refused"
            names = ", ".join(f"pid {h.pid} ({h.info.comm})" for h in host_users)
            d.reasons.append(f"{g} is used by host process(es) {names}, not by a container")
        if res is None:
            state = "refused"
            d.reasons.append(f"{g}: {_mib(f.used_bytes)} used and other processes' usage is not reported (MIG?): cannot account for it")
        elif res > policy.threshold_bytes:
            state = "refused"
            d.reasons.append(f"{g} holds {_mib(res)} that no running container accounts for (leftover or driver leak)")
            d.fix.append(f"pvegpu reset {vmid} --no-restart   # or, with no holder left: stop all users, `nvidia-smi -r -i {f.gpu.index}`")
        if others and state == "clean":
            vmids = sorted({h.info.placement.vmid for h in others if h.info.placement.vmid})
            if policy.exclusive:
                state = "refused"
                d.reasons.append(f"{g} is in use by CT {', '.join(map(str, vmids))} and CT {vmid} is exclusive")
                d.fix.append(f"stop CT {', '.join(map(str, vmids))} first, or drop the exclusive policy")
            else:
                state = "shared"
                d.reasons.append(f"{g} is shared with CT {', '.join(map(str, vmids))} ({_mib(f.foreign_bytes)}): allowed")
        if state == "refused":
            d.allow = False
        d.per_gpu[minor] = state
    return d


def paragraph(vmid: int, d: GateDecision) -> str:
    """One paragraph a human can act on (it lands in the PVE task log)."""
    if d.allow:
        extra = ("; " + "; ".join(d.reasons)) if d.reasons else ""
        return f"pvegpu: CT {vmid} may start: its GPUs are clean{extra}."
    fix = ("; fix: " + "; ".join(dict.fromkeys(d.fix))) if d.fix else ""
    return f"pvegpu: refusing to start CT {vmid}: " + "; ".join(d.reasons) + fix + "."
