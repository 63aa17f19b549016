"""The restart fallback: stop the container through the API, verify its GPU while it is stopped, start it.

Manual equivalent: ``pct stop 129; nvidia-smi; pct start 129`` (``pvesh create
/nodes/<node>/lxc/129/status/stop``, then ``.../status/start``). Once a stop has been requested every
exit path reads the container's real state (bounded polling of ``pvesh get .../status/current``) and
reports it: a container is never left stopped without saying so.
"""

from __future__ import annotations

from pvegpu.core import errors as E
from pvegpu.core.holders import GpuFacts
from pvegpu.core.model import CtStatus
from pvegpu.reset.follow import Reading, follow
from pvegpu.reset.interruption import interruption
from pvegpu.reset.results import RestartResult
from pvegpu.reset.run import ResetRun
from pvegpu.reset.verify import Verified, verify
from pvegpu.reset.vocab import CtState, Diagnosis, Kind, StepName, StepOutcome

STATE_POLL = 0.5  # seconds between status reads while finding out the CT's state
SETTLE_POLL = 0.2  # seconds between status reads while a started CT settles
HA_STUCK = ("error", "fence", "recovery", "freeze", "ignored")  # HA states in which HA will not bring the CT anywhere soon


def restart(run: ResetRun, facts: dict[int, GpuFacts], why: str = "GPU not clean") -> RestartResult:
    """Stop, verify while stopped, start. Returns the facts and the verdict taken while the CT was
    stopped (None: no stop took effect, the earlier verdict stands); where the CT went is in ``run.ct``."""
    pve, guest, ct = run.p.pve, run.guest, run.ct
    try:
        status = pve.ct_status(guest)
    except E.PvegpuError as exc:
        failed(run, exc)
        return RestartResult(facts)
    if status.status != "running":
        why = ("its status cannot be read" if status.status == "unknown"
               else f"it is {status.status}, and pvegpu does not start a stopped container")
        run.step(StepName.RESTART, StepOutcome.SKIPPED, f"CT {run.vmid} not restarted: {why}")
        return RestartResult(facts)
    if status.lock:
        failed(run, E.PveApiError(f"CT {run.vmid} is locked ({status.lock}); restart refused",
                                  f"wait for the {status.lock} to finish, or `pct unlock {run.vmid}` if it is stale"))
        return RestartResult(facts)
    if not stop(run, status, why):
        if ct.ct_state != "stopped":
            return RestartResult(facts)
        return verify_stopped(run)  # say whether the GPU is clean; no start after a failed stop
    stopped = verify_stopped(run)
    if stopped.verdict is not Verified.CLEAN:
        run.step(StepName.RESTART, StepOutcome.HELD, f"CT {run.vmid} left stopped: its GPU is still not verified clean after the stop")
        run.report.diagnosis.append(Diagnosis(Kind.HELD_STOPPED, f"CT {run.vmid} was left STOPPED: its GPU is not verified clean even with the container stopped",
                            f"deal with what is listed here, then start it: `pct start {run.vmid}`"))
        return stopped
    start(run, ha=status.ha_managed)
    return stopped


def stop(run: ResetRun, status: CtStatus, why: str) -> bool:
    """Ask the API to stop the running CT and follow it (HA's way when HA manages it). True: it is stopped as asked;
    False: the stop failed, and where it left the CT is said and in ``run.ct`` (it may be stopped all the same)."""
    pve, guest, ct = run.p.pve, run.guest, run.ct
    run.step(StepName.RESTART, StepOutcome.STOP, f"stopping CT {run.vmid} through the API ({why})")
    run.p.interrupts.critical()  # from the stop request on, a signal never leaves the CT stopped without a word
    run.p.lock.stop_requested()  # kept in the lock file until the CT runs again: a killed reset is found by the next one
    ct.stop_requested = True
    upid: str | None = None
    try:
        upid = pve.ct_stop(guest)
        run_task(run, upid, "stop")
        if status.ha_managed:
            await_state(run, "stopped")
        else:
            confirm_state(run, "stopped", "stop")
    except E.PvegpuError as exc:
        failed(run, exc, upid)
        # the stop may still take effect: its task is running, or the request went out and no answer came
        pending = (upid is not None and not isinstance(exc, E.TaskFailed)) or isinstance(exc, E.PveNoAnswer)
        state = find_state(run, CtState.STOPPED, pending)
        note_state(run, state, "stop" if pending else None, ha=status.ha_managed)
        return False
    ct.ct_state, ct.left_stopped = CtState.STOPPED, True  # until the start is confirmed
    return True


