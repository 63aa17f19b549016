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
    ghost_owners: list[int] = field(default_factory=list)  # live unlisted holders credited with the ghosts' memory
    unreadable: list[int] = field(default_factory=list)  # container pids whose fds could not be read
    foreign_bytes: int | None = 0  # NVML memory of live processes outside the container
    ct_listed_bytes: int | None = 0  # NVML memory of live processes inside the container

    @property
    def used_bytes(self) -> int | None:
        return self.sample.used_bytes

    @property
    def unexplained_ghosts(self) -> list[int]:
        """Dead NVML-listed pids whose memory no live holder can own (a leak, or a holder pvegpu cannot see)."""
        return [] if self.ghost_owners else self.ghosts

    @property
    def unplaced(self) -> list[Holder]:
        """Holders whose container cannot be told (``/proc/<pid>/cgroup`` unreadable): never host, never clean."""
        return [h for h in self.other_holders if h.info.placement.place is Place.UNKNOWN and h.could_own_context]

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
    process on the node (slower, used for diagnosis and audit). When NVML lists a dead pid (its context
    was inherited by a child, which NVML never lists), the whole node is scanned for live holders that
    map the device: their memory is theirs, credited to the target container if one of them is in it,
    else to the neighbour or host process that holds it. Only a holder that could own a context (maps
    the device, or is NVML-listed) can explain memory; an fd alone (an NVML client) never does.
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
    infos: dict[int, ProcInfo | None] = {}

    def info(pid: int) -> ProcInfo | None:
        if pid not in infos:
            infos[pid] = host.describe(pid)
        return infos[pid]

    if scan is not None and any(not _live(info(pid)) for pid in listed):
        scan = None  # a dead pid is listed: its memory may be held by an unlisted child anywhere
    holdings = host.holdings(scan)
    fd_only = [pid for pid, h in holdings.items() if pid not in listed and "maps" not in h.via and any(m >= 0 for m in h.minors)]
    if fd_only:  # unlisted GPU fd holders: a context owner (maps the device) or an NVML client (fd only)?
        holdings.update(host.holdings(fd_only, deep=True))

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
        ghost_bytes: int | None = 0
        for proc in sample.processes or ():
            i = info(proc.pid)
            if not _live(i):  # describe() just read it: no second look
                facts.ghosts.append(proc.pid)
                ghost_bytes = _add(ghost_bytes, proc.used_bytes)
                continue
            assert i is not None
            by_pid.setdefault(proc.pid, (set(), i))[0].add("nvml")
            if _in_ct(i, vmid):
                facts.ct_listed_bytes = _add(facts.ct_listed_bytes, proc.used_bytes)
            elif i.placement.place is not Place.UNKNOWN:  # memory of an unplaced process explains nothing
                facts.foreign_bytes = _add(facts.foreign_bytes, proc.used_bytes)
        for pid, (via, i) in sorted(by_pid.items()):
            holder = Holder(i, frozenset({gpu.minor}), frozenset(via))
            (facts.ct_holders if _in_ct(i, vmid) else facts.other_holders).append(holder)
        if facts.ghosts:
            _credit_ghosts(facts, ghost_bytes)
        out[gpu.minor] = facts
    return out


def _unlisted(holders: list[Holder]) -> list[int]:
    """Live holders NVML does not list that map the device, in a known place (they may own a context)."""
    return [h.pid for h in holders if "nvml" not in h.via and "maps" in h.via and h.info.placement.place is not Place.UNKNOWN]


def _credit_ghosts(facts: GpuFacts, ghost_bytes: int | None) -> None:
    """Give the memory of dead listed pids to the live unlisted holders that inherited it: the target's
    own first (its reset must stop them), else those elsewhere (a neighbour's memory is not leftover)."""
    if inside := _unlisted(facts.ct_holders):
        facts.ghost_owners = inside
        facts.ct_listed_bytes = _add(facts.ct_listed_bytes, ghost_bytes)
    elif outside := _unlisted(facts.other_holders):
        facts.ghost_owners = outside
        facts.foreign_bytes = _add(facts.foreign_bytes, ghost_bytes)


def _live(i: ProcInfo | None) -> bool:
    return i is not None and i.state not in ("Z", "X")


def _in_ct(info: ProcInfo, vmid: int | None) -> bool:
    return vmid is not None and info.placement.place is Place.CONTAINER and info.placement.vmid == vmid
