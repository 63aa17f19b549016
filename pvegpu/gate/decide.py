"""The start gate: may container ``vmid`` start now onto its GPUs?

``evaluate`` gathers the facts (``/etc/pve``, NVML, ``/proc``) through the ports; ``decide`` is the pure
decision over them, shared by ``pvegpu check`` and the hookscript. It refuses when a GPU holds memory that
live processes of other *running* containers do not account for (the one leftover rule, ``leftover.py``),
when NVML lists a pid that no longer exists and no plausible heir explains it, when a process still sits in
this container, when this container or a running neighbour on the GPU is exclusive, when a host process owns
a context there and ``host_users = "refuse"`` (by default it is a sharer), or when a granted GPU cannot be
read (fail closed unless ``on_unknown = "allow"``). A pvegpu reset in progress on the container also refuses, and so
does a ``pvegpu gpu-reset`` draining one of its GPUs.

A *running* container has no start to decide: its own memory is never leftover, so ``check`` says it runs and what
it holds (exit 0, or 5 for a GPU it cannot read; ``CheckResult.running``). PVE never calls pre-start for a running container; a hookscript called
so anyway (by hand) refuses, with that same account and nothing else to fix: a start of a running guest is no start.
Manual equivalent: ``nvidia-smi --query-gpu=index,memory.used`` + ``--query-compute-apps=pid,used_memory``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pvegpu.core.errors import GpuQueryError, PvegpuError
from pvegpu.core.holders import GpuFacts, inspect_gpus
from pvegpu.core.leftover import LeftoverRule, gpu_reset_advice, leftover, place_name
from pvegpu.core.locate import find_guest, granted_gpus
from pvegpu.core.lxcconf import parse_config
from pvegpu.core.model import CONTROL, MIB, GpuHealth, GpuInfo, GpuSample, Place, Via
from pvegpu.core.ports import GpuProbe, Host, KernelLog, PveReader
from pvegpu.core.settings import GateSettings
from pvegpu.core.units import mib
from pvegpu.health import State, Verdict, judge


class GateState(StrEnum):
    """One GPU's verdict for a start."""

    CLEAN = "clean"
    SHARED = "shared"  # in use by another running container: allowed (unless exclusive)
    REFUSED = "refused"
    UNKNOWN = "unknown"  # could not be read (refused unless on_unknown = allow)
    RUNNING = "running"  # the container runs on it: not judged for a start (its own memory is never leftover)


_G = GateSettings()  # the one source of defaults


@dataclass(frozen=True)
class GatePolicy:
    """The gate's settings (``[gate]``), derived once by the composition root (``wiring.gate_policy``)."""

    rule: LeftoverRule = LeftoverRule()  # the one leftover rule (``[leftover]``)
    on_unknown: str = _G.on_unknown  # refuse | allow
    exclusive_vmids: frozenset[int] = frozenset(_G.exclusive)
    exclusive_tag: str = _G.exclusive_tag
    host_users: str = _G.host_users  # share | refuse: a live host process that owns a context on the GPU
    health: str = _G.health  # refuse | warn: a GPU that needs a reset or a reboot (a lost one always refuses)

    def exclusive(self, vmid: int, tags: Collection[str]) -> bool:
        return vmid in self.exclusive_vmids or (bool(self.exclusive_tag) and self.exclusive_tag in tags)

    @property
    def allow_unknown(self) -> bool:
        return self.on_unknown == "allow"


@dataclass
class GateDecision:
    allow: bool
    reasons: list[str] = field(default_factory=list)  # why refused (or remarks when allowed)
    fix: list[str] = field(default_factory=list)  # commands to run
    per_gpu: dict[int, GateState] = field(default_factory=dict)
    running_init: int | None = None  # the container is running (its init's pid): no start to decide

    def refuse(self, reason: str, fix: str | None = None) -> None:
        self.allow = False
        self.reasons.append(reason)
        if fix and fix not in self.fix:
            self.fix.append(fix)