def start(run: ResetRun, *, ha: bool, done: str = "GPU verified clean while it was stopped") -> None:
    """Start the stopped CT; a failure reports the state it ends in. ``done``: what the report says was done while it
    was stopped."""
    pve, guest, ct, pol = run.p.pve, run.guest, run.ct, run.policy
    upid: str | None = None
    ct.start_requested = True
    # the CT's own pre-start gate (PVE's start task runs it) must not refuse this start for our own lock; it
    # still judges the GPU. The marker lasts as long as this start may take, and is cleared right after.
    run.p.lock.starting(min(pol.task_timeout * (2 if ha else 1), run.deadline.remaining()) + pol.start_settle)
    try:
        upid = pve.ct_start(guest)
        run_task(run, upid, "start")
        if ha:
            await_state(run, "running")
        settle_running(run)
    except E.PvegpuError as exc:
        failed(run, exc, upid)
        pending = (upid is not None and not isinstance(exc, E.TaskFailed)) or isinstance(exc, E.PveNoAnswer)
        ct.start_pending = pending
        state = find_state(run, CtState.RUNNING, pending)
        note_state(run, state, "start" if pending else None, ha=ha)
        ct.restarted = state == "running" and not ct.left_stopped
        return
    finally:
        run.p.lock.started()
    ct.ct_state, ct.left_stopped, ct.restarted = CtState.RUNNING, False, True
    run.step(StepName.RESTART, StepOutcome.OK, f"CT {run.vmid} restarted; {done}")


def verify_stopped(run: ResetRun) -> RestartResult:
    """Verify while the CT is stopped (holders then count as not clean: no signal round follows)."""
    facts, verdict = verify(run, run.inspect(), run.watched(run.deadline.within(run.policy.timeout)))
    return RestartResult(facts, Verified.NOT_CLEAN if verdict is Verified.HOLDERS else verdict)


def run_task(run: ResetRun, upid: str, what: str) -> None:
    """Wait for a stop/start task through the PVE port (``wait_task``), within ``task_timeout``."""
    timeout = min(run.policy.task_timeout, run.deadline.remaining())
    res = run.p.pve.wait_task(run.guest.node, upid, timeout=timeout, what=f"{what} task of CT {run.vmid}", progress=run.on_progress)
    if res.log_tail:
        run.report.task_log = list(res.log_tail)
    run.step(StepName.TASK, StepOutcome.OK, f"{what} task {res.exitstatus} ({upid})", upid=upid)


def await_state(run: ResetRun, want: str) -> None:
    """HA only requests the state: poll ``status/current`` until it is ``want`` (within ``task_timeout``).
    A failed read is retried within that deadline; HA in a state where it will not act (error, fence, ...)
    ends the wait at once, naming that state."""
    pol, vmid = run.policy, run.vmid

    def judge(r: Reading) -> bool | None:
        if r.status is None:
            return None
        run.ha_state = r.status.ha_state
        if r.status.status == want:
            return True
        if r.status.ha_state in HA_STUCK:
            raise E.TaskFailed(f"HA will not bring CT {vmid} to {want}: its HA resource ct:{vmid} is in state '{r.status.ha_state}'",
                               f"`ha-manager status`; once the cause is fixed: `ha-manager set ct:{vmid} --state started`"
                               + (" (pvegpu's stop request set it to 'stopped')" if want == "stopped" else ""))
        return None

    done, last = follow(run, judge, within=pol.task_timeout, poll=STATE_POLL, waiting=f"waiting for HA to bring CT {vmid} to {want}")
    if done is None:
        failed_read = last.error if last is not None else ""
        raise E.TaskTimeout(f"HA did not bring CT {vmid} to {want} within {pol.task_timeout:g} s"
                            + (f" (the last status read failed: {failed_read})" if failed_read else ""),
                            f"check `ha-manager status` for ct:{vmid}")


