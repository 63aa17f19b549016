"""``pvegpu reset``: stop a container's GPU holders, verify the memory is back, restart if not.

The manual procedure it replaces: ``pct exec 129 -- kill -9 ...; fuser -k /dev/nvidia*; sleep 3;
nvidia-smi``. The phases read on their own: find (reset.find), stop and verify (reset.stop,
reset.verify), restart (reset.restart), diagnose (diagnosis). Every step is an event on ``log`` and a
``Step`` in the report; time comes from the ``Clock`` port, so tests run the whole state machine without
sleeping, and one overall deadline (``ResetPolicy.budget``) bounds every loop.
"""

from __future__ import annotations

from collections.abc import Callable

from pvegpu.core.errors import PvegpuError
from pvegpu.core.holders import GpuFacts
from pvegpu.core.model import GpuHealth, Step
from pvegpu.core.ports import Interrupted
from pvegpu.core.units import mib
from pvegpu.health import Verdict, judge
from pvegpu.reset.appct import NO_RESTART, app_reason, holds
from pvegpu.reset.conclude import Conclusion, conclude
from pvegpu.reset.diagnosis import diagnose, diagnose_respawns, diagnose_unsettled, foreign_leftover, restart_would_not_help
from pvegpu.reset.find import find, note_earlier, plan
from pvegpu.reset.report import Ports, ResetPolicy, ResetReport
from pvegpu.reset.restart import interrupted, restart
from pvegpu.reset.results import Ended, Verified
from pvegpu.reset.run import ResetRun
from pvegpu.reset.stop import stop_and_verify
from pvegpu.reset.verify import is_clean
from pvegpu.reset.vocab import StepName, StepOutcome


def reset(vmid: int, ports: Ports, policy: ResetPolicy, on_step: Callable[[Step], None] | None = None,
          on_progress: Callable[[str], None] | None = None) -> ResetReport:
    """Run ``pvegpu reset`` for one container and return the full report (never half-silent).

    A signal before the stop request raises ``Interrupted`` (nothing was stopped); from the stop request on the
    first one is recorded and the restart finished (exit 128+n), a second one abandons it: both are reported
    with where the CT is. The outcome and exit code come from ``conclude`` alone."""
    run = ResetRun(vmid, ports, policy, on_step, on_progress)
    t0 = ports.clock.monotonic()
    ended, signal_exit = Ended(None), None
    try:
        ended = _reset(run)
    except Interrupted as exc:
        if not run.ct.stop_requested:
            raise
        interrupted(run, exc.signame, abandoned=True)
        signal_exit = exc.exit_code
    finally:
        run.report.elapsed = ports.clock.monotonic() - t0
    ct = run.ct
    got = ports.interrupts.received()
    if got and signal_exit is None and ct.stop_requested:
        interrupted(run, got[0], abandoned=False)
        signal_exit = got[1]
    if ct.stop_requested and ct.ct_state == "running" and not ct.left_stopped:
        ports.lock.running_again()
    return record(run, ended, conclude(ended.verdict, ended.facts, dry_run=ended.dry_run, pve_error=ct.pve_error,
                                       left_stopped=ct.left_stopped, signal_exit=signal_exit))


def record(run: ResetRun, ended: Ended, c: Conclusion) -> ResetReport:
    """The report's verdict and the CT's bookkeeping, written once, from the results."""
    r, ct = run.report, run.ct
    r.outcome, r.exit_code = c.outcome, c.exit_code
    r.stop_requested, r.start_requested, r.ct_state = ct.stop_requested, ct.start_requested, ct.ct_state
    r.left_stopped, r.restarted, r.pve_error = ct.left_stopped, ct.restarted, ct.pve_error
    if ended.verdict is not None or ended.dry_run:
        r.after = ended.facts
    if ended.verdict is not None:  # a verdict per GPU: on several GPUs, which of them kept the target's memory
        r.clean = {m: is_clean(f, run.policy.rule) for m, f in ended.facts.items()}
    return r


def _reset(run: ResetRun) -> Ended:
    facts = find(run)
    note_earlier(run)
    app = restart_is_reset(run, facts)
    if run.policy.dry_run:
        plan(run, facts, app=app)
        return Ended(None, facts, dry_run=True)
    if app:
        return app_restart(run, facts)
    stopped = stop_and_verify(run, facts)
    facts, verdict = stopped.facts, stopped.verdict
    if verdict is Verified.NOT_CLEAN and may_restart(run):
        restarted = restart(run, facts)
        facts, verdict = restarted.facts, restarted.verdict or verdict
    return finish(run, facts, verdict)


