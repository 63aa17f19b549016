"""Steps (c) to (h) of ``pvegpu gpu-reset N``: stop the running containers, persistence mode off, refuse what cannot
work, ``nvidia-smi -r``, verify with NVML, persistence mode back, start exactly the containers that ran (each
through the gate, each verified running), one report.

Manual equivalent: ``pct stop 129; nvidia-smi -i UUID -pm 0; fuser -v /dev/nvidia0; nvidia-smi -r -i UUID;
nvidia-smi -q -i UUID; nvidia-smi -i UUID -pm 1; pvegpu check 129 && pct start 129``. Once a stop was requested,
a signal never leaves a container stopped without the report (and the journal) saying so and how to start it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from pvegpu.core import errors as E
from pvegpu.core.deadline import Deadline
from pvegpu.core.locate import Located
from pvegpu.core.lxcconf import parse_config
from pvegpu.core.model import Guest, Step
from pvegpu.core.ports import Interrupted
from pvegpu.core.safetext import shown
from pvegpu.core.units import mib
from pvegpu.gpureset.model import GpuResetPolicy, GpuResetPorts, GpuResetReport, Outcome, Refusal
from pvegpu.gpureset.plan import KNOWN_CLIENTS, refuse
from pvegpu.health import reset_record
from pvegpu.reset.interruption import interruption
from pvegpu.reset.report import Ports
from pvegpu.reset.restart import start, stop
from pvegpu.reset.run import ResetRun
from pvegpu.reset.vocab import Diagnosis, Kind

IN_USE = "In use by another client"  # nvidia-smi -r's words for a GPU something still holds
NOT_SUPPORTED = "is not supported"


@dataclass
class _Ct:
    run: ResetRun
    ha: bool


class _Run:
    def __init__(self, ports: GpuResetPorts, policy: GpuResetPolicy, report: GpuResetReport) -> None:
        self.p, self.policy, self.r = ports, policy, report
        self.cts: list[_Ct] = []
        self.critical = False
        self.failed_exit: int | None = None  # the exit code of an error that ended the procedure midway
        self.once: dict[int, Callable[[], object]] = {}  # CTs given an allow-once token for their start as before: its withdraw

    def step(self, name: str, outcome: str, msg: str, **detail: object) -> None:
        s = Step(name, outcome, {"msg": msg, **detail})
        self.on_step(s)
        try:
            self.p.log.info(f"gpu-reset.{name}", outcome=outcome, msg=msg, **detail)
        except Exception:  # noqa: BLE001 - the log is information: it never ends a gpu-reset midway
            pass

    def on_step(self, s: Step) -> None:
        self.r.steps.append(s)
        if self.p.on_step is not None:
            self.p.on_step(s)


def execute(ports: GpuResetPorts, policy: GpuResetPolicy, report: GpuResetReport) -> GpuResetReport:
    """Run the planned reset (the plan is in ``report``, without refusals; the caller drained the GPU)."""
    run = _Run(ports, policy, report)
    t0 = ports.clock.monotonic()
    signal_exit: int | None = None
    try:
        with contextlib.ExitStack() as locks:
            try:
                _procedure(run, locks)
            except Interrupted as exc:  # a second signal: abandon where it is (before any stop it ends the command)
                if not run.critical:
                    raise
                _interrupted(run, exc.signame, abandoned=True)
                signal_exit = exc.exit_code
            got = ports.interrupts.received()
            if got and signal_exit is None and run.critical:
                _interrupted(run, got[0], abandoned=False)
                signal_exit = got[1]
            for ct in run.cts:  # the CTs that run again: no stop of theirs is left undone in their lock files
                if ct.run.ct.ct_state == "running" and not ct.run.ct.left_stopped:
                    ct.run.p.lock.running_again()
    finally:
        report.elapsed = ports.clock.monotonic() - t0
    _conclude(run, signal_exit)
    return report


def _procedure(run: _Run, locks: contextlib.ExitStack) -> None:
    r, p = run.r, run.p
    running = [g for g in r.guests if g.type == "lxc" and g.status == "running"]
    for g in running:  # each container's reset lock: no pvegpu reset of it meanwhile; our own start passes its gate
        ct_run = ResetRun(g.vmid, Ports(p.pve, p.probe, p.host, p.clock, p.log, interrupts=p.interrupts), run.policy.restart,
                          on_step=run.on_step)
        if p.ct_lock is not None:
            try:
                ct_run.p.lock = locks.enter_context(p.ct_lock(g.vmid, lambda text: run.step("wait", "lock", text)))
            except E.BusyError as exc:
                refuse(r, Refusal.CT_BUSY, exc.message, exc.hint or "")
                return
        guest = Guest(g.vmid, r.node, "lxc", g.name)
        ct_run.located = Located(guest, parse_config(p.pve.ct_config(guest)), (r.gpu,), ())
        run.cts.append(_Ct(ct_run, g.ha_managed))
    try:
        if _stop_all(run) and not r.refusals:
            _reset(run)
    except E.PvegpuError as exc:  # the API or NVML failed midway: said, and every CT stopped so far starts again below
        r.diagnosis.append(Diagnosis(Kind.RESTART_FAILED, f"gpu-reset of {r.label} stopped midway: {exc.message}", exc.hint or ""))
        run.step("gpu-reset", "failed", f"stopped midway: {exc.message}")
        run.failed_exit = exc.exit_code
    p.undrain()
    _start_again(run)


def _stop_all(run: _Run) -> bool:
    """Stop each running CT on the GPU through the API (HA honoured); False when one could not be stopped."""
    r, p = run.r, run.p
    for ct in run.cts:
        run.critical = True  # from the first stop request on, a signal finishes (or says) the restart
        status = p.pve.ct_status(ct.run.guest)
        if status.status != "running":
            run.step("stop", "skipped", f"CT {ct.run.vmid} is {status.status} now: not stopped, not started again")
            ct.run.ct.ct_state = None
            continue
        if status.lock:
            refuse(r, Refusal.CT_BUSY, f"CT {ct.run.vmid} is locked ({status.lock})", f"wait for the {status.lock} to finish")
            return False
        r.stopped.append(ct.run.vmid)
        if not stop(ct.run, status, f"gpu-reset of GPU {r.gpu.index}"):
            return False
    return True


def _reset(run: _Run) -> None:
    """Persistence mode off, clients gone, ``nvidia-smi -r``, verified; persistence mode back as it was."""
    r, p, gpu = run.r, run.p, run.r.gpu
    p.interrupts.critical()  # from here the GPU changes (no CT may have been stopped): a first signal lets it finish
    run.critical = True
    pm_off = r.persistence_before is not False
    try:
        if pm_off:
            try:
                run.step("persistence", "run", f"nvidia-smi -i {gpu.uuid} -pm 0")  # said before: nvidia-smi may take seconds
                p.control.persistence(gpu, False)
                run.step("persistence", "off", f"persistence mode off for {r.label}" + ("" if r.persistence_before else
                                                                                         " (it was unknown before)"))
            except E.PvegpuError as exc:  # it may have taken effect all the same (a timeout): put back below
                refuse(r, Refusal.CLIENT, f"persistence mode cannot be turned off: {exc.message}", exc.hint or "")
                return
        p.release_nvml()
        if _clients_gone(run):  # a first signal now still lets the reset finish: the CTs are stopped for it
            _run_reset(run)
    finally:
        if pm_off and r.persistence_before:
            try:
                run.step("persistence", "run", f"nvidia-smi -i {gpu.uuid} -pm 1")
                p.control.persistence(gpu, True)
                run.step("persistence", "on", f"persistence mode on again for {r.label}")
            except E.PvegpuError as exc:
                r.diagnosis.append(Diagnosis(Kind.RESTART_FAILED, f"persistence mode could not be turned on again: {exc.message}",
                                             f"`nvidia-smi -i {gpu.uuid} -pm 1`"))
        elif pm_off:
            r.notes.append(f"persistence mode was unknown before and is off now: `nvidia-smi -i {gpu.uuid} -pm 1` if it was on")


def _clients_gone(run: _Run) -> bool:
    """Wait (``client_wait``) until no process but pvegpu holds the GPU's device node; refuse naming who stays."""
    r, p = run.r, run.p
    deadline = Deadline(p.clock, p.clock.monotonic() + run.policy.client_wait)
    said = False
    while True:
        held = {pid: h for pid, h in p.host.holdings().items() if r.gpu.minor in h.minors and pid != p.host.self_pid}
        if not held:
            return True
        if deadline.expired():
            break
        if not said:
            said = True
            run.step("wait", "clients", f"waiting up to {run.policy.client_wait:g} s for {len(held)} process(es) to let go of "
                     f"/dev/nvidia{r.gpu.minor}")
        p.clock.sleep(min(run.policy.poll, max(0.0, deadline.remaining())))
    for pid in sorted(held):
        info = p.host.describe(pid)
        comm = shown(info.comm) if info is not None else "?"
        how = KNOWN_CLIENTS.get(info.comm if info else "") or f"stop its service (`systemctl status {pid}` names it) or end it"
        refuse(r, Refusal.CLIENT, f"pid {pid} ({comm}) still holds /dev/nvidia{r.gpu.minor} after {run.policy.client_wait:g} s", how)
    return False


