"""Why a reset did not end clean, and what the admin can do about it (pure: facts in, advice out)."""

from __future__ import annotations

from collections.abc import Mapping

from pvegpu.core.holders import GpuFacts
from pvegpu.core.leftover import Leftover, LeftoverRule, gpu_reset_advice, leftover
from pvegpu.core.model import Place, Via
from pvegpu.core.units import mib
from pvegpu.health import Verdict, xid_text
from pvegpu.reset.vocab import Diagnosis, Kind, Respawn


def own_leftover(f: GpuFacts, rule: LeftoverRule) -> Leftover:
    """What is left on the GPU beyond what was already left, not by the target, at the reset's first reading."""
    return leftover(f, rule, baseline_bytes=f.baseline_bytes)


def restart_would_not_help(facts: dict[int, GpuFacts], rule: LeftoverRule | None = None) -> str | None:
    """Why restarting the target cannot fix what is left (None: it may). A restart is for residue of the
    target itself; it must not stop an innocent container for memory that was never its own (an existing
    leak, a neighbour's hidden context, a ghost never seen in the target) or another workload's holder."""
    rule = rule or LeftoverRule()
    if any(not f.sample.known for f in facts.values()):
        return "a GPU cannot be read, so the result could not be verified"
    if any(f.ct_holders or f.unreadable or f.target_ghosts for f in facts.values()):
        return None
    if unplaced := sorted({h.pid for f in facts.values() for h in f.unplaced}):
        return (f"process(es) {', '.join(map(str, unplaced))} hold the GPU and their container cannot be read; "
                "a restart of this container is not known to help")
    unlisted = sorted({h.pid for f in facts.values() for h in f.other_holders
                       if Via.NVML not in h.via and h.could_own_context and h.info.placement.place is not Place.UNKNOWN})
    if unlisted:
        return (f"the memory left is likely held by process(es) {', '.join(map(str, unlisted))} outside this container "
                "that NVML does not list (fork-inherited contexts)")
    if any(own_leftover(f, rule).over for f in facts.values()):
        return None
    return "the memory left was not this container's (it was there before, or belongs to others): see the diagnosis"


def foreign_leftover(vmid: int, facts: dict[int, GpuFacts], rule: LeftoverRule) -> list[Diagnosis]:
    """Memory left that was never the target's: named as someone else's problem, with what to do."""
    out: list[Diagnosis] = []
    for f in facts.values():
        if not f.sample.known:
            continue
        g = f"GPU minor {f.gpu.minor}"
        for pid in f.unexplained_ghosts:
            out.append(Diagnosis(Kind.UNEXPLAINED_GHOST, f"NVML lists pid {pid} on {g}, which no longer exists and was never CT {vmid}'s; no live process "
                        "accounts for its memory (another container's hidden context, or a leak)",
                        "not this container's problem: `pvegpu audit` and `fuser -v /dev/nvidia*` on the host; the start gate refuses "
                        "starts onto this GPU until it is gone"))
        for pid in f.foreign_ghosts:
            out.append(Diagnosis(Kind.FOREIGN_GHOST, f"NVML lists pid {pid} on {g}, which was alive outside CT {vmid} when this reset began and no longer "
                        f"exists; its memory stays (another container's context kept out of sight, e.g. an fd in flight) and was "
                        f"never CT {vmid}'s",
                        "not this container's problem: `pvegpu audit` names whose it was; restart that container"))
        lo = leftover(f, rule)
        if lo.over and not own_leftover(f, rule).over and not f.unexplained_ghosts:
            out.append(Diagnosis(Kind.FOREIGN_LEFTOVER, f"{g} has {mib(lo.net_bytes, grouped=True)} allocated that no live process accounts for; it was there before this "
                        f"reset and was not CT {vmid}'s",
                        f"not this container's problem: `pvegpu audit`; {gpu_reset_advice(f)}"))
    return out


