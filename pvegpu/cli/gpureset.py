"""``pvegpu gpu-reset N``'s run: the GPU resolved, locked and drained, the plan shown and confirmed, the procedure
run under the reset's signal handlers, one report (terminal or ``--json``) and a journal line."""

from __future__ import annotations

import sys
from typing import Any

from pvegpu import wiring
from pvegpu.adapters.logs import configure
from pvegpu.cli.render import step_line
from pvegpu.cli.reset import _say, _Signals
from pvegpu.core import contract
from pvegpu.core import errors as E
from pvegpu.core.ports import Interrupted
from pvegpu.core.textfit import said
from pvegpu.core.units import mib
from pvegpu.gpureset import GpuResetReport, Outcome, execute, make_plan, resolve
from pvegpu.reset.vocab import Diagnosis


def do_gpu_reset(s: Any, ident: str, *, dry_run: bool, yes: bool, json_out: bool, verbose: bool) -> int:
    with _Signals(0, "GPU") as signals:
        try:
            return _run(s, ident, signals, dry_run=dry_run, yes=yes, json_out=json_out, verbose=verbose)
        except Interrupted as exc:  # before any stop request: nothing was stopped, nothing reset
            signals.done = True
            line = f"pvegpu gpu-reset {ident} interrupted by {exc.signame} before any container was stopped: the GPU was not reset"
            wiring.journal_line(line)
            raise E.SignalledError(line, f"run `pvegpu gpu-reset {ident}` again", exc.exit_code) from None


def _run(s: Any, ident: str, signals: _Signals, *, dry_run: bool, yes: bool, json_out: bool, verbose: bool) -> int:
    log = configure(verbose=verbose, json_lines=json_out and verbose)
    world = wiring.world(s)
    gpu = resolve(ident, world.reset_probe.gpus(), world.reset_probe.failed)
    signals.announce = f"GPU {gpu.index}'s containers were stopped, so pvegpu finishes the reset and starts them first"
    ports = wiring.gpu_reset_ports(s, world)
    ports.log, ports.interrupts = log, signals
    if not json_out:
        ports.on_step = lambda st: _say(step_line(st.name, str(st.detail.get("msg", st.outcome)), verbose), err=False)
    report = GpuResetReport(gpu)
    if dry_run:
        make_plan(ports, report)
        report.outcome = Outcome.DRY_RUN
        report.exit_code = E.EXIT_GPU_RESET_REFUSED if report.refusals else E.EXIT_OK
        return _done(report, json_out, verbose)
    with wiring.gpu_lock(s, gpu.minor, f"GPU {gpu.index}") as lock:
        lock.drain()  # (a) from here the gate refuses starts onto it, and pvegpu reset its containers
        ports.undrain = lock.undrain
        make_plan(ports, report)
        if report.refusals:
            report.outcome, report.exit_code = Outcome.REFUSED, E.EXIT_GPU_RESET_REFUSED
            return _done(report, json_out, verbose)
        if not yes:
            _confirm(report, json_out, verbose)
        execute(ports, wiring.gpu_reset_policy(s), report)
        signals.done = True
    return _done(report, json_out, verbose)


def _confirm(r: GpuResetReport, json_out: bool, verbose: bool) -> None:
    """Ask on the terminal; no terminal (a script, a pipe): refuse, exit 2, and say what to add."""
    if not (sys.stdin.isatty() and (sys.stderr.isatty() if json_out else sys.stdout.isatty())):
        raise E.UsageError(f"pvegpu gpu-reset of {r.label} asks before it acts, and there is no terminal to ask on",
                           "read the plan (`pvegpu gpu-reset N --dry-run`), then run it with --yes")
    _say(plan_text(r, verbose), err=json_out)
    _say(f"Reset {r.label} now? [y/N] ", err=True)
    try:
        answer = sys.stdin.readline().strip().lower()
    except OSError:
        answer = ""
    if answer not in ("y", "yes"):
        raise E.UsageError("not confirmed: nothing was stopped, the GPU was not reset", "answer y, or run it with --yes")