def _run_reset(run: _Run) -> None:
    r, p = run.r, run.p
    run.step("reset", "run", f"nvidia-smi -r -i {r.gpu.uuid}")
    r.reset_ran = True
    try:
        p.control.reset(r.gpu)
    except E.PvegpuError as exc:
        if NOT_SUPPORTED in exc.message:
            refuse(r, Refusal.NO_RESET, f"the driver has no reset for {r.label}: {exc.message}",
                   "reboot the node to reset it (or check `nvidia-smi -q` for its reset support)")
            r.reset_ran = False
            return
        hint = ("a client opened the GPU again: `fuser -v /dev/nvidia%d`, stop it, then run pvegpu gpu-reset again" % r.gpu.minor
                if IN_USE in exc.message else exc.hint or "check `dmesg` for Xid lines; the GPU may need a reboot")
        r.diagnosis.append(Diagnosis(Kind.GPU_UNREADABLE, f"the reset of {r.label} failed: {exc.message}", hint))
        run.step("reset", "failed", exc.message)
        return
    run.step("reset", "ok", f"{r.label} was reset")
    _verify(run)


def _verify(run: _Run) -> None:
    """(f) NVML: the GPU answers (by UUID), its memory is at the idle baseline, its recovery action is none."""
    r, p, pol = run.r, run.p, run.policy
    deadline = Deadline(p.clock, p.clock.monotonic() + pol.verify_wait)
    why, said = "", False
    while True:
        try:
            gpu = next((g for g in p.probe.gpus() if g.uuid == r.gpu.uuid), None)
        except E.PvegpuError as exc:
            gpu, why = None, exc.message
        if gpu is not None:
            s = p.probe.sample([gpu.minor]).get(gpu.minor)
            r.used_after = s.used_bytes if s is not None else None
            why = (f"its memory cannot be read ({s.error if s else 'no reading'})" if r.used_after is None
                   else f"{mib(r.used_after, grouped=True)} used, over the idle baseline of {mib(pol.idle_bytes)}"
                   if r.used_after > pol.idle_bytes else "")
            if not why:
                break
        else:
            why = why or f"NVML does not list {r.gpu.uuid}"
        if deadline.expired():
            r.diagnosis.append(Diagnosis(Kind.GPU_UNREADABLE, f"{r.label} is not back after the reset: {why}",
                                         "check `nvidia-smi` and `dmesg`; a GPU that does not come back needs a reboot"))
            run.step("verify", "not-back", why)
            return
        if not said:
            said = True
            run.step("wait", "verify", f"waiting up to {pol.verify_wait:g} s for {r.label} to answer at its idle memory: {why}")
        p.clock.sleep(min(pol.poll, max(0.0, deadline.remaining())))
    health = getattr(p.probe, "health", None)
    try:
        r.recovery_after = health(r.gpu.minor).recovery_action if health is not None else None
    except E.PvegpuError:
        r.recovery_after = None
    if r.recovery_after not in (None, "none"):
        r.diagnosis.append(Diagnosis(Kind.GPU_UNREADABLE, f"NVML still says {r.label} needs {r.recovery_after} after the reset",
                                     "drain the node and reboot it"))
        run.step("verify", "not-back", f"recovery action {r.recovery_after}")
        return
    word = "ok" if r.recovery_after == "none" else "unverified"
    run.step("verify", word, f"{r.label} answers with {mib(r.used_after, grouped=True)} used; recovery action "
             + ("none" if word == "ok" else "unknown (NVML cannot tell): unverified"))
    _record(run)


