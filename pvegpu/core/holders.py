"""Who holds a container's GPUs right now: the facts reset, check and audit decide on.

Combines the NVML process lists (host PIDs, but blind to fork-inherited holders and slow to forget
dead owners) with a ``/proc`` fd/maps scan matched by device number, and places every process with
its cgroup. Manual equivalent: ``nvidia-smi --query-compute-apps=pid,used_memory`` plus
``fuser -v /dev/nvidia*`` plus ``cat /proc/<pid>/cgroup``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from pvegpu.core.model import CONTROL, GpuInfo, GpuSample, Holder, Holding, Place, Placement, ProcInfo, SeenPid, Via
from pvegpu.core.ports import GpuProbe, Host


class FirstReading:
    """What one reset remembers of NVML's listed pids from reading to reading: each pid's start time and placement
    when a reading first listed it (None: already dead then), kept while every reading lists it; a complete
    reading that no longer lists a pid forgets it (its context is gone: a later listing of that pid is a new one).
    A ghost that was the target's stays the target's leftover, whatever else maps the device later (a tenant that
    parks its context fd in flight on a unix socket gains nothing). A ghost whose pid was first seen alive outside the
    target (a neighbour parking its fd during the reset) stays foreign: its memory counts as a live neighbour's,
    never against the target (``foreign_ghosts``). A listed pid whose process is not the one first seen (another
    start time, or none then) is that one's successor, never its owner (``_successor``)."""

    def __init__(self) -> None:
        self.listed: dict[int, tuple[int, Placement] | None] = {}
        self.alive_outside: set[tuple[int, int]] = set()  # (minor, pid): first seen listed, live and placed outside the target
        self.done = False
        self.baseline: dict[int, int] = {}  # minor -> leftover bytes at the first reading that were not the target's

    def remember(self, samples: dict[int, GpuSample], listed: set[int], info: Callable[[int], ProcInfo | None]) -> set[int]:
        """Bring the record up to this reading; returns the pids it lists for the first time."""
        if all(s.processes is not None for s in samples.values()):  # only a complete reading tells a pid is no longer listed
            for pid in [p for p in self.listed if p not in listed]:
                del self.listed[pid]
            self.alive_outside = {(m, p) for m, p in self.alive_outside if p in listed}
        new = {pid for pid in listed if pid not in self.listed}
        for pid in new:
            i = info(pid)
            self.listed[pid] = (i.ident.start_ticks, i.placement) if i is not None and _live(i) else None
        return new


