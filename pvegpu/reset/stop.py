"""Stop a container's GPU holders: SIGTERM, SIGKILL after the grace period, round after round.

Manual equivalent: ``pct exec 129 -- kill <pid>``; ``sleep 10``; ``pct exec 129 -- kill -9 <pid>``; and
again for whatever a supervisor starts in its place. Signals go through pidfds (``Host.signal``).
"""

from __future__ import annotations

import signal

from pvegpu.core.holders import GpuFacts
from pvegpu.core.model import SIGNAL_NAMES, Holder, ProcIdentity, SignalResult
from pvegpu.reset.results import StopResult
from pvegpu.reset.run import ResetRun
from pvegpu.reset.targets import STOPPED, KillNow, Targets, describe, kill_now_why
from pvegpu.reset.verify import Verified, verify
from pvegpu.reset.vocab import Respawn, StepName, StepOutcome


def stop_and_verify(run: ResetRun, facts: dict[int, GpuFacts]) -> StopResult:
    """Signal rounds until no payload holder is left, then verify; holders that appear after a round are
    respawns (reported with their parent) and fought for ``rounds`` rounds in all. Only SIGKILL survivors
    left, rounds used up, or the overall deadline passed: NOT_CLEAN, for the restart phase to judge."""
    pol = run.policy
    rounds = 0
    tried: set[ProcIdentity] = set()
    killed: set[ProcIdentity] = set()  # got SIGKILL: if still here, it is stuck (D state), not worth another signal
    while True:
        decided = run.targets(facts)  # the one rule (``targets.targets``), as the dry run shows it
        killable = decided.signalled
        todo = decided.without(tried)
        fresh = todo.signalled
        if fresh:
            if rounds:
                report_respawns(run, fresh, rounds)
            if rounds >= pol.rounds:
                run.step(StepName.RESPAWN, StepOutcome.FAILED, f"holders still appear after {rounds} round(s)", pids=[h.pid for h in fresh])
                return StopResult(facts, Verified.NOT_CLEAN)
            if run.deadline.expired():
                run.step(StepName.DEADLINE, StepOutcome.FAILED, f"the reset's overall deadline ({pol.budget:g} s) passed before round {rounds + 1}")
                return StopResult(facts, Verified.NOT_CLEAN)
            rounds += 1
            tried.update(h.info.ident for h in fresh)
            killed |= signal_round(run, rounds, todo)
            facts = run.inspect()
            continue
        if unkilled := [h for h in killable if h.info.ident not in killed]:
            # seen gone after SIGTERM, yet still here (a multi-threaded process mid-exit can flicker): finish it
            send(run, unkilled, signal.SIGKILL)
            killed |= {h.info.ident for h in unkilled}  # once each, whatever the answer: this loop always ends
            wait_gone(run, unkilled, pol.kill_wait)
            facts = run.inspect()
            continue
        if killable:  # only processes that already survived SIGKILL are left: signalling again is pointless
            return StopResult(facts, Verified.NOT_CLEAN)
        facts, verdict = verify(run, facts, run.watched(run.deadline.within(pol.timeout)))
        if verdict is not Verified.HOLDERS:
            return StopResult(facts, verdict)