def diagnose(vmid: int, facts: dict[int, GpuFacts], threshold: LeftoverRule | int,
             health: Mapping[int, Verdict] | None = None) -> list[Diagnosis]:
    """What is left on each GPU, and what the admin can do about it (``health``: the verdict of the GPUs a holder is
    stuck in the driver on, by minor: which Xid, and the next step)."""
    rule = threshold if isinstance(threshold, LeftoverRule) else LeftoverRule(threshold_bytes=threshold)
    out: list[Diagnosis] = []
    for f in facts.values():
        g = f"GPU minor {f.gpu.minor}"
        if not f.sample.known:
            out.append(Diagnosis(Kind.GPU_UNREADABLE, f"{g} could not be read: {f.sample.error}", "check `nvidia-smi`; `dmesg | grep -i xid` (GPU lost?)"))
            continue
        for h in f.ct_holders:
            if h.info.state == "D":
                out.append(_stuck(vmid, h.pid, h.info.comm, g, (health or {}).get(f.gpu.minor)))
            elif h.info.is_ct_init:
                out.append(Diagnosis(Kind.INIT_HOLDS, f"the init of CT {vmid} (pid {h.pid}, {h.info.comm}) holds {g}; pvegpu never signals a container's init",
                            f"restart the container: `pvegpu reset {vmid}` without --no-restart, or `pct reboot {vmid}`"))
            else:
                out.append(Diagnosis(Kind.HOLDER_LEFT, f"pid {h.pid} ({h.info.comm}, CT pid {h.info.ns_pid}) in CT {vmid} still holds {g} (state {h.info.state})",
                            f"a service may be restarting it: `pct exec {vmid} -- systemctl list-units --state=running`; or let pvegpu restart the CT"))
        for pid in f.unreadable:
            out.append(Diagnosis(Kind.FDS_UNREADABLE, f"could not read the open files of pid {pid} in CT {vmid}", "run pvegpu as root"))
        for h in f.other_holders:
            place = h.info.placement
            where = {Place.CONTAINER: f"CT {place.vmid}", Place.MONITOR: f"the monitor of CT {place.vmid}", Place.VM: f"VM {place.vmid}",
                     Place.UNKNOWN: "a place that cannot be read (its /proc/<pid>/cgroup)"}.get(place.place, "the host")
            out.append(Diagnosis(Kind.NEIGHBOUR, f"{g} is also used by pid {h.pid} ({h.info.comm}) in {where}; not touched"))
        for pid in f.target_ghosts:
            out.append(Diagnosis(Kind.TARGET_GHOST, f"NVML still lists pid {pid} of CT {vmid} on {g}, which no longer exists: its context lives on",
                        f"a process of CT {vmid} may hold it out of sight (an fd in flight on a unix socket); restart the container "
                        f"(`pvegpu reset {vmid}` without --no-restart, or `pct reboot {vmid}`)"))
        own = own_leftover(f, rule)
        unlisted = [h for h in f.other_holders if Via.NVML not in h.via and h.could_own_context and h.pid not in f.ghost_owners]
        if own.over and not f.ct_holders and not f.target_ghosts and not unlisted:
            out.append(Diagnosis(Kind.DRIVER_LEAK, f"{g} still has {mib(own.net_bytes, grouped=True)} (of {mib(f.used_bytes, grouped=True)} used) allocated that no "
                        f"live process accounts for (CT {vmid} held it): "
                        "a driver-level leak",
                        gpu_reset_advice(f)))
        elif f.residual_bytes is None and f.sample.known:
            out.append(Diagnosis(Kind.UNMEASURABLE, f"{g}: memory of other processes is not reported (MIG?), so leftovers cannot be measured", "check with `nvidia-smi`"))
    return out + foreign_leftover(vmid, facts, rule)


def _stuck(vmid: int, pid: int, comm: str, g: str, verdict: Verdict | None) -> Diagnosis:
    """A holder in state D: after a fatal Xid or with a recovery action pending, say which and the next step."""
    who = f"pid {pid} ({comm}) in CT {vmid} is stuck in the driver (state D) on {g}"
    if verdict is not None and verdict.refuses:
        after = f" after {xid_text(verdict.xids[-1])}" if verdict.xids else ""
        # gpu-reset stops the container first and nvidia-smi -r refuses while the stuck pid keeps the device open: a
        # reboot is what ends it; the GPU's own verdict is the step once nothing holds the GPU any more
        return Diagnosis(Kind.STUCK_IN_DRIVER, f"{who}{after}: {verdict.reason}; no signal can end it",
                         f"reboot the node: a container stop will likely hang while pid {pid} is stuck, and no GPU reset "
                         f"can run while it holds the GPU; once nothing holds it: {verdict.action}")
    return Diagnosis(Kind.STUCK_IN_DRIVER, who, "no signal can stop it and a container stop will likely hang; check `dmesg | grep -i xid`; "
                     "a host reboot is the reliable fix")


def diagnose_respawns(vmid: int, respawns: list[Respawn]) -> list[Diagnosis]:
    """One line per parent that kept restarting holders, with how to stop it."""
    out: list[Diagnosis] = []
    for by in sorted({r.by for r in respawns}):
        pids = ", ".join(str(r.pid) for r in respawns if r.by == by)
        init = any(r.parent_is_ct_init for r in respawns if r.by == by)
        action = (f"a service restarts it: `pct exec {vmid} -- systemctl list-units --state=running`, stop or disable that unit"
                  if init else f"stop or reconfigure that supervisor inside CT {vmid} (`pct exec {vmid} -- ps -ef`), or let pvegpu restart the CT")
        out.append(Diagnosis(Kind.RESPAWNED, f"GPU holder(s) {pids} in CT {vmid} were started again by {by} after pvegpu stopped them", action))
    return out


def diagnose_unsettled(settle: float, timeout: float) -> Diagnosis:
    """The memory came back too close to the deadline to be verified."""
    if timeout <= settle:
        return Diagnosis(Kind.TIMEOUT_TOO_SHORT, f"the memory could not be verified: --timeout {timeout:g} s is not longer than settle {settle:g} s",
                "give a --timeout longer than reset.settle")
    return Diagnosis(Kind.UNSETTLED, f"the memory came back, but less than {settle:g} s before the {timeout:g} s wait ended, so it is not verified "
            "(a supervisor may be restarting the workload)",
            "run `pvegpu reset` again, or raise --timeout")