@dataclass
class GpuFacts:
    """One GPU as seen from one container's point of view."""

    gpu: GpuInfo
    sample: GpuSample
    ct_holders: list[Holder] = field(default_factory=list)  # live, in the target container
    other_holders: list[Holder] = field(default_factory=list)  # live, elsewhere (never touched)
    ghosts: list[int] = field(default_factory=list)  # NVML-listed pids with no live process, or a successor there (recycled)
    ghost_owners: list[int] = field(default_factory=list)  # heirs: live unlisted holders proven to keep a ghost's context
    heirs: dict[int, int] = field(default_factory=dict)  # ghost pid -> the one heir credited with its memory
    target_ghosts: list[int] = field(default_factory=list)  # ghosts that were the target's at the first reading
    foreign_ghosts: list[int] = field(default_factory=list)  # ghosts the first reading saw alive outside the target
    linked: list[int] = field(default_factory=list)  # ghosts paired with an heir whose pgid or sid is the ghost's pid (proven)
    unproven: list[int] = field(default_factory=list)  # ghosts credited to a target heir with no link, other ghosts competing
    unproven_bytes: int | None = 0  # their memory (inside ct_listed_bytes, but not provably the target's)
    recycled: list[int] = field(default_factory=list)  # listed pids whose live process is not NVML's (``_successor``, or holds no GPU)
    unreadable: list[int] = field(default_factory=list)  # container pids whose fds could not be read
    foreign_bytes: int | None = 0  # NVML memory of live processes outside the container (and their heirs)
    ct_listed_bytes: int | None = 0  # NVML memory of live processes inside the container (and its ghosts, heirs)
    contexts_outside: int = 0  # live CUDA contexts outside the target (listed processes, credited heirs)
    baseline_bytes: int = 0  # reset: leftover at its first reading that was not the target's

    @property
    def used_bytes(self) -> int | None:
        return self.sample.used_bytes

    @property
    def unexplained_ghosts(self) -> list[int]:
        """Dead NVML-listed pids that are neither the target's nor explained by a plausible heir (unknown)."""
        return [g for g in self.ghosts if g not in self.heirs and g not in self.target_ghosts and g not in self.foreign_ghosts]

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
    heir_pids: Callable[[], Iterable[int]] | None = None,
    first: FirstReading | None = None,
    remember: bool = False,
) -> dict[int, GpuFacts]:
    """Facts per GPU minor for container ``vmid`` (None: no container is the target, as in audit).

    Scans the container's own processes plus every NVML-listed pid; ``whole_host`` scans every process
    on the node (diagnosis and audit). When NVML lists a dead pid (its context may live on in a fork child,
    which NVML never lists), the processes that could be its heir are scanned too: ``heir_pids()`` (the
    gate: processes of the containers granted these GPUs), else the whole node. A dead listed pid's memory
    goes to one heir at most, and outside the target only to one proven to keep it (``_credit_ghosts``); a listed
    pid whose live process holds neither an fd nor a mapping of the GPU, or started after the pid was first seen
    listed (``_successor``), is a recycled pid, so a ghost. ``first`` (one reset): the listed pids are remembered
    from reading to reading, and a ghost that was the target's is its leftover (``target_ghosts``). ``remember`` (the
    gate, post-stop, audit): what earlier runs saw of the listed pids (``Host.seen_pids``) is evidence too, and this
    reading's is kept for the next run (``seen_now``); without a record (a node's first run after boot, a record not to
    be trusted) nothing is known of earlier runs and the decision is this reading's alone.
    """
    gpus = list(gpus)
    minors = [g.minor for g in gpus]
    samples = probe.sample(minors)
    read_at = host.boot_ticks()  # after the reading: a process that started later is not one NVML listed in it
    record = (host.seen_pids() or {}) if remember else {}
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

    new = first.remember(samples, listed, info) if first is not None else set(listed)
    widen = scan is not None and any((not _live(info(pid)) or _successor(first, pid, info(pid), read_at, record))
                                     and not _was_target(first, pid, vmid) for pid in listed)
    if widen and scan is not None:  # a dead pid is listed: its memory may be held by an unlisted fork child
        scan = None if heir_pids is None else scan | set(heir_pids())
    # a whole-host scan reads the maps of GPU fd holders too (``deep``), so that none is read again below: in a
    # split scan (``scanpool``) that reading is spread over the workers with the rest
    # A whole-node scan may have begun before NVML's reading (``ProcHost.prefetch``): every listed pid gets a second
    # look, as a scan after the reading would read it (one that started its context since is a holder, never a recycled
    # pid; one whose pid a new process took since is recycled, never that process). When the host promises that the
    # whole-node reading takes such a scan (``prefetched``), the look is read first, while its workers still scan, with
    # its descriptions; else right after the whole-node reading, its holdings and the descriptions read after it
    # milliseconds apart (a pid recycled during a long scan is never given its old holding).
    again = sorted({p.pid for s in samples.values() for p in (s.processes or ())}) if scan is None else []
    promised = getattr(host, "prefetched", None)
    early = bool(again) and promised is not None and promised(whole_host)
    looked: dict[int, Holding] = host.holdings(again) if early else {}
    holdings = host.holdings(scan, deep=whole_host)
    if again:
        if not early:
            looked = host.holdings(again)
        for pid in again:
            holdings.pop(pid, None)
        holdings.update(looked)
    if scan is not None and not widen and any(pid not in holdings and _live(info(pid)) for pid in listed):
        # a listed pid whose process holds nothing (a recycled pid): the heir of the dead one may be elsewhere
        extra = set(heir_pids()) - scan if heir_pids is not None else None
        holdings.update(host.holdings(extra))
    fd_only = [pid for pid, h in holdings.items() if pid not in listed and Via.MAPS not in h.via and any(m >= 0 for m in h.minors)]
    if fd_only and not whole_host:  # unlisted GPU fd holders: a context owner (maps the device) or an NVML client?
        holdings.update(host.holdings(fd_only, deep=True))

    out: dict[int, GpuFacts] = {}
    live = [(pid, held, i) for pid, held in holdings.items() if _live(i := info(pid)) and i is not None]  # once, not per GPU
    for gpu in gpus:
        sample = samples.get(gpu.minor) or GpuSample(gpu.minor, None, None, "no reading")
        facts = GpuFacts(gpu, sample)
        by_pid: dict[int, tuple[set[str], ProcInfo]] = {}
        for pid, held, i in live:
            if Via.UNREADABLE in held.via and vmid is not None and _in_ct(i, vmid):
                facts.unreadable.append(pid)
            # a container process on a control node (nvidiactl, nvidia-uvm) uses the container's GPUs;
            # elsewhere such holders (persistenced, DCGM) hold no GPU memory and are not listed
            if gpu.minor in held.minors or (CONTROL in held.minors and _in_ct(i, vmid)):
                by_pid[pid] = (via_on(held, gpu.minor), i)
        ghost_bytes: dict[int, int | None] = {}
        for proc in sample.processes or ():
            i = info(proc.pid)
            hold = holdings.get(proc.pid)
            holds = hold is not None and gpu.minor in hold.minors
            # a process that is not the one NVML listed (it started after the pid was first seen listed) is a successor,
            # whatever it holds: the entry is the earlier process's; one that holds no GPU at all is no owner either
            recycled = _live(i) and (_successor(first, proc.pid, i, read_at, record)
                                     or (not holds and (hold is None or Via.UNREADABLE not in hold.via)))
            if not _live(i) or recycled:  # describe() just read it: no second look
                facts.ghosts.append(proc.pid)
                if recycled:  # a new process got the pid: if it holds the GPU it stays a holder (never hidden), not listed
                    facts.recycled.append(proc.pid)
                ghost_bytes[proc.pid] = proc.used_bytes
                seen = first.listed.get(proc.pid) if first is not None else None
                if seen is not None and _placed_in(seen[1], vmid):
                    facts.target_ghosts.append(proc.pid)  # it was the target's: its leftover, whoever maps the device now
                    facts.ct_listed_bytes = _add(facts.ct_listed_bytes, proc.used_bytes)
                elif first is not None and (gpu.minor, proc.pid) in first.alive_outside:
                    facts.foreign_ghosts.append(proc.pid)  # a neighbour's owner, alive at the first reading: its memory stays foreign
                    facts.foreign_bytes = _add(facts.foreign_bytes, proc.used_bytes)
                    facts.contexts_outside += 1
                continue
            assert i is not None
            by_pid.setdefault(proc.pid, (set(), i))[0].add(Via.NVML)
            if _in_ct(i, vmid):
                facts.ct_listed_bytes = _add(facts.ct_listed_bytes, proc.used_bytes)
            elif i.placement.place is not Place.UNKNOWN:  # memory of an unplaced process explains nothing
                facts.foreign_bytes = _add(facts.foreign_bytes, proc.used_bytes)
                facts.contexts_outside += 1
                if first is not None and proc.pid in new:
                    first.alive_outside.add((gpu.minor, proc.pid))
        for pid, (via, i) in sorted(by_pid.items()):
            holder = Holder(i, frozenset({gpu.minor}), frozenset(via))
            (facts.ct_holders if _in_ct(i, vmid) else facts.other_holders).append(holder)
        if facts.ghosts:
            _credit_ghosts(facts, ghost_bytes, vmid, first, info, record)
        out[gpu.minor] = facts
    if first is not None:
        first.done = True
    if remember:
        host.keep_seen_pids(seen_now(record, samples, out, info, read_at))
    return out


