"""The restart fallback: stop the container through the API, verify its GPU while it is stopped, start it.

Manual equivalent: ``pct stop 129; nvidia-smi; pct start 129`` (``pvesh create
/nodes/<node>/lxc/129/status/stop``, then ``.../status/start``). Once a stop has been requested every
exit path reads the container's real state (bounded polling of ``pvesh get .../status/current``) and
reports it: a container is never left stopped without saying so.
"""

from __future__ import annotations

from . import errors as E
from .inspect import GpuFacts
from .reset_run import ResetRun
from .reset_verify import Verified, verify

STATE_POLL = 0.5  # seconds between status reads while finding out the CT's state


def restart(run: ResetRun, facts: dict[int, GpuFacts]) -> tuple[dict[int, GpuFacts], Verified | None]:
    """Stop, verify while stopped, start. Returns the facts and the verdict taken while the CT was
    stopped (None: no stop took effect, the earlier verdict stands)."""
    pve, guest, r = run.p.pve, run.guest, run.report
    try:
        status = pve.ct_status(guest)
    except E.PvegpuError as exc:
        failed(run, exc)
        return facts, None
    if status.status != "running":
        why = ("its status cannot be read" if status.status == "unknown"
               else f"it is {status.status}, and pvegpu does not start a stopped container")
        run.step("restart", "skipped", f"CT {run.vmid} not restarted: {why}")
        return facts, None
    if status.lock:
        failed(run, E.PveApiError(f"CT {run.vmid} is locked ({status.lock}); restart refused",
                                  f"wait for the {status.lock} to finish, or `pct unlock {run.vmid}` if it is stale"))
        return facts, None
    run.step("restart", "stop", f"stopping CT {run.vmid} through the API (GPU not clean)")
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
        state = find_state(run, "stopped", pending)
        note_state(run, state, "stop" if pending else None, ha=status.ha_managed)
        if state != "stopped":
            return facts, None
        facts, verdict = verify_stopped(run)  # say whether the GPU is clean; no start after a failed stop
        return facts, verdict
    r.ct_state, r.left_stopped = "stopped", True  # until the start is confirmed
    facts, verdict = verify_stopped(run)
    if verdict is not Verified.CLEAN:
        run.step("restart", "held", f"CT {run.vmid} left stopped: its GPU is still not verified clean after the stop")
        r.diagnosis.append((f"CT {run.vmid} was left STOPPED: its GPU is not verified clean even with the container stopped",
                            f"deal with what is listed here, then start it: `pct start {run.vmid}`"))
        return facts, verdict
    start(run, ha=status.ha_managed)
    return facts, verdict


def start(run: ResetRun, *, ha: bool) -> None:
    """Start the stopped CT; a failure reports the state it ends in."""
    pve, guest, r = run.p.pve, run.guest, run.report
    upid: str | None = None
    try:
        upid = pve.ct_start(guest)
        run_task(run, upid, "start")
        if ha:
            await_state(run, "running")
    except E.PvegpuError as exc:
        failed(run, exc, upid)
        pending = (upid is not None and not isinstance(exc, E.TaskFailed)) or isinstance(exc, E.PveNoAnswer)
        state = find_state(run, "running", pending)
        note_state(run, state, "start" if pending else None, ha=ha)
        r.restarted = state == "running"
        return
    r.ct_state, r.left_stopped, r.restarted = "running", False, True
    run.step("restart", "ok", f"CT {run.vmid} restarted; GPU verified clean while it was stopped")


def verify_stopped(run: ResetRun) -> tuple[dict[int, GpuFacts], Verified]:
    facts, verdict = verify(run, run.inspect(), run.deadline.within(run.policy.timeout))
    return facts, (Verified.NOT_CLEAN if verdict is Verified.HOLDERS else verdict)


def run_task(run: ResetRun, upid: str, what: str) -> None:
    """Wait for a stop/start task through the PVE port (``wait_task``), within ``task_timeout``."""
    timeout = min(run.policy.task_timeout, run.deadline.remaining())
    res = run.p.pve.wait_task(run.guest.node, upid, timeout=timeout, what=f"{what} task of CT {run.vmid}")
    if res.log_tail:
        run.report.task_log = list(res.log_tail)
    run.step("task", "ok", f"{what} task {res.exitstatus} ({upid})", upid=upid)