def settle_running(run: ResetRun) -> None:
    """A start task that ended OK is not yet a running container: CT ``vmid`` must be read running, and still be
    running ``start_settle`` s later (a broken init exits right after vzstart). Failed reads are retried within
    ``state_wait``. Raises TaskFailed (the task is over) when it is stopped or never read running."""
    pol, vmid = run.policy, run.vmid
    since: float | None = None

    def judge(r: Reading) -> bool | None:
        nonlocal since
        if r.state == "stopped":
            raise E.TaskFailed(f"the start task of CT {vmid} ended OK, but CT {vmid} is stopped"
                               + (f" again {r.at - since:.1f} s later" if since is not None else ""),
                               f"its init or a service failed at start: `pct start {vmid} --debug`, the CT's own logs")
        if r.state == "running":
            since = r.at if since is None else since
            if r.at - since >= pol.start_settle:
                return True
        return None

    done, last = follow(run, judge, within=pol.state_wait + pol.start_settle, poll=SETTLE_POLL,
                        waiting=f"checking that CT {vmid} stays running")
    if done is None:
        raise E.TaskFailed(f"the start task of CT {vmid} ended OK, but CT {vmid} is {last.state if last else 'unknown'}",
                           f"check `pct status {vmid}`")


def confirm_state(run: ResetRun, want: str, what: str) -> None:
    """A task said OK: check that the CT is ``want`` before trusting it (HA or an admin may have acted since);
    a read that fails is retried within ``state_wait``. Raises TaskFailed (the task is over) when it is not."""
    vmid = run.vmid

    def judge(r: Reading) -> str | None:
        if r.status is None:
            node = moved(run)
            if node:
                raise E.TaskFailed(f"the {what} task of CT {vmid} ended OK, but CT {vmid} is now on node {node} "
                                   "(migrated or relocated meanwhile)",
                                   f"`pct status {vmid}` on {node}; pvegpu reset runs on the container's node: run it there")
        return None if r.state == "unknown" else r.state

    state, _ = follow(run, judge, within=run.policy.state_wait, poll=STATE_POLL, skip_if_expired=True,
                      waiting=f"reading CT {vmid}'s state after its {what} task (the read failed)")
    if state != want:
        raise E.TaskFailed(f"the {what} task of CT {vmid} ended OK, but CT {vmid} is {state or 'unknown'}",
                           f"did HA or an admin act on it meanwhile? `pct status {vmid}`, `ha-manager status`")


def moved(run: ResetRun) -> str | None:
    """The node CT ``vmid`` is on now, when that is not the node this reset started on (a status read there failed)."""
    try:
        where = run.p.pve.where(run.vmid)
    except E.PvegpuError:
        return None
    return where.node if where is not None and where.node and where.node != run.guest.node else None


def find_state(run: ResetRun, want: CtState, pending: bool) -> CtState:
    """The CT's state now: running, stopped or unknown. Polls ``status/current`` (at most ``state_wait``)
    while reads fail, or, when a stop/start may still take effect, until it has."""
    vmid = run.vmid

    def judge(r: Reading) -> tuple[CtState, str] | None:
        if r.status is None:
            node = moved(run)
            if node:  # not on this node any more: its state here will not become known
                return CtState.UNKNOWN, f"{r.error}; CT {vmid} is now on node {node}"
        if r.state == want or (r.state is not CtState.UNKNOWN and not pending):
            return r.state, r.error
        return None

    done, last = follow(run, judge, within=run.policy.state_wait, poll=STATE_POLL, waiting=f"finding out whether CT {vmid} is {want}")
    state, error = done or ((last.state, last.error) if last else (CtState.UNKNOWN, ""))
    run.step(StepName.STATE, state, f"CT {vmid} is {state}" + (f" ({error})" if error else ""), state=state.value)
    return state