@dataclass(frozen=True)
class Situation:
    """What the decision needs besides the per-GPU facts (all read by ``evaluate``)."""

    ct_pids: tuple[int, ...] = ()  # processes still in the container's cgroup
    exclusive: bool = False  # this container is exclusive
    exclusive_neighbours: frozenset[int] = frozenset()  # running containers on its GPUs that are exclusive
    reset_running: bool = False  # a pvegpu reset of this container holds its lock
    running_init: int | None = None  # the container's own init is alive: the container is running
    health: Mapping[int, Verdict] = field(default_factory=dict)  # each granted GPU's health verdict, by minor (pvegpu.health)
    draining: tuple[str, ...] = ()  # its GPUs that a pvegpu gpu-reset is resetting now (what each mark says)


def _mib(n: int | None) -> str:
    return mib(n, "?")


def gpu_label(g: GpuInfo) -> str:
    index = "?" if g.index < 0 else str(g.index)
    return f"GPU {index} (/dev/nvidia{g.minor}, {g.uuid})" if g.minor >= 0 else "the GPUs (all granted)"


def decide(vmid: int, facts: dict[int, GpuFacts], situation: Situation, policy: GatePolicy) -> GateDecision:
    """The pure decision: facts in, verdict out (tested by table in tests/test_gate_decide.py)."""
    d = GateDecision(True)
    if situation.running_init is not None:
        return _running(vmid, facts, situation, policy)
    if situation.reset_running:
        d.refuse(f"a pvegpu reset of CT {vmid} is in progress", f"wait for it to finish (`pvegpu check {vmid}` says when)")
    for mark in situation.draining:
        d.refuse(mark, "wait for the gpu-reset to finish: it starts the guests it stopped itself (a mark that cannot be read: "
                 "look at gpureset.drain_dir; `pvegpu hook allow-once` starts it once)")
    if situation.ct_pids:
        pids = ", ".join(map(str, situation.ct_pids[:8]))
        d.refuse(f"{len(situation.ct_pids)} process(es) still sit in CT {vmid}'s cgroup (pids {pids})", f"pvegpu reset {vmid} --no-restart")
    for minor, f in sorted(facts.items()):
        d.per_gpu[minor] = _decide_gpu(vmid, f, situation, policy, d)
    return d