def restart_is_reset(run: ResetRun, facts: dict[int, GpuFacts]) -> bool:
    """Is this container's reset its verified restart (``appct``: an application container, or PID 1 holds its GPU)?
    Only while something in it holds the GPU and restarts are allowed; the reason goes into the report either way."""
    assert run.located is not None
    why = app_reason(run.located.config, facts)
    run.report.app_container = why
    if why is None:
        return False
    if not run.policy.restart:
        run.report.notes.append(f"CT {run.vmid} is {why}. {NO_RESTART}")
        return False
    return holds(facts)


def app_restart(run: ResetRun, facts: dict[int, GpuFacts]) -> Ended:
    """The reset of an application container: straight to its restart (no signal rounds against its PID 1, no grace),
    verified while stopped, started (through its gate), read again once it runs."""
    why = run.report.app_container
    run.step(StepName.RESTART, StepOutcome.START, f"CT {run.vmid} is {why}: its reset is its verified restart, no signal rounds")
    if not may_restart(run):
        return finish(run, facts, Verified.NOT_CLEAN)
    restarted = restart(run, facts, why="its reset is its restart")
    facts, verdict = restarted.facts, restarted.verdict or Verified.NOT_CLEAN
    if run.ct.restarted:
        again = run.inspect()
        held = sum(len(f.ct_holders) for f in again.values())
        run.step(StepName.VERIFY, StepOutcome.OK, f"after its start CT {run.vmid} runs again: {held} holder(s) of its own on its GPU(s), "
                 "its workload started again" if held else f"after its start CT {run.vmid} runs again; nothing holds its GPU(s) yet",
                 holders=held)
    return finish(run, facts, verdict)


def may_restart(run: ResetRun) -> bool:
    """Restart only when asked to, and only for residue of the target itself (whole-host scan first)."""
    if not run.policy.restart:
        run.step(StepName.RESTART, StepOutcome.SKIPPED, "not clean, and --no-restart was given")
        return False
    facts = run.inspect(whole_host=True)  # unlisted holders elsewhere need a full scan
    why_not = restart_would_not_help(facts, run.policy.rule) or guard_would_refuse(run, facts)
    if why_not:
        run.step(StepName.RESTART, StepOutcome.SKIPPED, f"not restarting CT {run.vmid}: {why_not}")
        return False
    return True


def guard_would_refuse(run: ResetRun, facts: dict[int, GpuFacts]) -> str | None:
    """With pvegpu's guard as the CT's hookscript, a start onto a GPU holding memory others left before the reset
    (the leftover rule's baseline) would be refused: stopping it would leave it stopped. None: not known to be."""
    assert run.located is not None
    hook = run.located.config.hookscript or ""
    if "pvegpu-guard" not in hook:  # install.GUARD, also in a chain script's name
        return None
    rule = run.policy.rule
    for m, f in sorted(facts.items()):
        if f.baseline_bytes > rule.threshold_bytes:
            return (f"GPU minor {m} holds {mib(f.baseline_bytes, grouped=True)} that others left before this reset; its guard "
                    f"({hook}) would refuse the start and leave it stopped: free that first (`pvegpu audit`), then run "
                    "`pvegpu reset` again")
    return None


def stuck_health(facts: dict[int, GpuFacts], ports: Ports) -> dict[int, Verdict]:
    """The health verdict of each GPU a holder is stuck in the driver on (state D): which Xid, what next. Read only then."""
    minors = {m for m, f in facts.items() if any(h.info.state == "D" for h in f.ct_holders)}
    health_of = getattr(ports.probe, "health", None)
    if not minors or health_of is None:
        return {}
    log = ports.kernlog.events() if ports.kernlog is not None else None
    out: dict[int, Verdict] = {}
    for m in sorted(minors):
        try:
            h: GpuHealth | None = health_of(m)
        except PvegpuError:
            h = None  # unknown: the verdict says so, and still names a fatal Xid the log has
        g = facts[m].gpu
        out[m] = judge(h, log, g.bus_id, g.uuid, str(g.index))
    return out


def finish(run: ResetRun, facts: dict[int, GpuFacts], verdict: Verified) -> Ended:
    """Clean only when verified (held for settle); otherwise the whole host is scanned for the diagnosis. The
    exit code is ``conclude``'s."""
    r, pol = run.report, run.policy
    if verdict is Verified.CLEAN:
        r.diagnosis.extend(foreign_leftover(run.vmid, facts, pol.rule))  # clean of its own memory; name what is others'
        return Ended(verdict, facts)
    whole = run.inspect(whole_host=True)
    r.diagnosis.extend(diagnose(run.vmid, whole, pol.rule, stuck_health(whole, run.p)))
    r.diagnosis.extend(diagnose_respawns(run.vmid, r.respawns))
    if verdict is Verified.UNSETTLED:
        r.diagnosis.append(diagnose_unsettled(pol.settle, pol.timeout))
    return Ended(verdict, whole)