def signal_round(run: ResetRun, n: int, todo: Targets) -> set[ProcIdentity]:
    """SIGTERM to every target, SIGKILL to those still there after ``grace``; survivors are named.

    A target SIGTERM cannot reach gets SIGKILL at once: it ignores SIGTERM, it is a nested namespace's init
    without a handler, or it is traced (state ``t`` or a debugger attached: the tracer would see SIGTERM first,
    and SIGCONT cannot resume it). A stopped target (state ``T``) gets SIGCONT right after its SIGTERM, so
    the pending SIGTERM is acted on (its handler runs, or the default action ends it) within the grace,
    instead of waiting the whole grace for a signal that cannot be delivered. A target in a frozen cgroup (cgroup v2
    ``cgroup.freeze``, on its cgroup or an ancestor, read from the host's cgroupfs) gets SIGKILL at once: SIGTERM
    stays pending while it is frozen, SIGKILL kills frozen tasks. Who is in which list: ``targets.targets``."""
    pol = run.policy
    every = todo.signalled
    run.step(StepName.ROUND, StepOutcome.START, f"round {n}: {len(every)} holder(s) in CT {run.vmid}", pids=[h.pid for h in every])
    frozen = [h for h in todo.kill_now if kill_now_why(h) is KillNow.FROZEN]
    futile = [h for h in todo.kill_now if kill_now_why(h) is KillNow.TERM_FUTILE]
    termed = send(run, todo.term, signal.SIGTERM)
    killed: list[Holder] = []
    if frozen:
        run.step(StepName.SIGNAL, StepOutcome.SKIPPED, f"pid(s) {', '.join(str(h.pid) for h in frozen)} are in a frozen cgroup: SIGTERM would stay "
                 "pending, SIGKILL at once (it kills frozen tasks on cgroup v2)", pids=[h.pid for h in frozen])
        killed = send(run, frozen, signal.SIGKILL)
    if futile:
        run.step(StepName.SIGNAL, StepOutcome.SKIPPED, f"SIGTERM cannot reach pid(s) {', '.join(str(h.pid) for h in futile)} (ignored, traced by a "
                 "debugger, or the init of a nested PID namespace without a handler): SIGKILL at once", pids=[h.pid for h in futile])
        killed += send(run, futile, signal.SIGKILL)
    if stopped := [h for h in termed if _state(run, h) == STOPPED]:
        run.step(StepName.SIGNAL, StepOutcome.CONTINUE, f"pid(s) {', '.join(str(h.pid) for h in stopped)} stopped (state T): SIGCONT so the "
                 "pending SIGTERM is acted on", pids=[h.pid for h in stopped])
        send(run, stopped, signal.SIGCONT)
    termed = wait_gone(run, termed, pol.grace)
    if termed:
        killed += send(run, termed, signal.SIGKILL)
    for h in wait_gone(run, killed, pol.kill_wait):
        d = run.p.host.describe(h.pid)
        state = d.state if d else "?"
        run.step(StepName.SURVIVOR, StepOutcome.FAILED, f"pid {h.pid} ({h.info.comm}) survived SIGKILL, state {state}", pid=h.pid, state=state)
    return {h.info.ident for h in killed}



def _state(run: ResetRun, h: Holder) -> str | None:
    """The holder's state now (it may have been stopped since the scan); None when it is gone or is another process."""
    d = run.p.host.describe(h.pid)
    return d.state if d is not None and d.ident == h.info.ident else None


def send(run: ResetRun, targets: list[Holder], sig: int) -> list[Holder]:
    """``kill -SIG`` each target through its pidfd; returns those the signal reached."""
    name = SIGNAL_NAMES[sig]  # a signal pvegpu does not send is a mistake here, found before anything is sent
    sent: list[Holder] = []
    for h in targets:
        res = SignalResult(run.p.host.signal(h.info.ident, sig, run.vmid))
        entry = describe(h) | {"signal": name, "result": res.value, "t": round(run.clock.monotonic(), 3)}
        run.report.signalled.append(entry)
        run.event("reset.signal", **entry)
        run.step(StepName.SIGNAL, res.value, f"{name} → pid {h.pid} ({h.info.comm}, CT pid {h.info.ns_pid}): {res.value}",
                 pid=h.pid, signal=name)
        if res is SignalResult.SENT:
            sent.append(h)
    return sent


def wait_gone(run: ResetRun, live: list[Holder], seconds: float) -> list[Holder]:
    """Those of ``live`` still alive after at most ``seconds`` (never past the overall deadline)."""
    deadline = run.deadline.within(seconds)
    pace = run.pace(run.policy.exit_poll)  # a holder that exits on SIGTERM goes within ms (a CUDA one once the driver has
    # taken its memory back): look again every ms at first, while that is cheap (a stat read per holder)
    clock = run.clock
    while True:
        t = clock.monotonic()
        live = [h for h in live if run.p.host.alive(h.info.ident)]
        if not live or deadline.expired():
            return live
        deadline.pause(pace.after(clock.monotonic() - t))


def report_respawns(run: ResetRun, fresh: list[Holder], after_round: int) -> None:
    """Holders that were not there before the last round: say so, and name the parent that started them."""
    host = run.p.host
    for h in fresh:
        parent = host.describe(h.info.ppid) if h.info.ppid else None
        if parent is None:
            by = f"parent pid {h.info.ppid} (gone)" if h.info.ppid else "an unknown parent"
        elif parent.is_ct_init:
            by = f"the container's init (pid {parent.pid}, {parent.comm})"
        else:
            by = f"pid {parent.pid} ({parent.comm}, CT pid {parent.ns_pid})"
        entry = Respawn(h.pid, h.info.ns_pid, h.info.comm, after_round, h.info.ppid, parent.comm if parent else None,
                        bool(parent and parent.is_ct_init), by)
        run.report.respawns.append(entry)
        msg = f"pid {h.pid} ({h.info.comm}, CT pid {h.info.ns_pid}) appeared after round {after_round}, started by {by}: a supervisor restarts the workload"
        run.step(StepName.RESPAWN, StepOutcome.SEEN, msg, pid=h.pid, parent=h.info.ppid)
        run.report.notes.append(msg)