def _decide_gpu(vmid: int, f: GpuFacts, sit: Situation, policy: GatePolicy, d: GateDecision) -> GateState:
    g = gpu_label(f.gpu)
    if _health(g, sit.health.get(f.gpu.minor), policy, d):
        return GateState.REFUSED
    if not f.sample.known:
        msg = f"{g} cannot be read: {f.sample.error}"
        if policy.allow_unknown:
            d.reasons.append(msg + " (allowed: gate.on_unknown = allow)")
        else:
            d.refuse(msg, "check `nvidia-smi`; to start anyway set gate.on_unknown = \"allow\" in /etc/pvegpu/pvegpu.toml")
        return GateState.UNKNOWN
    refused = False
    neighbours = sorted({h.info.placement.vmid for h in f.other_holders
                         if h.info.placement.place is Place.CONTAINER and h.info.placement.vmid and h.could_own_context})
    host_users = [h for h in f.other_holders if h.info.placement.place not in (Place.CONTAINER, Place.UNKNOWN) and Via.NVML in h.via]
    sharers = [f"pid {h.pid} ({h.info.comm}, {h.info.placement.place.value})" for h in host_users]
    if f.unexplained_ghosts:
        refused = True
        d.refuse(f"{g}: NVML lists pid(s) {', '.join(map(str, f.unexplained_ghosts))} that no longer exist and no live process "
                 "accounts for their memory (a leak, or a holder pvegpu cannot see)",
                 "pvegpu audit   # find the holder; then `pvegpu reset <its CT>`")
    if f.unplaced:
        names = ", ".join(f"pid {h.pid} ({h.info.comm})" for h in f.unplaced)
        msg = f"{g} is held by process(es) whose container cannot be read: {names}"
        if policy.allow_unknown:
            d.reasons.append(msg + " (allowed: gate.on_unknown = allow)")
        else:
            refused = True
            d.refuse(msg, "check `cat /proc/<pid>/cgroup` for them; `pvegpu audit`")
    if host_users and policy.host_users == "refuse":
        refused = True
        d.refuse(f"{g} is used by process(es) outside any container: {', '.join(sharers)}",
                 "stop them, or set gate.host_users = \"share\" to let containers share a GPU with host processes")
        sharers = []
    lo = leftover(f, policy.rule)
    res = lo.net_bytes
    if res is None:
        msg = f"{g}: {_mib(f.used_bytes)} used and other processes' usage is not reported (MIG?): cannot account for it"
        if policy.allow_unknown:
            d.reasons.append(msg + " (allowed: gate.on_unknown = allow)")
        else:
            refused = True
            d.refuse(msg)
    elif lo.over:
        refused = True
        d.refuse(f"{g} holds {_mib(res)} that no running container accounts for (leftover or driver leak; "
                 f"{_mib(lo.allowance_bytes)} allowed for {lo.contexts_outside} context(s) outside)",
                 f"pvegpu reset {vmid} --no-restart   # then, if it stays: {gpu_reset_advice(f)}")
    if refused:
        return GateState.REFUSED
    if not neighbours and not sharers:
        return GateState.CLEAN
    if not neighbours:
        if sit.exclusive:
            d.refuse(f"{g} is in use by host process(es) {', '.join(sharers)} and CT {vmid} is exclusive",
                     "stop them first, or drop the exclusive policy")
            return GateState.REFUSED
        d.reasons.append(f"{g} is shared with host process(es) {', '.join(sharers)}: allowed (gate.host_users = share)")
        return GateState.SHARED
    listed = ", ".join(map(str, neighbours))
    if sit.exclusive:
        d.refuse(f"{g} is in use by CT {listed} and CT {vmid} is exclusive", f"stop CT {listed} first, or drop the exclusive policy")
        return GateState.REFUSED
    if blocking := sorted(set(neighbours) & sit.exclusive_neighbours):
        names = ", ".join(map(str, blocking))
        d.refuse(f"{g} is in use by CT {names}, which is exclusive", f"stop CT {names} first, or drop its exclusive policy")
        return GateState.REFUSED
    host = f" and host process(es) {', '.join(sharers)}" if sharers else ""
    d.reasons.append(f"{g} is shared with CT {listed}{host} ({_mib(f.foreign_bytes)}): allowed")
    return GateState.SHARED


def _health(g: str, verdict: Verdict | None, policy: GatePolicy, d: GateDecision) -> bool:
    """The GPU's health (``docs/health.md``): True when it refuses the start. A GPU that needs a reset or a reboot
    refuses unless gate.health = warn; a lost GPU always refuses; unknown health never refuses on its own (a GPU NVML
    cannot even name is unknown as before: ``gate.on_unknown``)."""
    if verdict is not None and verdict.state is State.LOST:
        d.refuse(f"{g} is lost: {verdict.reason}", verdict.action + "; `dmesg | grep -i -e xid -e 'fallen off'` says when it fell")
        return True
    if verdict is None or not verdict.refuses:
        return False
    msg = f"{g} {verdict.state.said}: {verdict.reason}"
    if policy.health == "warn":
        d.reasons.append(msg + " (allowed: gate.health = warn)")
        return False
    d.refuse(msg, verdict.action + "; to start anyway set gate.health = \"warn\" in /etc/pvegpu/pvegpu.toml")
    return True