def via_on(held: Holding, minor: int) -> set[str]:
    """How ``held`` holds this one GPU: a mapping counts only on the GPUs whose node it maps, when that was read per
    GPU (an fd on every GPU's node, as each rank of a tensor-parallel job has, maps none of them). A process that maps
    only control nodes (``nvidiactl``, ``nvidia-uvm``) cannot be told apart per GPU: its mapping counts on each."""
    via = set(held.via)
    if Via.MAPS in via and held.mapped is not None and minor not in held.mapped and any(m >= 0 for m in held.mapped):
        via.discard(Via.MAPS)
    return via


def memory_by_pid(facts: GpuFacts) -> dict[int, int | None]:
    """Whose this GPU's memory is, per live process: the process NVML lists on this GPU, with its figure there, and
    the heir credited with a dead listed pid's figure (``heirs``). A process with only an fd (or a mapping) of the
    device holds no memory on it and is not here: a rank of a tensor-parallel job opens every GPU's device node but
    allocates on its own GPU only, the one NVML lists it on. None: NVML does not report the figure (MIG)."""
    listed = {p.pid: p.used_bytes for p in facts.sample.processes or ()}
    out: dict[int, int | None] = {h.pid: listed.get(h.pid) for h in facts.ct_holders + facts.other_holders if Via.NVML in h.via}
    for ghost, heir in facts.heirs.items():
        out[heir] = _add(out.get(heir, 0), listed.get(ghost))
    return out