def note_state(run: ResetRun, state: CtState, pending: str | None, *, ha: bool) -> None:
    """Record where a failed stop/start left the CT; anything but a settled 'running' is said out loud."""
    r, ct, vmid = run.report, run.ct, run.vmid
    ct.ct_state = state
    ct.left_stopped = state != "running" or pending == "stop"
    if not ct.left_stopped:
        return
    if state == "running":
        why = (f"HA's state for ct:{vmid} is '{run.ha_state}', and HA will not act on it" if ha and run.ha_state in HA_STUCK
               else f"HA's requested state for ct:{vmid} is now 'stopped', so HA may stop it at any moment" if ha
               else "its stop task is still running and may stop it at any moment")
        problem, action = f"CT {vmid} is still running, but {why}", f"check `pct status {vmid}`; " + (
            f"`ha-manager set ct:{vmid} --state started` keeps it running" if ha else f"`pct start {vmid}` if it ends up stopped")
    elif state == "stopped":
        later = (" (its start was requested and may still happen)" if pending == "start" else "")
        problem, action = f"CT {vmid} was left STOPPED{later}", f"start it with `pct start {vmid}` once `pvegpu check {vmid}` allows it"
    else:
        problem, action = (f"CT {vmid}'s state could not be read after pvegpu asked for its stop: it may be STOPPED",
                           f"check `pct status {vmid}`; start it with `pct start {vmid}` if it is stopped")
    kind = Kind.MAY_STOP if state == "running" else Kind.LEFT_STOPPED if state == "stopped" else Kind.STATE_UNKNOWN
    run.step(StepName.RESTART, StepOutcome.LEFT_STOPPED, problem, state=state.value)
    r.diagnosis.append(Diagnosis(kind, problem, action))


def failed(run: ResetRun, exc: E.PvegpuError, upid: str | None = None) -> None:
    """A restart step failed: the error, its hint and the failed task's log tail go into the report."""
    r = run.report
    run.ct.pve_error = exc.exit_code
    run.step(StepName.RESTART, StepOutcome.FAILED, exc.message, hint=exc.hint)
    r.diagnosis.append(Diagnosis(Kind.RESTART_FAILED, exc.message, exc.hint or ""))
    if isinstance(exc, E.TaskError) and exc.log_tail:
        r.task_log = list(exc.log_tail)
        r.diagnosis.append(Diagnosis(Kind.TASK_LOG, "the task's log ends with: " + " | ".join(exc.log_tail),
                            f"the whole log: `pvesh get /nodes/{run.guest.node}/tasks/{upid or '<UPID>'}/log`"))


def interrupted(run: ResetRun, signame: str, *, abandoned: bool) -> None:
    """A signal arrived after the stop request: the report says what pvegpu did and where the CT is (its exit
    code, 128+n, is ``conclude``'s)."""
    r, ct, vmid = run.report, run.ct, run.vmid
    ct.left_stopped, action, where = interruption("CT", vmid, ct.ct_state, restarted=ct.restarted, left_stopped=ct.left_stopped,
                                                 start_requested=ct.start_requested, abandoned=abandoned)
    r.interrupted = {"signal": signame, "action": action, "ct_state": ct.ct_state or "unknown", "left_stopped": ct.left_stopped}
    msg = f"pvegpu reset of CT {vmid} interrupted by {signame} after it asked for the CT's stop: it {action}; {where}"
    run.step(StepName.INTERRUPTED, signame, msg, signal=signame)
    r.diagnosis.append(Diagnosis(Kind.INTERRUPTED, msg, f"check `pct status {vmid}`" + (f"; start it with `pct start {vmid}` once `pvegpu check {vmid}` allows it"
                                                            if ct.left_stopped else "")))