def _running(vmid: int, facts: dict[int, GpuFacts], sit: Situation, policy: GatePolicy) -> GateDecision:
    """A running container: no start to decide (allow False, ``running_init`` set). Each GPU says what the container
    holds there (its own memory: never leftover), who shares it, and what is left beyond every running process's."""
    d = GateDecision(False, [f"CT {vmid} is running (its init is pid {sit.running_init}): there is no start to decide"],
                     running_init=sit.running_init)
    if sit.reset_running:
        d.reasons.append(f"a pvegpu reset of CT {vmid} is in progress")
    for minor, f in sorted(facts.items()):
        d.per_gpu[minor] = GateState.UNKNOWN if not f.sample.known else GateState.RUNNING
        g = gpu_label(f.gpu)
        if not f.sample.known:
            d.reasons.append(f"{g} cannot be read: {f.sample.error}")
            continue
        own = [h for h in f.ct_holders if h.could_own_context]
        pids = ", ".join(f"pid {h.pid} {h.info.comm}" for h in own[:8]) + (f" and {len(own) - 8} more" if len(own) > 8 else "")
        d.reasons.append(f"{g}: CT {vmid} holds {_mib(f.ct_listed_bytes)} ({pids}), its own memory" if own
                         else f"{g}: CT {vmid} holds no memory there")
        others = sorted({place_name(h.info.placement) for h in f.other_holders if h.could_own_context})
        if others:
            d.reasons.append(f"{g} is shared with {', '.join(others)} ({_mib(f.foreign_bytes)})")
        if f.unexplained_ghosts:
            d.reasons.append(f"{g}: NVML lists pid(s) {', '.join(map(str, f.unexplained_ghosts))} that no longer exist and no "
                             "live process is proven to keep their memory")
        lo = leftover(f, policy.rule, target_running=True)
        if lo.over:
            d.reasons.append(f"{g} also holds {_mib(lo.net_bytes)} that no running process accounts for")
            if (advice := gpu_reset_advice(f)) not in d.fix:
                d.fix.append(advice)
    return d


def paragraph(vmid: int, d: GateDecision) -> str:
    """One paragraph a human can act on (it lands in the PVE task log; a running container's is a refusal too)."""
    if d.allow:
        extra = ("; " + "; ".join(d.reasons)) if d.reasons else ""
        return f"pvegpu: CT {vmid} may start: its GPUs are clean{extra}."
    fix = ("; fix: " + "; ".join(d.fix)) if d.fix else ""
    return f"pvegpu: refusing to start CT {vmid}: " + "; ".join(d.reasons) + fix + "."


# -- gathering the facts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatePorts:
    """The light ports the gate reads through: ``/etc/pve``, NVML (ctypes) and ``/proc``; never the API."""

    pve: PveReader
    probe: GpuProbe
    host: Host
    reset_running: Any = None  # callable vmid -> bool: does a pvegpu reset hold the container's lock?
    kernlog: KernelLog | None = None  # the kernel log's Xids (health); None: not read, each GPU's health unknown
    draining: Any = None  # callable minor -> str | None: the mark of a pvegpu gpu-reset of that GPU, if one runs


@dataclass
class CheckResult:
    vmid: int
    decision: GateDecision
    facts: dict[int, GpuFacts] = field(default_factory=dict)
    health: dict[int, Verdict] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = self.decision
        gpus = [{"index": f.gpu.index, "minor": m, "uuid": f.gpu.uuid, "state": d.per_gpu.get(m),
                 "health": self.health[m].to_json() if m in self.health else None,
                 "used_mib": None if f.used_bytes is None else round(f.used_bytes / MIB), "used_bytes": f.used_bytes,
                 "shared_with": sorted({h.info.placement.vmid for h in f.other_holders if h.info.placement.vmid}),
                 "ghost_pids": f.ghosts} for m, f in sorted(self.facts.items())]
        return {"vmid": self.vmid, "allow": d.allow, "running": d.running_init is not None, "reasons": d.reasons, "fix": d.fix,
                "gpus": gpus}