def seen_now(before: dict[int, SeenPid], samples: dict[int, GpuSample], facts: dict[int, GpuFacts],
             info: Callable[[int], ProcInfo | None], now: int | None) -> dict[int, SeenPid]:
    """The record after this reading: per pid NVML lists now, its process's start time and placement while it is
    alive and its entry's owner, else the last ones seen and when it was first seen dead (``now``). Pids no longer
    listed are dropped (only a complete reading tells that), so the record is as large as NVML's lists."""
    ghosts = {g for f in facts.values() for g in f.ghosts}
    record = {} if all(s.processes is not None for s in samples.values()) else dict(before)
    for pid in {p.pid for s in samples.values() for p in (s.processes or ())}:
        i, prev = info(pid), before.get(pid, SeenPid())
        if pid not in ghosts and _live(i) and i is not None:
            record[pid] = SeenPid(i.ident.start_ticks, i.placement)
        else:
            record[pid] = replace(prev, dead_since=now if prev.dead_since is None else prev.dead_since)
    return record


def _successor(first: FirstReading | None, pid: int, i: ProcInfo | None, read_at: int | None,
               record: dict[int, SeenPid] | None = None) -> bool:
    """The live process at a listed pid is not the one NVML listed: it started after that pid was first seen listed.

    NVML names an entry's owner by pid only, so the one fact that tells a later process with that pid (the kernel
    hands a freed pid out again) from the owner is its start time (stat field 22) against the first time pvegpu saw
    the pid listed: a process that started after it cannot have been that entry's owner. pvegpu's evidence of that
    first time: the reset's earlier readings (``first``: the start time, or None for dead, of the process that had
    the pid when a reading first listed it), else this reading itself (``read_at``, the boot-time clock in start-time
    ticks, read right after NVML answered). NVML's process list carries no start time of its own (pid, memory, MIG
    instance only; only accounting mode records one, a setting of the GPU pvegpu never turns on). Between runs, the
    record of earlier runs (``record``, ``Host.seen_pids``) carries that evidence: a process that started after the one
    an earlier run saw listed at that pid, or after an earlier run saw the pid listed but dead, is a successor. A pid
    recycled before any run of pvegpu saw it listed cannot be told from its owner: that is the horizon of the evidence."""
    if not _live(i):
        return False
    assert i is not None
    if read_at is not None and i.ident.start_ticks > read_at:
        return True
    rec = (record or {}).get(pid)
    if rec is not None and any(t is not None and i.ident.start_ticks > t for t in (rec.start_ticks, rec.dead_since)):
        return True
    if first is None or pid not in first.listed:
        return False
    seen = first.listed[pid]
    return seen is None or seen[0] != i.ident.start_ticks