def _record(run: _Run) -> None:
    """The reset, in the kernel log: from here on the GPU's earlier Xids no longer count (``pvegpu.health``), so the gate
    judges the containers' starts on what the GPU says now."""
    r, log = run.r, run.p.kernlog
    if log is None:
        return
    try:
        log.write(reset_record(r.gpu.bus_id, r.gpu.uuid))
    except OSError as exc:
        r.diagnosis.append(Diagnosis(Kind.GPU_UNREADABLE, f"the reset of {r.label} could not be recorded in the kernel log "
                                     f"({exc.strerror or exc}): the gate still counts its earlier Xids",
                                     "reboot to clear them, or start a refused container once with `pvegpu hook allow-once VMID`"))
        run.step("record", "failed", f"kernel log: {exc.strerror or exc}")
        return
    run.step("record", "ok", f"reset of {r.label} recorded in the kernel log: its earlier Xids no longer count")


def _back(run: _Run) -> bool:
    return any(s.name == "verify" and s.outcome in ("ok", "unverified") for s in run.r.steps)


def _start_again(run: _Run) -> None:
    """(g) Start exactly the CTs this run stopped: each through the gate, each verified running. After a reset that did
    not bring the GPU back they stay stopped, said with the command to start them."""
    r, p = run.r, run.p
    held = any(s.name == "reset" and s.outcome == "ok" for s in r.steps) and not _back(run)
    for ct in run.cts:
        vmid = ct.run.vmid
        if not ct.run.ct.stop_requested:
            continue
        if ct.run.ct.ct_state != "stopped":  # a failed stop: where it is was said (note_state)
            if ct.run.ct.left_stopped:
                r.left_stopped.append(vmid)
            continue
        if held:
            r.left_stopped.append(vmid)
            r.diagnosis.append(Diagnosis(Kind.HELD_STOPPED, f"CT {vmid} was left STOPPED: its GPU is not back after the reset",
                                         f"once the GPU is back (`pvegpu check {vmid}` allows it): `pct start {vmid}`"))
            continue
        if p.gate is not None:
            allow, paragraph = _gate(run, vmid, waive_health=not r.reset_ran)
            if not allow:
                r.left_stopped.append(vmid)
                r.diagnosis.append(Diagnosis(Kind.LEFT_STOPPED, f"CT {vmid} was left STOPPED: the start gate refuses it: {paragraph}",
                                             f"fix what it names, then `pct start {vmid}`"))
                run.step("start", "refused", f"CT {vmid} not started: the gate refuses")
                continue
        # the start's own deadline: the other CTs' stops and the GPU's reset before it were not this CT's time
        ct.run.deadline = Deadline(p.clock, p.clock.monotonic() + ct.run.policy.budget)
        try:
            start(ct.run, ha=ct.ha, done="GPU reset and verified while it was stopped" if r.reset_ran else "its GPU was not reset")
        finally:
            if vmid in run.once:
                _after_once(run, vmid, ct.run.ct.restarted, ct.run.ct.start_pending)
        r.diagnosis.extend(ct.run.report.diagnosis)
        ct.run.report.diagnosis.clear()
        if ct.run.ct.restarted and not ct.run.ct.left_stopped:
            r.restarted.append(vmid)
        else:
            r.left_stopped.append(vmid)