def await_state(run: ResetRun, want: str) -> None:
    """HA only requests the state: poll ``status/current`` until it is ``want`` (within ``task_timeout``)."""
    pol = run.policy
    deadline = run.deadline.within(pol.task_timeout)
    while run.p.pve.ct_status(run.guest).status != want:
        if deadline.expired():
            raise E.TaskTimeout(f"HA did not bring CT {run.vmid} to {want} within {pol.task_timeout:g} s",
                                f"check `ha-manager status` for ct:{run.vmid}")
        deadline.pause(STATE_POLL)


def confirm_state(run: ResetRun, want: str, what: str) -> None:
    """A task said OK: check that the CT is ``want`` before trusting it (HA or an admin may have acted since);
    a read that fails is retried within ``state_wait``. Raises TaskFailed (the task is over) when it is not."""
    deadline = run.deadline.within(run.policy.state_wait)
    state = "unknown"
    while not deadline.expired():
        try:
            state = run.p.pve.ct_status(run.guest).status
        except E.PvegpuError:
            state = "unknown"
        if state == want or state != "unknown":
            break
        deadline.pause(STATE_POLL)
    if state != want:
        raise E.TaskFailed(f"the {what} task of CT {run.vmid} ended OK, but CT {run.vmid} is {state}",
                           f"did HA or an admin act on it meanwhile? `pct status {run.vmid}`, `ha-manager status`")


def find_state(run: ResetRun, want: str, pending: bool) -> str:
    """The CT's state now: running, stopped or unknown. Polls ``status/current`` (at most ``state_wait``)
    while reads fail, or, when a stop/start may still take effect, until it has."""
    deadline = run.deadline.within(run.policy.state_wait)
    while True:
        try:
            state = run.p.pve.ct_status(run.guest).status
            error = ""
        except E.PvegpuError as exc:
            state, error = "unknown", exc.message
        if state == want or (state != "unknown" and not pending) or deadline.expired():
            run.step("state", state, f"CT {run.vmid} is {state}" + (f" ({error})" if error else ""), state=state)
            return state
        deadline.pause(STATE_POLL)


def note_state(run: ResetRun, state: str, pending: str | None, *, ha: bool) -> None:
    """Record where a failed stop/start left the CT; anything but a settled 'running' is said out loud."""
    r, vmid = run.report, run.vmid
    r.ct_state = state
    r.left_stopped = state != "running" or pending == "stop"
    if not r.left_stopped:
        return
    if state == "running":
        why = (f"HA's requested state for ct:{vmid} is now 'stopped', so HA may stop it at any moment" if ha
               else "its stop task is still running and may stop it at any moment")
        problem, action = f"CT {vmid} is still running, but {why}", f"check `pct status {vmid}`; " + (
            f"`ha-manager set ct:{vmid} --state started` keeps it running" if ha else f"`pct start {vmid}` if it ends up stopped")
    elif state == "stopped":
        later = (" (its start was requested and may still happen)" if pending == "start" else "")
        problem, action = f"CT {vmid} was left STOPPED{later}", f"start it with `pct start {vmid}` once `pvegpu check {vmid}` allows it"
    else:
        problem, action = (f"CT {vmid}'s state could not be read after pvegpu asked for its stop: it may be STOPPED",
                           f"check `pct status {vmid}`; start it with `pct start {vmid}` if it is stopped")
    run.step("restart", "left stopped", problem, state=state)
    r.diagnosis.append((problem, action))


def failed(run: ResetRun, exc: E.PvegpuError, upid: str | None = None) -> None:
    """A restart step failed: the error, its hint and the failed task's log tail go into the report."""
    r = run.report
    run.step("restart", "failed", exc.message, hint=exc.hint)
    r.diagnosis.append((exc.message, exc.hint or ""))
    r.pve_error = exc.exit_code
    if isinstance(exc, E.TaskError) and exc.log_tail:
        r.task_log = list(exc.log_tail)
        r.diagnosis.append(("the task's log ends with: " + " | ".join(exc.log_tail),
                            f"the whole log: `pvesh get /nodes/{run.guest.node}/tasks/{upid or '<UPID>'}/log`"))