def _was_target(first: FirstReading | None, pid: int, vmid: int | None) -> bool:
    """The first reading saw this listed pid alive in the target: dead or reused since, its memory is the target's
    leftover whoever keeps its context (``target_ghosts``), so no heir of it is looked for on the rest of the node."""
    seen = first.listed.get(pid) if first is not None else None
    return seen is not None and _placed_in(seen[1], vmid)


def _placed_in(p: Placement, vmid: int | None) -> bool:
    return vmid is not None and p.place is Place.CONTAINER and p.vmid == vmid


def _credit_ghosts(facts: GpuFacts, ghost_bytes: dict[int, int | None], vmid: int | None, first: FirstReading | None,
                   info: Callable[[int], ProcInfo | None], record: dict[int, SeenPid] | None = None) -> None:
    """Give each ghost's memory to the one process proven to keep its context, if any; else it stays unexplained
    (``unexplained_ghosts``: the gate refuses, audit flags it, reset names it). The target's and foreign ghosts are
    settled already (``FirstReading``), and a ghost first seen in a container can only be that container's.

    What proves it, outside the target: a **link** a tenant cannot forge across containers, the heir's process
    group or session id (host pid namespace) being the ghost's pid. A fork child keeps its parent's pgid and sid when
    the parent led its group or session (a shell job, a systemd service), and the kernel keeps a pid from reuse while
    any process has it as its pgid or sid: so such a group or session is the one the ghost's process made, in the
    ghost's own container, and the memory is that container's. Nothing else proves it. Not sitting under the
    container's init and mapping the device (any tenant process can do that, and would take a stopped container's
    leak onto its own account, letting a start onto it); not the parent link (a child's ppid names its parent only
    while that parent lives, and a live listed pid that holds nothing cannot be told from a later process that took a
    dead owner's pid); not a link through a pid now used by a live process (a recycled pid, ``_successor``: the kernel
    gave it out only once no group or session had it, so any group or session with that id is the newcomer's, and the
    newcomer itself is the dead owner's successor, never its heir); not a link once the number is free (no group or
    session keeps it): a tenant that gets the number may make a session there and fork a mapper, so a link whose
    holder started after an earlier run saw the ghost dead, or that sits elsewhere than where an earlier run saw the
    ghost alive (``record``), is none. Unlinked, a neighbour's orphan (a job that was no
    group or session leader) leaves its parent's memory unexplained: the safe side, a refused start, not a credit.

    Inside the target (a reset's own container, a running container's check), a ghost may go to one of its heirs
    (``_heir``) without a link: either way it is the target's to free, and its reset stops them. Such a pairing while
    other ghosts compete for the same heir is a guess (``unproven``): its memory is not enough to stop the target
    (``leftover.baseline``); the target is stopped only for memory provably its own (live listed processes, linked
    ghosts, target ghosts). One heir per ghost on this GPU, linked pairs first."""
    holders = facts.ct_holders + facts.other_holders
    listed_live = {h.pid for h in holders if Via.NVML in h.via}
    mapping = {h.pid for h in holders if Via.MAPS in h.via}
    busy = {h.info.placement for h in holders if Via.NVML in h.via}  # a live listed process there owns the shared context
    keepers = [h for h in holders if _may_keep(h)]
    own_heirs = [h for h in keepers if _in_ct(h.info, vmid) and h.info.placement not in busy and _heir(h, listed_live, mapping, info)]
    open_ghosts = [g for g in facts.ghosts if g not in facts.target_ghosts and g not in facts.foreign_ghosts]
    used: set[int] = set()

    def fits(ghost: int, h: Holder, link: bool = False) -> bool:
        firstly = first.listed.get(ghost) if first is not None else None
        rec = (record or {}).get(ghost, SeenPid())
        where = firstly[1] if firstly is not None else rec.placement
        if where is not None and where.place is Place.UNKNOWN and firstly is None:
            where = None  # an earlier run could not place it: no evidence of where it was
        if link and rec.dead_since is not None and h.info.ident.start_ticks > rec.dead_since:
            return False  # made after the ghost's owner was seen dead: its number was free, the group or session a newcomer's
        return h.pid not in used and (where is None or (where.place is Place.CONTAINER and h.info.placement == where))

    def credit(ghost: int, heir: Holder, unproven: bool) -> None:
        used.add(heir.pid)
        facts.heirs[ghost] = heir.pid
        facts.ghost_owners.append(heir.pid)
        if _in_ct(heir.info, vmid):
            facts.ct_listed_bytes = _add(facts.ct_listed_bytes, ghost_bytes.get(ghost))
            if unproven:
                facts.unproven.append(ghost)
                facts.unproven_bytes = _add(facts.unproven_bytes, ghost_bytes.get(ghost))
        else:
            facts.foreign_bytes = _add(facts.foreign_bytes, ghost_bytes.get(ghost))
            facts.contexts_outside += 1

    for ghost in open_ghosts:
        if ghost in facts.recycled:  # its pid is a live newcomer's: a group or session of that id is the newcomer's
            continue
        linked = [h for h in keepers if fits(ghost, h, link=True) and ghost in (h.info.pgid, h.info.sid)]
        if linked:
            facts.linked.append(ghost)
            credit(ghost, linked[0], False)
    rest = [g for g in open_ghosts if g not in facts.heirs]
    for ghost in rest:
        pool = [h for h in own_heirs if fits(ghost, h)]
        if pool:
            credit(ghost, pool[0], any(o != ghost and o not in facts.heirs and fits(o, pool[0]) for o in rest))