def _gate(run: _Run, vmid: int, *, waive_health: bool) -> tuple[bool, str]:
    """The gate's verdict on CT ``vmid``'s start. A container stopped a moment ago leaves its memory to the driver for
    a little while (its dead pids still listed): a refusal is asked again until ``verify_wait`` is over.

    ``waive_health``: the GPU was not reset, so it is as it was while the container ran on it; its health (a reset
    it still needs) does not keep the container from running again as before, every other refusal does. The
    hookscript's gate is told so with an allow-once token, written only when the health is all that refuses."""
    p = run.p
    assert p.gate is not None
    deadline = Deadline(p.clock, p.clock.monotonic() + run.policy.verify_wait)
    said = False
    while True:
        allow, paragraph = p.gate(vmid, False)
        if not allow and waive_health and p.allow_once is not None and p.gate(vmid, True)[0]:
            try:
                run.once[vmid] = p.allow_once(vmid)
            except (OSError, E.PvegpuError) as exc:
                return False, f"{paragraph} (the allow-once token that would start it as it ran before cannot be written: {exc})"
            run.step("start", "as-before", f"CT {vmid} runs again on the GPU it ran on (not reset): its health alone refuses, "
                     "so its start passes the gate once")
            return True, paragraph
        if allow or deadline.expired():
            return allow, paragraph
        if not said:
            said = True
            run.step("wait", "gate", f"the gate refuses CT {vmid}'s start for now; asking again for up to {run.policy.verify_wait:g} s")
        p.clock.sleep(min(run.policy.poll, max(0.0, deadline.remaining())))