def evaluate(vmid: int, ports: GatePorts, policy: GatePolicy) -> CheckResult:
    """Decide whether CT ``vmid`` may start now (reads /etc/pve, NVML and /proc only)."""
    guest = find_guest(vmid, ports.pve)
    conf = parse_config(ports.pve.ct_config(guest))
    if not conf.gpus.minors and not conf.gpus.all_gpus:
        return CheckResult(vmid, GateDecision(True, ["no NVIDIA GPU in its configuration"]))
    pids = ports.host.ct_pids(vmid)
    try:
        granted, _missing = granted_gpus(conf, ports.probe.gpus())
    except GpuQueryError as exc:  # NVML cannot list the GPUs: each granted GPU is unknown, never clean
        unknown = [GpuInfo(-1, m, "index unknown", "?") for m in sorted(conf.gpus.minors)] or [GpuInfo(-1, -1, "all GPUs", "?")]
        facts = {g.minor: GpuFacts(g, GpuSample(g.minor, None, None, exc.message)) for g in unknown}
    else:
        facts = inspect_gpus(vmid, granted, host=ports.host, probe=ports.probe, ct_pids=pids,
                             heir_pids=lambda: _granted_pids(vmid, {g.minor for g in granted}, ports), remember=True)
        failed = list(getattr(ports.probe, "failed", ()))
        lost = list(_missing) + ([CONTROL] if conf.gpus.all_gpus else [])  # every GPU granted: a lost one is its too
        for m in lost if failed else ():  # a granted GPU NVML could not list: unknown, never clean
            g = GpuInfo(-1, m, "index unknown" if m != CONTROL else "a lost GPU", "?")
            facts[m] = GpuFacts(g, GpuSample(m, None, None, "not listed by NVML (" + "; ".join(failed) + ")"))
    init = next((p for p in pids if (i := ports.host.describe(p)) is not None and i.is_ct_init), None)
    health = gpu_health(facts, ports)
    marks = tuple(m for minor in sorted(facts) if ports.draining and (m := ports.draining(minor)))
    situation = Situation(tuple(pids), policy.exclusive(vmid, conf.tags), _exclusive_neighbours(facts, ports.pve, policy),
                          bool(ports.reset_running and ports.reset_running(vmid)), init, health, marks)
    return CheckResult(vmid, decide(vmid, facts, situation, policy), facts, health)


def gpu_health(facts: Mapping[int, GpuFacts], ports: GatePorts) -> dict[int, Verdict]:
    """The health verdict of each granted GPU NVML named (NVML's health, bounded, and the kernel log's Xids, read once)."""
    named = {m: f.gpu for m, f in facts.items() if f.gpu.index >= 0}  # a GPU whose memory read failed too: it may be the lost one
    if not named:
        return {}
    many = getattr(ports.probe, "health_many", None)
    one = getattr(ports.probe, "health", None)
    read: dict[int, GpuHealth] = {}  # a GPU left out: its reading failed, its health is unknown
    if many is not None:
        try:
            read = many(list(named))
        except PvegpuError:  # NVML cannot start: every GPU's health is unknown
            pass
    elif one is not None:
        for m in named:
            try:
                read[m] = one(m)
            except PvegpuError:
                pass
    log = ports.kernlog.events() if ports.kernlog is not None else None
    return {m: judge(read.get(m), log, g.bus_id, g.uuid, str(g.index)) for m, g in named.items()}


def _granted_pids(vmid: int, minors: set[int], ports: GatePorts) -> list[int]:
    """Where the heir of a dead listed pid can be (only a container process can inherit its context): the
    processes of this node's other containers granted one of ``minors`` (or all GPUs); a container whose
    config cannot be read counts as granted. Bounded by those containers, not by the size of the node."""
    node = ports.pve.local_node()
    out: list[int] = []
    for guest in ports.pve.guests():
        if guest.type != "lxc" or guest.vmid == vmid or (node and guest.node != node):
            continue
        try:
            gpus = parse_config(ports.pve.ct_config(guest)).gpus
            granted = gpus.all_gpus or bool(gpus.minors & minors)
        except PvegpuError:
            granted = True
        if granted:
            out += ports.host.ct_pids(guest.vmid)
    return out


def _exclusive_neighbours(facts: dict[int, GpuFacts], pve: PveReader, policy: GatePolicy) -> frozenset[int]:
    """Running containers on these GPUs that are exclusive (by setting or PVE tag): they refuse sharers too."""
    out: set[int] = set()
    for vmid in {h.info.placement.vmid for f in facts.values() for h in f.other_holders
                 if h.info.placement.place is Place.CONTAINER and h.info.placement.vmid}:
        assert vmid is not None
        if vmid in policy.exclusive_vmids:
            out.add(vmid)
            continue
        if not policy.exclusive_tag:
            continue
        try:
            guest = pve.where(vmid)
            tags = parse_config(pve.ct_config(guest)).tags if guest is not None else ()
        except PvegpuError:  # an unreadable neighbour config cannot make it exclusive
            continue
        if policy.exclusive_tag in tags:
            out.add(vmid)
    return frozenset(out)