def _may_keep(h: Holder) -> bool:
    """Could keep a dead listed pid's context: a live, unlisted process in a container that maps the device, not its
    init (never a host process: only a container's process is ever credited with a dead pid's memory)."""
    i = h.info
    return (Via.NVML not in h.via and Via.MAPS in h.via and i.placement.place is Place.CONTAINER and not i.is_ct_init
            and _live(i))


def _heir(h: Holder, listed_live: set[int], mapping: set[int], info: Callable[[int], ProcInfo | None]) -> bool:
    """A plausible heir of a dead listed pid *inside the target* (``_credit_ghosts`` says why only there without a
    link): a process that may keep a context (``_may_keep``) and has lost its parent (re-parented to the container's
    init or a subreaper there). Never the child of a live listed process (a DataLoader worker whose parent owns the
    context), and never in a container that has a live NVML-listed process on that GPU (checked by ``_credit_ghosts``:
    that process owns the context its family shares, as a double-forked grandchild re-parented to the init does)."""
    i = h.info
    if not _may_keep(h) or i.ppid is None:
        return False
    if i.ppid in listed_live or i.ppid in mapping:
        return False
    parent = info(i.ppid)
    if parent is None or parent.placement != i.placement:
        return False
    return parent.is_ct_init or (parent.pid not in listed_live and parent.pid not in mapping)


def _live(i: ProcInfo | None) -> bool:
    return i is not None and i.state not in ("Z", "X")


def _in_ct(info: ProcInfo, vmid: int | None) -> bool:
    return vmid is not None and info.placement.place is Place.CONTAINER and info.placement.vmid == vmid
