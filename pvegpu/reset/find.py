"""Find what a reset acts on: the container, its GPUs, their holders; and, for --dry-run, the plan.

Manual equivalent: ``pct config 129 | grep nvidia``, ``nvidia-smi --query-compute-apps=pid,used_memory``
and ``fuser -v /dev/nvidia*`` matched against ``/sys/fs/cgroup/lxc/129``.
"""

from __future__ import annotations

from pvegpu.core import errors as E
from pvegpu.core.holders import GpuFacts
from pvegpu.core.locate import locate
from pvegpu.reset.appct import PLAN
from pvegpu.reset.run import ResetRun
from pvegpu.reset.targets import Spared, describe, planned_action
from pvegpu.reset.vocab import Diagnosis, Kind, StepName, StepOutcome


def find(run: ResetRun) -> dict[int, GpuFacts]:
    """Locate the container and its granted GPUs, and take the first reading (``report.before``)."""
    r = run.report
    run.located = loc = locate(run.vmid, pve=run.p.pve, probe=run.p.probe)
    r.node, r.gpus = loc.guest.node, [g.minor for g in loc.gpus]
    r.notes.extend(loc.config.gpus.notes)
    lost = list(getattr(run.p.probe, "failed", ()))
    if lost and (loc.missing_minors or loc.config.gpus.all_gpus):  # a granted GPU NVML could not name: unknown, never clean
        which = ("all GPUs (c 195:*), one of them" if loc.config.gpus.all_gpus else
                 f"GPU minor(s) {', '.join(map(str, loc.missing_minors))},")
        raise E.GpuQueryError(
            f"CT {run.vmid} is granted {which} not listed by NVML, which could not read "
            f"every GPU ({'; '.join(lost)}): unknown, nothing was signalled",
            "`nvidia-smi -q` and `dmesg | grep -i xid` on the node; a lost GPU needs a reset or a reboot")
    for m in loc.missing_minors:
        r.notes.append(f"config grants /dev/nvidia{m} but this node has no GPU with minor {m}")
    if not loc.gpus:
        raise E.NotFoundError(f"none of CT {run.vmid}'s GPUs exist on this node",
                              "compare `pct config %d` with `nvidia-smi -q | grep Minor`" % run.vmid)
    run.step(StepName.LOCATE, StepOutcome.OK, f"CT {run.vmid} on {loc.guest.node}: GPU minor(s) {', '.join(map(str, r.gpus))}",
             node=loc.guest.node, minors=r.gpus)
    facts = r.before = run.inspect()
    return facts


def plan(run: ResetRun, facts: dict[int, GpuFacts], *, app: bool = False) -> None:
    """--dry-run: what each holder would get, and why; nothing is signalled. The list is ``targets.targets``'s, the
    one the stop loop signals from; for a container whose reset is its restart (``app``), every holder goes with it."""
    r = run.report
    decided = run.targets(facts)
    if app:
        for h in decided.signalled:
            r.plan.append(describe(h) | {"action": PLAN})
        for h, why in decided.spared:
            r.plan.append(describe(h) | {"action": PLAN if why is Spared.CT_INIT else why.action(run.vmid), "spared": why.value})
        run.step(StepName.DRY_RUN, StepOutcome.OK, f"CT {run.vmid} is {r.app_container}: its reset is its verified restart "
                 "(stop through the API, verify while stopped, start through its gate, verify again); nothing was signalled or stopped")
        return
    for h in decided.signalled:
        r.plan.append(describe(h) | {"action": planned_action(h)})
    for h, why in decided.spared:
        r.plan.append(describe(h) | {"action": why.action(run.vmid), "spared": why.value})
    run.step(StepName.DRY_RUN, StepOutcome.OK, f"would signal {len(decided.signalled)} process(es); nothing was signalled")


def note_earlier(run: ResetRun) -> None:
    """An earlier reset asked for this CT's stop and ended before it ran again (killed, abandoned): say so, with
    the CT's state now (it may have been started since; then the mark is cleared)."""
    earlier = run.p.lock.earlier()
    if not earlier:
        return
    try:
        state = run.p.pve.ct_status(run.guest).status
    except E.PvegpuError:
        state = "unknown"
    if state == "running":
        run.p.lock.running_again()
        run.report.notes.append(f"{earlier}; CT {run.vmid} is running again now")
        return
    problem = f"{earlier}: CT {run.vmid} is {'STOPPED' if state == 'stopped' else 'in an unknown state'} now"
    run.step(StepName.EARLIER, state, problem, state=state)
    run.report.diagnosis.append(Diagnosis(Kind.EARLIER_STOP, problem, f"start it with `pct start {run.vmid}` once `pvegpu check {run.vmid}` allows it"))
