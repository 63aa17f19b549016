"""Who holds a container's GPUs right now: the facts reset, check and audit decide on.

Combines the NVML process lists (host PIDs, but blind to fork-inherited holders and slow to forget
dead owners) with a ``/proc`` fd/maps scan matched by device number, and places every process with
its cgroup. Manual equivalent: ``nvidia-smi --query-compute-apps=pid,used_memory`` plus
``fuser -v /dev/nvidia*`` plus ``cat /proc/<pid>/cgroup``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .model import CONTROL, GpuInfo, GpuSample, Holder, Place, ProcInfo

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:
    from .ports import GpuProbe, Host


@dataclass
class GpuFacts:
    """One GPU as seen from one container's point of view."""

    gpu: GpuInfo
    sample: GpuSample
    ct_holders: list[Holder] = field(default_factory=list)  # live, in the target container
    other_holders: list[Holder] = field(default_factory=list)  # live, elsewhere (never touched)
    ghosts: list[int] = field(default_factory=list)  # NVML-listed pids with no live process
    unreadable: list[int] = field(default_factory=list)  # container pids whose fds could not be read
    foreign_bytes: int | None = 0  # NVML memory of live processes outside the container
    ct_listed_bytes: int | None = 0  # NVML memory of live processes inside the container

    @property
    def used_bytes(self) -> int | None:
        return self.sample.used_bytes

    @property
    def residual_bytes(self) -> int | None:
        """Memory not explained by live processes of other guests or the host (None = unknown)."""
        if self.sample.used_bytes is None or self.foreign_bytes is None:
            return None
        return max(0, self.sample.used_bytes - self.foreign_bytes)


def _add(total: int | None, value: int | None) -> int | None:
    return None if total is None or value is None else total + value


def inspect_gpus(
    vmid: int | None,
    gpus: Iterable[GpuInfo],
    *,
    host: Host,
    probe: GpuProbe,
    whole_host: bool = False,
    ct_pids: list[int] | None = None,
) -> dict[int, GpuFacts]:
    """Facts per GPU minor for container ``vmid`` (None: no container is the target, as in audit).

    Scans the container's own processes plus every NVML-listed pid; ``whole_host`` scans every
    process on the node (slower, used for diagnosis and audit).
    """
    gpus = list(gpus)
    minors = [g.minor for g in gpus]
    samples = probe.sample(minors)
    listed = {p.pid for s in samples.values() for p in (s.processes or ())}
    scan: set[int] | None = None
    if not whole_host:
        if ct_pids is None and vmid is not None:
            ct_pids = host.ct_pids(vmid)
        scan = set(listed) | set(ct_pids or ())
    holdings = host.holdings(scan)
    infos: dict[int, ProcInfo | None] = {}

    def info(pid: int) -> ProcInfo | None:
        if pid not in infos:
            infos[pid] = host.describe(pid)
        return infos[pid]

    out: dict[int, GpuFacts] = {}
    for gpu in gpus:
        sample = samples.get(gpu.minor) or GpuSample(gpu.minor, None, None, "no reading")
        facts = GpuFacts(gpu, sample)
        by_pid: dict[int, tuple[set[str], ProcInfo]] = {}
        for pid, held in holdings.items():
            i = info(pid)
            if i is None or i.state in ("Z", "X"):
                continue
            if "unreadable" in held.via and vmid is not None and _in_ct(i, vmid):
                facts.unreadable.append(pid)
            # a container process on a control node (nvidiactl, nvidia-uvm) uses the container's GPUs;
            # elsewhere such holders (persistenced, DCGM) hold no GPU memory and are not listed
            if gpu.minor in held.minors or (CONTROL in held.minors and _in_ct(i, vmid)):
                by_pid[pid] = (set(held.via), i)
        for proc in sample.processes or ():
            i = info(proc.pid)
            if i is None or i.state in ("Z", "X"):  # describe() just read it: no second look
                facts.ghosts.append(proc.pid)
                continue
            by_pid.setdefault(proc.pid, (set(), i))[0].add("nvml")
            if _in_ct(i, vmid):
                facts.ct_listed_bytes = _add(facts.ct_listed_bytes, proc.used_bytes)
            else:
                facts.foreign_bytes = _add(facts.foreign_bytes, proc.used_bytes)
        for pid, (via, i) in sorted(by_pid.items()):
            holder = Holder(i, frozenset({gpu.minor}), frozenset(via))
            (facts.ct_holders if _in_ct(i, vmid) else facts.other_holders).append(holder)
        out[gpu.minor] = facts
    return out


def _in_ct(info: ProcInfo, vmid: int | None) -> bool:
    return vmid is not None and info.placement.place is Place.CONTAINER and info.placement.vmid == vmid