def _done(r: GpuResetReport, json_out: bool, verbose: bool) -> int:
    if r.outcome is not Outcome.DRY_RUN:
        stopped = f"; CT {', '.join(map(str, r.left_stopped))} left STOPPED" if r.left_stopped else ""
        wiring.journal_line(f"pvegpu gpu-reset of {r.label}: {r.outcome.value} (exit {r.exit_code}){stopped}")
    _say(contract.dumps(contract.document("gpu-reset", report_json(r))) if json_out else "\n" + report_text(r, verbose), err=False)
    return int(r.exit_code)


def plan_text(r: GpuResetReport, wide: bool = False) -> str:
    used = "unknown" if r.used_before is None else mib(r.used_before, grouped=True)
    pm = {True: "on", False: "off", None: "unknown"}[r.persistence_before]
    lines = [said(f"{r.label}: {used} used, persistence mode {pm}, recovery action {getattr(r.health, 'recovery_action', None) or 'unknown'}",
                  "", "    ", wide)]
    for g in r.guests:
        lines.append(said(f"{'CT' if g.type == 'lxc' else 'VM'} {g.vmid} ({g.status}): {g.action}", "  guest: ", "      ", wide))
    for c in r.clients:
        lines.append(said(f"pid {c.pid} ({c.comm}, {c.where}, {'+'.join(c.via)}): {c.action}", "  process: ", "      ", wide))
    if not r.guests and not r.clients:
        lines.append("  no guest is granted it and no process uses it")
    lines.extend(said(n, "  note: ", "      ", wide) for n in r.notes)
    return "\n".join(lines)


def report_text(r: GpuResetReport, wide: bool = False) -> str:
    lines = [plan_text(r, wide)]
    verdict = {Outcome.DRY_RUN: "dry run: nothing was stopped or reset" + (" (it would be refused)" if r.refusals else ""),
               Outcome.RESET: f"reset and verified in {r.elapsed:.1f} s",
               Outcome.UNVERIFIED: "reset; answers at its idle memory, but NVML cannot tell its recovery action: unverified",
               Outcome.REFUSED: "refused: nothing was reset"}.get(r.outcome, f"{r.outcome.value} after {r.elapsed:.1f} s")
    if r.restarted:
        verdict += f"; CT {', '.join(map(str, r.restarted))} started again (verified running)"
    lines.append(said(verdict, f"GPU {r.gpu.index}: ", "    ", wide))
    for d in r.refusals + r.diagnosis:
        lines.append(said(d.problem, "  problem: ", "      ", wide) + "\n" + said(d.action, "     what to do: ", "       ", wide))
    for v in r.left_stopped:
        lines.append(said(f"CT {v} was left STOPPED; start it with `pct start {v}` once `pvegpu check {v}` allows it.", "  ", "    ", wide))
    if r.interrupted:
        lines.append(said(f"interrupted by {r.interrupted['signal']}: pvegpu {r.interrupted['action']}; exit {r.exit_code}", "  ", "    ", wide))
    return "\n".join(lines)


def _diag(d: Diagnosis) -> dict[str, Any]:
    return {"kind": str(d.kind), "problem": d.problem, "action": d.action}


def report_json(r: GpuResetReport) -> dict[str, Any]:
    g = r.gpu
    return {
        "gpu": {"index": g.index, "minor": g.minor, "uuid": g.uuid, "bus_id": g.bus_id}, "node": r.node,
        "outcome": r.outcome.value, "exit_code": r.exit_code, "duration_seconds": round(r.elapsed, 3),
        "guests": [{"vmid": x.vmid, "type": x.type, "status": x.status, "action": x.action, "ha_managed": x.ha_managed} for x in r.guests],
        "clients": [{"pid": c.pid, "comm": c.comm, "where": c.where, "via": list(c.via), "action": c.action} for c in r.clients],
        "persistence_before": r.persistence_before, "used_bytes_before": r.used_before, "used_bytes_after": r.used_after,
        "recovery_action_after": r.recovery_after, "reset_ran": r.reset_ran,
        "stopped": r.stopped, "restarted": r.restarted, "left_stopped": r.left_stopped, "interrupted": r.interrupted,
        "refusals": [_diag(d) for d in r.refusals], "diagnosis": [_diag(d) for d in r.diagnosis], "notes": r.notes,
        "steps": [{"name": st.name, "outcome": st.outcome, **st.detail} for st in r.steps],
    }