def _after_once(run: _Run, vmid: int, running: bool, pending: bool) -> None:
    """After a start as before: a start whose request may still run keeps its token (its hookscript is yet to come); any
    other that left the token (it failed before its hookscript ran) has it withdrawn, so it cannot waive a later start's
    refusal, and the admin is told how to start it as before."""
    if pending and not running:
        run.r.diagnosis.append(Diagnosis(Kind.LEFT_STOPPED, f"CT {vmid}'s start as before may still happen: its allow-once token "
                                         "is kept for it (until gate.override_ttl)", f"check `pct status {vmid}`"))
        return
    withdraw = run.once.pop(vmid)
    try:
        withdraw()
    except (OSError, E.PvegpuError) as exc:
        run.step("start", "token-left", f"CT {vmid}'s allow-once token could not be removed ({exc}): its next start passes "
                 "the gate once within gate.override_ttl")
        return
    if not running:  # its GPU was not reset: the gate refuses it on health until `pvegpu hook allow-once`
        run.r.diagnosis.append(Diagnosis(Kind.LEFT_STOPPED, f"CT {vmid} did not start as before; its GPU still needs a reset",
                                         f"`pvegpu hook allow-once {vmid} && pct start {vmid}` starts it as it ran before; "
                                         "a GPU reset or a reboot clears the refusal (docs/gpu-reset.md)"))


def _interrupted(run: _Run, signame: str, *, abandoned: bool) -> None:
    r = run.r
    wheres, left = [], []
    for ct in run.cts:
        if not ct.run.ct.stop_requested:
            continue
        c = ct.run.ct
        gone, _, where = interruption("CT", ct.run.vmid, c.ct_state, restarted=c.restarted, left_stopped=c.left_stopped,
                                      start_requested=c.start_requested, abandoned=abandoned)
        wheres.append(where)
        if gone:
            left.append(ct.run.vmid)
            if ct.run.vmid not in r.left_stopped:
                r.left_stopped.append(ct.run.vmid)
    action = "abandoned the restart at the second signal" if abandoned else "finished the restart before exiting"
    r.interrupted = {"signal": signame, "action": action, "left_stopped": left}
    msg = f"pvegpu gpu-reset of {r.label} interrupted by {signame} after it stopped containers: it {action}; " + (
        "; ".join(wheres) or "no container was stopped")
    run.step("interrupted", signame, msg)
    r.diagnosis.append(Diagnosis(Kind.INTERRUPTED, msg, "; ".join(f"`pct start {v}` once `pvegpu check {v}` allows it" for v in left)
                                 or "nothing left to do"))


def _conclude(run: _Run, signal_exit: int | None) -> None:
    r = run.r
    errors = [ct.run.ct.pve_error for ct in run.cts if ct.run.ct.pve_error is not None]
    if r.refusals:
        busy = all(d.kind is Refusal.CT_BUSY for d in r.refusals)  # type: ignore[comparison-overlap]
        r.outcome, r.exit_code = Outcome.REFUSED, E.EXIT_BUSY if busy else E.EXIT_GPU_RESET_REFUSED
    elif not r.reset_ran:
        stop_failed = bool(errors) or any(s.name == "restart" and s.outcome == "failed" for s in r.steps)
        r.outcome = Outcome.FAILED
        r.exit_code = (errors[0] if errors else E.EXIT_PVE) if stop_failed else run.failed_exit or E.EXIT_FAILURE
    elif not any(s.name == "reset" and s.outcome == "ok" for s in r.steps):
        r.outcome, r.exit_code = Outcome.FAILED, E.EXIT_GPU_RESET_FAILED
    elif not _back(run):
        r.outcome, r.exit_code = Outcome.NOT_BACK, E.EXIT_GPU_RESET_FAILED
    else:
        r.outcome = Outcome.RESET if r.recovery_after == "none" else Outcome.UNVERIFIED
        r.exit_code = E.EXIT_OK if r.outcome is Outcome.RESET else E.EXIT_GPU_UNKNOWN
        if r.left_stopped:
            r.exit_code = errors[0] if errors else E.EXIT_PVE
    if signal_exit is not None:
        r.exit_code = signal_exit
