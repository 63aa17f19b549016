"""``pvegpu reset VMID`` for a VM with a passed-through GPU: stop the holders inside the guest, verify with the
guest's nvidia-smi, and otherwise reboot the VM through the API.

Host NVML cannot see a GPU bound to ``vfio-pci``: every fact here is the guest's, read through the guest agent
(``pvegpu/vm/guest.py``), and the report says so ("verified in the guest"). The steps mirror a container's
reset: locate, find, stop (SIGTERM, SIGKILL after the grace), verify (clean held for the settle window),
restart (shutdown with a timeout, then stop, then start; every task awaited; a ``lock:`` refuses; HA only
requests, so the VM's state is polled), verify again. Manual equivalent: ``qm guest exec VMID -- nvidia-smi``,
``qm guest exec VMID -- kill PID``, ``qm shutdown VMID --timeout 60 || qm stop VMID; qm start VMID``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pvegpu.core import errors as E
from pvegpu.core.deadline import Deadline, deadline_in
from pvegpu.core.model import MIB, Guest, Step
from pvegpu.core.ports import Interrupted, Interrupts, NoInterrupts
from pvegpu.core.qemuconf import parse_hostpci
from pvegpu.core.safetext import escape
from pvegpu.core.textfit import said
from pvegpu.core.units import mib
from pvegpu.reset.interruption import interruption
from pvegpu.reset.poll import until
from pvegpu.reset.restart import HA_STUCK
from pvegpu.vm.guest import AgentForbidden, AgentUnavailable, Clock, GuestCannotTell, GuestHolder, Guestside, GuestTimeout, GuestView, VmApi

EVIDENCE = "the guest's own nvidia-smi and /proc, read through the QEMU guest agent (host NVML cannot see a vfio-pci GPU)"
STATE_POLL = 0.5


class VmOutcome(enum.StrEnum):
    CLEAN = "clean"  # verified in the guest: no holder, held for settle
    CLEAN_RESTART_FAILED = "clean, but the restart failed"
    NOT_VERIFIED = "not verified"  # the guest could not be looked into (no agent, Windows, no nvidia-smi, timeouts)
    NOT_CLEAN = "not clean"
    DRY_RUN = "dry-run"
    NOT_RUNNING = "not running"  # a stopped VM: no guest process exists

    @property
    def verified_clean(self) -> bool:
        return self in (VmOutcome.CLEAN, VmOutcome.CLEAN_RESTART_FAILED)


@dataclass(frozen=True)
class VmPolicy:
    """``[reset]`` applied to a VM (``wiring.vm_policy``)."""

    grace: float = 10.0
    kill_wait: float = 5.0
    timeout: float = 30.0  # wait for the guest to show clean after the last signal
    settle: float = 0.25
    restart: bool = True
    dry_run: bool = False
    task_timeout: float = 120.0  # each shutdown / stop / start task, and the agent coming back after the start
    exec_timeout: float = 10.0  # each command in the guest
    shutdown_timeout: int = 60  # the guest's own clean shutdown before the hard stop
    poll: float = 0.2  # between looks inside the guest
    rounds: int = 3  # signal rounds: holders that appear after a round (respawns) get the next one
    state_wait: float = 15.0


@dataclass
class VmReport:
    vmid: int
    node: str = ""
    devices: list[str] = field(default_factory=list)  # hostpciN entries
    evidence: str = EVIDENCE
    before: GuestView | None = None
    after: GuestView | None = None
    steps: list[Step] = field(default_factory=list)
    signalled: list[dict[str, object]] = field(default_factory=list)
    plan: list[dict[str, Any]] = field(default_factory=list)
    outcome: VmOutcome = VmOutcome.NOT_CLEAN
    exit_code: int = E.EXIT_FAILURE
    diagnosis: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    restarted: bool = False
    left_stopped: bool = False
    vm_state: str | None = None
    task_log: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    power_requested: bool = False  # this reset asked PVE to shut the VM down (the critical section began)
    start_requested: bool = False
    interrupted: dict[str, object] | None = None  # a signal after the power request: its name, what pvegpu did, where the VM is

    def add(self, problem: str, action: str) -> None:
        """A diagnosis line; both may carry text from the guest (an agent's error): escaped."""
        self.diagnosis.append((escape(problem, 2000), escape(action, 2000)))

    def to_json(self) -> dict[str, Any]:
        return {"vmid": self.vmid, "type": "qemu", "node": self.node, "devices": self.devices, "evidence": "guest",
                "evidence_detail": self.evidence, "outcome": self.outcome.value, "exit_code": self.exit_code,
                "steps": [{"name": s.name, "outcome": s.outcome, **s.detail} for s in self.steps],
                "signalled": self.signalled, "plan": self.plan,
                "before": self.before.to_json() if self.before else None, "after": self.after.to_json() if self.after else None,
                "diagnosis": [{"problem": p, "action": a} for p, a in self.diagnosis], "notes": self.notes,
                "restarted": self.restarted, "left_stopped": self.left_stopped, "vm_state": self.vm_state,
                "task_log": self.task_log, "respawns": [], "interrupted": self.interrupted, "elapsed_s": round(self.elapsed, 3)}


class _Run:
    def __init__(self, vmid: int, api: VmApi, clock: Clock, policy: VmPolicy, on_step: Callable[[Step], None] | None,
                 log: Any = None, interrupts: Interrupts | None = None) -> None:
        self.vmid, self.api, self.clock, self.policy, self.on_step, self.log = vmid, api, clock, policy, on_step, log
        self.interrupts: Interrupts = interrupts or NoInterrupts()
        self.on_progress: Callable[[str], None] | None = None
        self.last_look = 0.0  # seconds the last look inside the guest took
        self.report = VmReport(vmid)
        self.guest = Guest(vmid, "", "qemu")
        self.guestside: Guestside | None = None
        self.blind: E.PvegpuError | None = None  # why the guest cannot be looked into (known before any exec)
        self.ha_stuck: str | None = None  # HA's state of the VM once it was found to be one where HA will not act

    def step(self, name: str, outcome: str, msg: str, **detail: object) -> None:
        s = Step(name, outcome, {"msg": escape(msg, 2000), **detail})  # agent errors carry the guest's own text
        self.report.steps.append(s)
        if self.log is not None:
            try:  # the log is information: whatever it raises must not end a reset (as ResetRun.event)
                self.log.info(f"reset.{name}", vmid=self.vmid, type="qemu", outcome=outcome, **s.detail)
            except Exception:  # noqa: BLE001
                pass
        if self.on_step:
            self.on_step(s)

    def look(self, deadline: Deadline | None = None) -> GuestView:
        """One look inside the guest, its commands capped at ``deadline``; a look over a second is said (progress)."""
        assert self.guestside is not None
        t0 = self.clock.monotonic()
        try:
            return self.guestside.look(deadline)
        finally:
            self.last_look = took = self.clock.monotonic() - t0
            if took > 1.0 and self.on_progress:
                self.on_progress(f"looking inside VM {self.vmid} took {took:.1f} s (a slow guest)")

    def fits(self, end: Deadline) -> bool:
        """Whether a look started now may end by ``end``, judged by the last look's duration."""
        return end.fits(self.last_look)

    def waiting(self, what: str, seconds: float) -> Callable[[], None]:
        """A progress line for a wait of up to ``seconds`` (call it before each pause): said once a second, from
        the first second on, with how long it has waited ("waiting for VM 200 to be running: 3 s of 60")."""
        t0, said = self.clock.monotonic(), [0.0]

        def tick() -> None:
            waited = self.clock.monotonic() - t0
            if self.on_progress is not None and waited >= 1.0 and waited - said[0] >= 1.0:
                said[0] = waited
                self.on_progress(f"waiting for {what}: {waited:.0f} s of {seconds:g}")

        return tick


def reset_vm(vmid: int, api: VmApi, clock: Clock, policy: VmPolicy, on_step: Callable[[Step], None] | None = None,
             log: Any = None, interrupts: Interrupts | None = None, on_progress: Callable[[str], None] | None = None) -> VmReport:
    """Run ``pvegpu reset`` for one VM and return the full report; PveApiErrors end as the report's exit code.
    ``log``: an EventLog (structlog) that gets every step as an event. Signals (``interrupts``) as for a container:
    before the first power action ``Interrupted`` is raised (the VM was not stopped); from it on the first signal
    is recorded and the restart finished (exit 128+n), a second one abandons it; both say where the VM is."""
    run = _Run(vmid, api, clock, policy, on_step, log, interrupts)
    run.on_progress = on_progress
    t0 = clock.monotonic()
    try:
        _reset(run)
    except Interrupted as exc:
        if not run.report.power_requested:
            raise
        _interrupted(run, exc.signame, exc.exit_code, abandoned=True)
    finally:
        run.report.elapsed = clock.monotonic() - t0
    r = run.report
    got = run.interrupts.received()
    if got and r.interrupted is None and r.power_requested:
        _interrupted(run, got[0], got[1], abandoned=False)
    return r


def _interrupted(run: _Run, signame: str, code: int, *, abandoned: bool) -> None:
    """A signal after the power request: finished (first signal) or abandoned (second); where the VM is, exit 128+n."""
    r, vmid = run.report, run.vmid
    r.left_stopped, action, where = interruption("VM", vmid, r.vm_state, restarted=r.restarted, left_stopped=r.left_stopped,
                                                 start_requested=r.start_requested, abandoned=abandoned, restart="reboot")
    r.interrupted = {"signal": signame, "action": action, "vm_state": r.vm_state or "unknown", "left_stopped": r.left_stopped}
    msg = f"pvegpu reset of VM {vmid} interrupted by {signame} after it asked for the VM's shutdown: it {action}; {where}"
    run.step("interrupted", signame, msg, signal=signame)
    r.diagnosis.append((msg, f"check `qm status {vmid}`" + (f"; start it with `qm start {vmid}`" if r.left_stopped else "")))
    r.exit_code = code


def _agent_enabled(value: Any) -> bool:
    """``agent: 1`` / ``agent: enabled=1,fstrim_cloned_disks=1`` / ``agent: 0``."""
    first = str(value if value is not None else "0").split(",")[0].strip()
    return first.split("=", 1)[-1].strip() in ("1", "yes", "on", "true")


def _locate(run: _Run) -> Mapping[str, Any] | None:
    guest = run.api.where(run.vmid)
    if guest is None:
        raise E.NotFoundError(f"no guest {run.vmid} in this cluster", "list guests with `qm list` / `pvesh get /cluster/resources --type vm`")
    if guest.type != "qemu":
        raise E.NotFoundError(f"guest {run.vmid} is not a VM", f"`pvegpu reset {run.vmid}` handles containers itself")
    run.guest = guest
    r = run.report
    r.node = guest.node
    conf = run.api.vm_config(guest)
    text = "\n".join(f"{k}: {v}" for k, v in sorted(conf.items()) if str(k).startswith("hostpci") and isinstance(v, (str, int)))
    entries = parse_hostpci(text)
    if not entries:
        raise E.NotFoundError(f"VM {run.vmid} has no PCI passthrough device (hostpciN) in its configuration", f"`qm config {run.vmid}`")
    r.devices = [f"{e.key}: {escape(e.raw, 200)}" for e in entries]
    ostype = str(conf.get("ostype") or "")
    if not _agent_enabled(conf.get("agent")):
        run.blind = AgentUnavailable(f"VM {run.vmid} has no guest agent configured (no `agent: 1` in its config): pvegpu cannot look inside",
                                     f"install qemu-guest-agent in the guest and `qm set {run.vmid} --agent enabled=1` (takes effect at the next start)")
    elif ostype.startswith("win"):
        run.blind = GuestCannotTell(f"VM {run.vmid} is a Windows guest (ostype {escape(ostype, 20)}): pvegpu looks inside Linux guests only",
                                    f"stop the job in the guest, or reboot it: `qm reboot {run.vmid}`")
    run.step("locate", "found", f"VM {run.vmid} on {guest.node}: {', '.join(e.key for e in entries)}; evidence: the guest's nvidia-smi")
    return conf


def _status(run: _Run) -> Mapping[str, Any]:
    return run.api.vm_status(run.guest)


def _reset(run: _Run) -> None:
    r, pol = run.report, run.policy
    try:
        _locate(run)
        status = _status(run)
    except E.PvegpuError as exc:
        if isinstance(exc, E.NotFoundError) or r.node == "":
            raise
        return _fail(run, exc)
    if _not_running(run, status, midway=False):
        return
    run.guestside = Guestside(run.api, run.guest, run.clock, exec_timeout=pol.exec_timeout)
    try:
        view = _look(run)
    except E.PvegpuError as exc:
        return _cannot_look(run, exc)
    r.before = view
    run.step("find", "holders" if view.killable else "none",
             f"{len(view.killable)} holder(s) in VM {run.vmid}'s guest" + (": " + ", ".join(f"pid {h.pid} ({h.comm})" for h in view.killable)
                                                                         if view.killable else ""))
    if pol.dry_run:
        r.plan = [{"pid": h.pid, "comm": h.comm, "via": sorted(h.via), "signal": "SIGTERM, SIGKILL after the grace"} for h in view.killable]
        r.outcome, r.exit_code = VmOutcome.DRY_RUN, E.EXIT_OK
        run.step("dry-run", "planned", f"would signal {len(r.plan)} guest process(es); nothing signalled")
        return
    try:
        view, clean = _stop_and_verify(run, view)
    except E.PvegpuError as exc:
        return _cannot_look(run, exc)
    if clean:
        return _finish(run, view, VmOutcome.CLEAN, E.EXIT_OK)
    if not pol.restart:
        run.step("restart", "skipped", "not clean, and --no-restart was given")
        r.add(f"processes in VM {run.vmid} still hold the GPU: "
                            + ", ".join(f"pid {h.pid} ({h.comm})" for h in view.killable[:8]),
                            f"look inside: `qm guest exec {run.vmid} -- nvidia-smi`; or reboot the VM: `qm reboot {run.vmid}`")
        return _finish(run, view, VmOutcome.NOT_CLEAN, E.EXIT_HOLDERS_LEFT)
    _reboot_and_verify(run)


def _not_running(run: _Run, status: Mapping[str, Any] | None = None, *, midway: bool = True) -> bool:
    """The VM's status, read now (or ``status``, just read): True when the VM is not running (exit 0, nothing to
    reset) or paused (exit 4, ``qm resume``), and the report says so. pvegpu leaves such a VM alone: no shutdown,
    stop or start."""
    r = run.report
    if status is None:
        try:
            status = _status(run)
        except E.PvegpuError as exc:
            _fail(run, exc)
            return True
    state = str(status.get("status") or "unknown")
    qmp = status.get("qmpstatus")
    if state == "running" and qmp is not None and str(qmp) != "running":
        # paused by its admin, suspended, on an I/O error: its agent cannot answer, and it is not pvegpu's to stop
        qmp_s = escape(str(qmp), 40)
        r.outcome, r.exit_code, r.vm_state = VmOutcome.NOT_VERIFIED, E.EXIT_PVE, qmp_s
        run.step("find" if r.before is None else "verify", "paused", f"VM {run.vmid} is {qmp_s}: its guest cannot be looked into")
        r.add(f"VM {run.vmid} is {qmp_s} (qmpstatus): pvegpu does not look into, shut down or stop a paused VM",
              f"resume it (`qm resume {run.vmid}`) and run `pvegpu reset {run.vmid}` again; `qm status {run.vmid} --verbose`")
        return True
    if state == "running":
        return False
    r.outcome, r.exit_code, r.vm_state = VmOutcome.NOT_RUNNING, E.EXIT_OK, escape(state, 40)
    run.step("find" if r.before is None else "verify", "stopped",
             f"VM {run.vmid} is {r.vm_state}" + (" (stopped during the reset, not by pvegpu: left alone)" if midway else "")
             + ": no guest process can hold its GPU; nothing to reset")
    return True


def _look(run: _Run) -> GuestView:
    if run.blind is not None:
        raise run.blind
    return run.look()


def _cannot_look(run: _Run, exc: E.PvegpuError) -> None:
    """The guest cannot be looked into (or stopped talking): say why; reboot where allowed, else exit with the reason."""
    r = run.report
    if _not_running(run):  # the VM was stopped meanwhile (its agent's "VM N not running"): not pvegpu's to start
        return
    if not isinstance(exc, REBOOTABLE):  # a 403, or any other API error: it says nothing about the guest's GPU
        run.step("find" if r.before is None else "verify", "unknown", exc.message)
        if isinstance(exc, AgentForbidden) or "permission" in exc.message.lower():
            r.add(f"pvegpu may not run commands in VM {run.vmid}'s guest: {exc.message}",
                  f"the API token needs VM.GuestAgent.Unrestricted (PVE 9) or VM.Monitor (PVE 8) on /vms/{run.vmid}; "
                  "nothing was stopped (README 'VMs')")
        else:
            r.add(f"{exc.message} (VM {run.vmid} was not rebooted: only a guest agent that does not answer is a reason to)", exc.hint or "")
        r.outcome, r.exit_code = VmOutcome.NOT_VERIFIED, exc.exit_code
        return
    run.step("find" if r.before is None else "verify", "unknown", exc.message)
    r.add(exc.message, exc.hint or "")
    if run.policy.dry_run or not run.policy.restart:
        r.outcome, r.exit_code = VmOutcome.NOT_VERIFIED, exc.exit_code
        if not run.policy.dry_run:
            run.step("restart", "skipped", "cannot verify inside the guest, and --no-restart was given")
        return
    _reboot_and_verify(run, reason=exc)


# What may send a VM down the reboot path: the guest cannot be looked into (no agent configured, an agent that
# does not answer, a command that times out, a guest without nvidia-smi or Windows). Never a 403 or another API error.
REBOOTABLE = (AgentUnavailable, GuestTimeout, GuestCannotTell)


def _stop_and_verify(run: _Run, view: GuestView) -> tuple[GuestView, bool]:
    """Rounds of SIGTERM, then SIGKILL after the grace to the survivors of that SIGTERM only (same pid and start
    time); a holder that appeared meanwhile (a respawn) gets its own round, ``rounds`` in all. Then wait for clean
    to hold for the settle window."""
    pol, gs = run.policy, run.guestside
    assert gs is not None
    seen: set[tuple[int, int | None]] = set()
    for n in range(1, pol.rounds + 1):
        fresh = [h for h in view.killable if (h.pid, h.start) not in seen]
        if not fresh:
            break
        if n > 1:
            run.step("respawn", "found", f"{len(fresh)} new holder(s) in VM {run.vmid}'s guest after round {n - 1}: "
                     + ", ".join(f"pid {h.pid} ({h.comm})" for h in fresh[:8]), pids=[h.pid for h in fresh])
        seen |= {(h.pid, h.start) for h in fresh}
        targets = fresh
        for sig, wait in (("TERM", pol.grace), ("KILL", pol.kill_wait)):
            if not targets:
                break
            _send(run, sig, targets)
            ids = {(h.pid, h.start) for h in targets}
            view = _wait_gone(run, wait, ids, view)
            targets = [h for h in view.killable if (h.pid, h.start) in ids]  # survivors of this very signal
    return _verify(run, view)


def _send(run: _Run, sig: str, targets: list[GuestHolder]) -> None:
    assert run.guestside is not None
    results = run.guestside.signal(sig, targets)
    for h in targets:
        res = results.get(h.pid, "unknown")
        run.report.signalled.append({"pid": h.pid, "comm": h.comm, "signal": f"SIG{sig}", "result": res})
        run.step("signal", res, f"SIG{sig} → guest pid {h.pid} ({h.comm}): {res}", pid=h.pid, signal=f"SIG{sig}")


def _wait_gone(run: _Run, seconds: float, ids: set[tuple[int, int | None]], last: GuestView) -> GuestView:
    """Look until the signalled holders are gone or ``seconds`` passed. A look that cannot end in the time left is
    not started (nor one past it finished): the wait is still kept (a SIGKILL comes only after the grace), the last
    view stands, and the next signal's script checks identities; the verdict takes a look of its own (``_verify``)."""
    end = deadline_in(run.clock, seconds)
    view = last
    while True:
        if not run.fits(end):
            end.pause(end.remaining())
            return view
        try:
            view = run.look(end)
        except GuestTimeout:
            if not end.expired():
                raise
            return view
        if not ids & {(h.pid, h.start) for h in view.killable} or end.expired():
            return view
        end.pause(run.policy.poll)


def _verify(run: _Run, view: GuestView) -> tuple[GuestView, bool]:
    """Clean (no holder that may own a context, nothing NVML lists without a process) held for ``settle``. Judged
    only on looks begun after the last signal: a view from before them (a look slower than the wait after a signal)
    is replaced by a new look first, whatever the time left (each command still within ``exec_timeout``). A guest
    that showed clean when ``timeout`` ran out, but not yet for ``settle``, gets one more look once ``settle`` has
    passed: a slow look never turns a clean guest into "not clean"."""
    pol = run.policy
    end = deadline_in(run.clock, pol.timeout)
    assert run.guestside is not None
    if not run.guestside.after_signals(view):
        view = run.look()
    since: float | None = None  # when clean began (a point in clock time: the settle window is measured from it)
    unfinished = False
    while True:
        now = run.clock.monotonic()
        if view.clean:
            since = now if since is None else since
            if now - since >= pol.settle:
                return _clean(run, view)
        else:
            since = None
        if end.expired() or not run.fits(end):
            break
        end.pause(pol.poll if since is None else max(pol.settle - (now - since), 0.01))
        try:
            view = run.look(end)
        except GuestTimeout:
            if not end.expired():
                raise
            unfinished = True
            break
    if since is not None:
        run.clock.sleep(max(pol.settle - (run.clock.monotonic() - since), 0.0))
        view = run.look()
        if view.clean:
            return _clean(run, view)
    elif unfinished:
        run.step("verify", "not clean", f"the guest did not show clean within {pol.timeout:g} s (its last look did not finish)")
        return view, False
    run.step("verify", "not clean", f"the guest still shows GPU holders after {pol.timeout:g} s")
    return view, False


def _clean(run: _Run, view: GuestView) -> tuple[GuestView, bool]:
    run.step("verify", "clean", f"verified in the guest: nvidia-smi lists no process and no guest process holds the GPU "
             f"(held for {run.policy.settle:g} s)")
    return view, True


def _finish(run: _Run, view: GuestView | None, outcome: VmOutcome, code: int) -> None:
    r = run.report
    r.after = view
    r.outcome, r.exit_code = outcome, code


def _fail(run: _Run, exc: E.PvegpuError, upid: str | None = None) -> None:
    r = run.report
    r.outcome, r.exit_code = (r.outcome if r.outcome.verified_clean else VmOutcome.NOT_CLEAN), exc.exit_code
    run.step("restart" if upid else "api", "failed", exc.message, **({"ha_state": run.ha_stuck} if run.ha_stuck else {}))
    r.add(exc.message, exc.hint or "")
    tail = getattr(exc, "log_tail", ())
    if tail:
        r.task_log = [escape(str(t), 300) for t in tail]


# -- the reboot path -------------------------------------------------------------------------------------------


def _ha(status: Mapping[str, Any]) -> tuple[bool, str | None]:
    """(HA-managed, HA's state of the VM when managed) from a status answer."""
    ha = status.get("ha")
    if not isinstance(ha, Mapping) or str(ha.get("managed")) != "1":
        return False, None
    return True, None if ha.get("state") is None else escape(str(ha["state"]), 40)


def _read(run: _Run) -> tuple[str, str | None]:
    """The VM's state and HA's state of it when HA-managed ("unknown" and None when the status cannot be read)."""
    try:
        status = _status(run)
    except E.PvegpuError:
        return "unknown", None
    return str(status.get("status") or "unknown"), _ha(status)[1]


def _state(run: _Run) -> str:
    return _read(run)[0]


def _await_state(run: _Run, want: str, seconds: float) -> tuple[str, str | None]:
    """The VM's state (and HA's) once it is ``want``, or when ``seconds`` have passed (``reset.poll.until``, as a CT's
    waits); at once when HA is in a state where it will not act (``HA_STUCK``, the container's): never waited out."""
    end = deadline_in(run.clock, seconds)
    _, last = until(lambda: _read(run), lambda r: r if r[0] == want or r[1] in HA_STUCK else None, expired=end.expired,
                    pause=lambda: end.pause(STATE_POLL), on_wait=run.waiting(f"VM {run.vmid} to be {want}", seconds))
    return last


def _ha_will_not_act(run: _Run, want: str, ha_state: str, *, requested: bool) -> E.TaskFailed:
    """HA's state of the VM is one where HA will not act: the error naming it, as a container's
    (``reset.restart.await_state``); recorded in ``run.ha_stuck`` (the steps carry it, no stop follows)."""
    vmid = run.vmid
    run.ha_stuck = ha_state
    return E.TaskFailed(f"HA will not bring VM {vmid} to {want}: its HA resource vm:{vmid} is in state '{ha_state}'"
                        + ("" if requested else "; reboot refused, nothing asked of HA"),
                        f"`ha-manager status`; once the cause is fixed: `ha-manager set vm:{vmid} --state started`"
                        + (" (pvegpu's shutdown request set it to 'stopped')" if requested and want == "stopped"
                           else "" if requested else f", then `pvegpu reset {vmid}` again"))


def _task(run: _Run, upid: str, what: str) -> None:
    run.api.wait_task(run.guest.node, upid, timeout=run.policy.task_timeout, what=f"{what} task of VM {run.vmid}")


def _task_to(run: _Run, upid: str, what: str, want: str, ha: bool) -> None:
    """Await the power task, then the VM's state (HA acts later: within task_timeout); raises TaskFailed if not ``want``."""
    _task(run, upid, what)
    state, ha_state = _await_state(run, want, run.policy.task_timeout if ha else run.policy.state_wait)
    if state == want:
        return
    if ha_state in HA_STUCK:
        raise _ha_will_not_act(run, want, ha_state or "", requested=True)
    raise E.TaskFailed(f"the {what} task of VM {run.vmid} ended, but VM {run.vmid} is not {want}")


def _reboot_and_verify(run: _Run, reason: E.PvegpuError | None = None) -> None:
    r, pol, vmid = run.report, run.policy, run.vmid
    try:
        status = _status(run)
    except E.PvegpuError as exc:
        return _fail(run, exc)
    if _not_running(run, status):  # re-read before any power action: a VM stopped by its admin stays stopped
        return
    lock = status.get("lock")
    if lock:
        return _fail(run, E.PveApiError(f"VM {vmid} is locked ({escape(str(lock), 40)}); reboot refused",
                                        f"wait for the {escape(str(lock), 40)} to finish, or `qm unlock {vmid}` if it is stale"))
    ha, ha_state = _ha(status)
    if ha and ha_state in HA_STUCK:  # a request HA would hold, and carry out later, once its state is cleared
        return _fail(run, _ha_will_not_act(run, "stopped", ha_state or "", requested=False))
    why = reason.message if reason else "the GPU is not clean in the guest"
    run.interrupts.critical()  # from the shutdown request on, a signal never leaves the VM stopped without a word
    r.power_requested = True
    run.step("restart", "shutdown", f"shutting VM {vmid} down through the API ({why}; guest timeout {pol.shutdown_timeout} s)")
    upid: str | None = None
    try:
        try:
            upid = run.api.vm_shutdown(run.guest, pol.shutdown_timeout)
        except E.PveNoAnswer:
            raise  # may have been sent: pvegpu may have stopped it
        except E.PvegpuError:
            if _not_running(run):  # refused because the VM is already down (its admin): leave it alone
                return
            raise
        _task_to(run, upid, "shutdown", "stopped", ha)
    except E.PvegpuError as exc:
        if run.ha_stuck is not None:  # HA would not carry out a stop either: none is asked for
            _fail(run, exc, upid)
            r.vm_state = _state(run)
            r.left_stopped = r.vm_state != "running"
            return
        run.step("restart", "stop", f"shutdown did not stop VM {vmid} ({exc.message}): stopping it")
        try:
            upid = run.api.vm_stop(run.guest)
            _task_to(run, upid, "stop", "stopped", ha)
        except E.PvegpuError as exc2:
            _fail(run, exc2, upid)
            r.vm_state = _await_state(run, "stopped", pol.state_wait)[0]
            r.left_stopped = r.vm_state != "running"
            r.add(f"VM {vmid} is {r.vm_state} after a failed stop", f"`qm status {vmid}`; `qm start {vmid}` if it is stopped")
            return
    r.vm_state, r.left_stopped = "stopped", True
    run.step("restart", "start", f"VM {vmid} stopped; starting it")
    upid = None
    r.start_requested = True
    try:
        upid = run.api.vm_start(run.guest)
        _task_to(run, upid, "start", "running", ha)
    except E.PvegpuError as exc:
        _fail(run, exc, upid)
        r.vm_state = _state(run)
        r.left_stopped = r.vm_state != "running"
        if r.left_stopped:
            r.add(f"VM {vmid} was left STOPPED: its start failed", f"start it with `qm start {vmid}` once the cause is fixed")
        return
    r.vm_state, r.left_stopped, r.restarted = "running", False, True
    run.step("restart", "started", f"VM {vmid} rebooted (shutdown/stop, then start)")
    _verify_after_boot(run)


def _verify_after_boot(run: _Run) -> None:
    """After the start: wait for the agent (within ``task_timeout``), then verify inside the guest."""
    r, pol = run.report, run.policy
    if run.blind is not None:
        r.add(f"VM {run.vmid} was rebooted, but its GPU could not be verified: {run.blind.message}", run.blind.hint or "")
        return _finish(run, None, VmOutcome.NOT_VERIFIED, run.blind.exit_code)
    end = deadline_in(run.clock, pol.task_timeout)
    tick = run.waiting(f"VM {run.vmid}'s guest agent after the reboot", pol.task_timeout)
    while True:
        try:
            run.api.agent_ping(run.guest)
            break
        except E.PvegpuError as exc:
            tick()
            if end.expired():
                r.add(f"VM {run.vmid} was rebooted, but its guest agent did not answer within {pol.task_timeout:g} s: "
                                    f"{exc.message}", f"`qm agent {run.vmid} ping`; is qemu-guest-agent enabled in the guest?")
                return _finish(run, None, VmOutcome.NOT_VERIFIED, E.EXIT_PVE)
            end.pause(1.0)
    try:
        view, clean = _verify(run, _look(run))
    except E.PvegpuError as exc:
        r.add(f"VM {run.vmid} was rebooted, but its GPU could not be verified: {exc.message}", exc.hint or "")
        return _finish(run, None, VmOutcome.NOT_VERIFIED, exc.exit_code)
    if clean:
        return _finish(run, view, VmOutcome.CLEAN, E.EXIT_OK)
    r.add(f"processes in VM {run.vmid} hold the GPU again after the reboot (a service started at boot?)",
                        f"`qm guest exec {run.vmid} -- nvidia-smi`; disable the service in the guest")
    _finish(run, view, VmOutcome.NOT_CLEAN, E.EXIT_HOLDERS_LEFT)


# -- rendering -------------------------------------------------------------------------------------------------


def vm_human(r: VmReport, wide: bool = False) -> str:
    """The report for people: a table per look (before / after) and the verdict, saying the evidence is the guest's;
    in 80 columns (the guest's text wrapped, never cut), or one line per item when ``wide`` (``-v``)."""

    lines = []
    if r.before is not None or r.after is not None:
        lines.append(f"{'GPU':<4} {'bus id (guest)':<18} {'used before':>11}  {'used after':>11}  holders")
        before = {g["index"]: g for g in (r.before.gpus if r.before else [])}
        after = {g["index"]: g for g in (r.after.gpus if r.after else [])}
        nb = len(r.before.killable) if r.before else "?"
        na = len(r.after.killable) if r.after else "?"
        for idx in sorted(set(before) | set(after)) or [None]:
            b, a = before.get(idx, {}), after.get(idx, {})
            lines.append(f"{'?' if idx is None else idx:<4} {escape(str(b.get('bus_id') or a.get('bus_id') or '?'), 18):<18} "
                         f"{_mib(b.get('used_mib')):>11}  {_mib(a.get('used_mib')):>11}  {nb} -> {na}")
    for problem, action in r.diagnosis:
        lines.append(said(problem, "! ", "  ", wide) + (("\n" + said(action, "    -> ", "       ", wide)) if action else ""))
    if r.task_log:
        lines.append("task log (last lines):")
        lines += [said(t, "    ", "      ", wide) for t in r.task_log]
    if r.interrupted:
        lines.append(said(f"interrupted by {r.interrupted['signal']}: pvegpu {r.interrupted['action']}; exit {r.exit_code}", "  ", "    ", wide))
    if r.left_stopped:
        lines.append(said(f"{r.vm_state or 'maybe stopped'}: it was LEFT STOPPED (start it with `qm start {r.vmid}`)", f"VM {r.vmid} is ", "    ", wide))
    verdict = {VmOutcome.CLEAN: "GPU verified free in the guest (its nvidia-smi and /proc; host NVML cannot see a vfio-pci GPU)",
               VmOutcome.DRY_RUN: "dry run: nothing signalled", VmOutcome.NOT_RUNNING: "not running: nothing to do"}.get(
        r.outcome, f"{r.outcome.value} (exit {r.exit_code})")
    lines.append(said(verdict + (" after a reboot" if r.restarted and r.outcome is VmOutcome.CLEAN else "") + f" in {r.elapsed:.2f} s",
                      f"VM {r.vmid}: ", "    ", wide))
    return "\n".join(lines)


def _mib(v: Any) -> str:
    """A guest's figure in whole MiB, shown as every reset screen shows memory (core/units.py)."""
    return mib(None if v is None else v * MIB, "?", grouped=True)
