"""``pvegpu reset``: stop a container's GPU holders, verify the memory is back, restart if not.

The manual procedure it replaces: ``pct exec 129 -- kill -9 ...; fuser -k /dev/nvidia*; sleep 3;
nvidia-smi``. Every step is an event on ``log`` and a ``Step`` in the report; time comes from the
``Clock`` port so tests run the whole state machine without sleeping.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import errors as E
from .inspect import GpuFacts, inspect_gpus
from .locate import Located, locate
from .model import MIB, Holder, ProcIdentity, Step
from .ports import Clock, EventLog, GpuProbe, Host, NullLog, PveApi


@dataclass(frozen=True)
class ResetPolicy:
    grace: float = 10.0  # seconds between SIGTERM and SIGKILL
    kill_wait: float = 5.0  # seconds to wait for SIGKILLed processes to go
    timeout: float = 30.0  # seconds to wait for the memory after the last signal / the stop
    poll: float = 0.05  # seconds between readings
    settle: float = 0.25  # clean must hold this long (a respawning unit restarts within ~0.1 s)
    rounds: int = 3  # signal rounds against respawning holders
    threshold_bytes: int = 64 * MIB  # residual v2 'used' still counted as clean
    restart: bool = True
    dry_run: bool = False
    task_timeout: float = 120.0  # seconds for each PVE stop/start task


@dataclass
class ResetReport:
    vmid: int
    node: str = ""
    gpus: list[int] = field(default_factory=list)  # minors
    before: dict[int, GpuFacts] = field(default_factory=dict)
    after: dict[int, GpuFacts] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    signalled: list[dict[str, object]] = field(default_factory=list)
    plan: list[dict[str, Any]] = field(default_factory=list)  # --dry-run
    outcome: str = "unknown"
    exit_code: int = E.EXIT_FAILURE
    diagnosis: list[tuple[str, str]] = field(default_factory=list)  # (problem, what to do)
    notes: list[str] = field(default_factory=list)
    restarted: bool = False
    pve_error: int | None = None  # exit code of a failed restart step
    left_stopped: bool = False
    elapsed: float = 0.0


@dataclass
class Ports:
    pve: PveApi
    probe: GpuProbe
    host: Host
    clock: Clock
    log: EventLog = field(default_factory=NullLog)


def is_clean(facts: GpuFacts, threshold: int) -> bool:
    """The verified-clean predicate for one GPU after a reset."""
    return (
        facts.sample.known
        and not facts.ct_holders
        and not facts.ghosts
        and not facts.unreadable
        and facts.residual_bytes is not None
        and facts.residual_bytes <= threshold
    )


def _killable(facts: dict[int, GpuFacts], self_pid: int) -> dict[int, Holder]:
    out: dict[int, Holder] = {}
    for f in facts.values():
        for h in f.ct_holders:
            if not h.info.is_ct_init and h.pid != self_pid and h.info.state not in ("Z", "X"):
                out.setdefault(h.pid, h)
    return out


class Resetter:
    """One run of ``pvegpu reset VMID``."""

    def __init__(self, vmid: int, ports: Ports, policy: ResetPolicy, on_step: Callable[[Step], None] | None = None) -> None:
        self.vmid = vmid
        self.p = ports
        self.policy = policy
        self.report = ResetReport(vmid)
        self.on_step = on_step
        self.located: Located | None = None

    # -- helpers --------------------------------------------------------------------------------
    def step(self, name: str, outcome: str, msg: str, **detail: object) -> None:
        s = Step(name, outcome, {"msg": msg, **detail})
        self.report.steps.append(s)
        self.p.log.info(f"reset.{name}", vmid=self.vmid, outcome=outcome, msg=msg, **detail)
        if self.on_step:
            self.on_step(s)

    def inspect(self, whole_host: bool = False) -> dict[int, GpuFacts]:
        assert self.located is not None
        return inspect_gpus(self.vmid, self.located.gpus, host=self.p.host, probe=self.p.probe, whole_host=whole_host)

    def clean(self, facts: dict[int, GpuFacts]) -> bool:
        return all(is_clean(f, self.policy.threshold_bytes) for f in facts.values())

    # -- the procedure --------------------------------------------------------------------------
    def run(self) -> ResetReport:
        t0 = self.p.clock.monotonic()
        try:
            self._run()
        finally:
            self.report.elapsed = self.p.clock.monotonic() - t0
        return self.report

    def _run(self) -> None:
        r, pol = self.report, self.policy
        self.located = loc = locate(self.vmid, pve=self.p.pve, probe=self.p.probe)
        r.node, r.gpus = loc.guest.node, [g.minor for g in loc.gpus]
        r.notes.extend(loc.config.gpus.notes)
        for m in loc.missing_minors:
            r.notes.append(f"config grants /dev/nvidia{m} but this node has no GPU with minor {m}")
        if not loc.gpus:
            raise E.NotFoundError(f"none of CT {self.vmid}'s GPUs exist on this node", "compare `pct config %d` with `nvidia-smi -q | grep Minor`" % self.vmid)
        self.step("locate", "ok", f"CT {self.vmid} on {loc.guest.node}: GPU minor(s) {', '.join(map(str, r.gpus))}",
                  node=loc.guest.node, minors=r.gpus)
        facts = r.before = self.inspect()
        if pol.dry_run:
            self._plan(facts)
            return
        facts = self._stop_holders(facts)
        if not self.clean(facts):
            why_not = restart_would_not_help(self.inspect(whole_host=True))  # unlisted holders elsewhere need a full scan
            if not pol.restart:
                self.step("restart", "skipped", "not clean, and --no-restart was given")
            elif why_not:
                self.step("restart", "skipped", f"not restarting CT {self.vmid}: {why_not}")
            else:
                facts = self._restart(facts)
        self._finish(facts)

    def _plan(self, facts: dict[int, GpuFacts]) -> None:
        r = self.report
        for _pid, h in sorted(_killable(facts, self.p.host.self_pid).items()):
            r.plan.append(_describe(h) | {"action": "SIGTERM, then SIGKILL after grace"})
        for f in facts.values():
            for h in f.ct_holders:
                if h.info.is_ct_init:
                    r.plan.append(_describe(h) | {"action": "none: container init; only a restart stops it"})
            for h in f.other_holders:
                r.plan.append(_describe(h) | {"action": "none: outside CT %d" % self.vmid})
        self.step("dry-run", "ok", f"would signal {sum(1 for p in r.plan if p['action'].startswith('SIGTERM'))} process(es); nothing was signalled")
        r.after, r.outcome, r.exit_code = facts, "dry-run", E.EXIT_OK

    def _stop_holders(self, facts: dict[int, GpuFacts]) -> dict[int, GpuFacts]:
        """Signal rounds until no holder is left or only SIGKILL survivors remain; a holder that shows up
        with a new identity after a round is a respawn, fought for ``rounds`` rounds."""
        pol, rounds = self.policy, 0
        tried: set[ProcIdentity] = set()
        while True:
            killable = _killable(facts, self.p.host.self_pid)
            fresh = {pid: h for pid, h in killable.items() if h.info.ident not in tried}
            if fresh:
                if rounds >= pol.rounds:
                    self.step("respawn", "failed", f"holders still appear after {rounds} round(s)", pids=sorted(fresh))
                    return facts
                rounds += 1
                tried.update(h.info.ident for h in fresh.values())
                self._signal_round(rounds, list(fresh.values()))
                facts = self.inspect()
                continue
            if killable:  # only processes that already survived SIGKILL are left: signalling again is pointless
                return facts
            facts, done = self._verify(facts)
            if done or not _killable(facts, self.p.host.self_pid):
                return facts

    def _signal_round(self, n: int, targets: list[Holder]) -> None:
        pol, host = self.policy, self.p.host
        self.step("round", "start", f"round {n}: {len(targets)} holder(s) in CT {self.vmid}", pids=[h.pid for h in targets])
        live = self._send(targets, signal.SIGTERM)
        live = self._wait_gone(live, pol.grace)
        if live:
            live = self._send(live, signal.SIGKILL)
            live = self._wait_gone(live, pol.kill_wait)
        for h in live:
            d = host.describe(h.pid)
            self.step("survivor", "failed", f"pid {h.pid} ({h.info.comm}) survived SIGKILL, state {d.state if d else '?'}",
                      pid=h.pid, state=d.state if d else "?")

    def _send(self, targets: list[Holder], sig: int) -> list[Holder]:
        name = signal.Signals(sig).name
        sent: list[Holder] = []
        for h in targets:
            res = self.p.host.signal(h.info.ident, sig, self.vmid)
            entry = _describe(h) | {"signal": name, "result": res, "t": round(self.p.clock.monotonic(), 3)}
            self.report.signalled.append(entry)
            self.p.log.info("reset.signal", vmid=self.vmid, **entry)
            self.step("signal", res, f"{name} → pid {h.pid} ({h.info.comm}, CT pid {h.info.ns_pid}): {res}",
                      pid=h.pid, signal=name)
            if res == "sent":
                sent.append(h)
        return sent

    def _wait_gone(self, live: list[Holder], seconds: float) -> list[Holder]:
        clock, host = self.p.clock, self.p.host
        deadline = clock.monotonic() + seconds
        while True:
            live = [h for h in live if host.alive(h.info.ident)]
            if not live or clock.monotonic() >= deadline:
                return live
            clock.sleep(min(self.policy.poll, max(0.0, deadline - clock.monotonic())))

    def _verify(self, facts: dict[int, GpuFacts]) -> tuple[dict[int, GpuFacts], bool]:
        clock, pol = self.p.clock, self.policy
        t0 = clock.monotonic()
        deadline = t0 + pol.timeout
        clean_since: float | None = None
        while True:
            now = clock.monotonic()
            if self.clean(facts):
                clean_since = now if clean_since is None else clean_since
                if now - clean_since >= pol.settle:
                    self.step("verify", "clean", f"NVML agrees: memory back after {clean_since - t0:.3f} s (held for {pol.settle:g} s)",
                              seconds=round(clean_since - t0, 3))
                    return facts, True
            else:
                clean_since = None
                if _killable(facts, self.p.host.self_pid):
                    return facts, False
            if now >= deadline:
                self.step("verify", "timeout", f"not clean after {pol.timeout:g} s")
                return facts, False
            clock.sleep(pol.poll)
            facts = self.inspect()

    def _restart(self, facts: dict[int, GpuFacts]) -> dict[int, GpuFacts]:
        assert self.located is not None
        guest, pve, r = self.located.guest, self.p.pve, self.report
        try:
            status = pve.ct_status(guest)
            if status.status != "running":
                why = ("its status cannot be read" if status.status == "unknown"
                       else f"it is {status.status}, and pvegpu does not start a stopped container")
                self.step("restart", "skipped", f"CT {self.vmid} not restarted: {why}")
                return facts
            if status.lock:
                raise E.PveApiError(f"CT {self.vmid} is locked ({status.lock}); restart refused",
                                    f"wait for the {status.lock} to finish, or `pct unlock {self.vmid}` if it is stale")
            self.step("restart", "stop", f"stopping CT {self.vmid} through the API (GPU not clean)")
            self._task(pve.ct_stop(guest), "stop")
            if status.ha_managed:
                self._await_status("stopped")
            facts, ok = self._verify(self.inspect())
            if not ok:
                r.left_stopped = True
                self.step("restart", "held", f"CT {self.vmid} left stopped: its GPU is still not clean after the stop")
                return facts
            r.left_stopped = True  # until the start is confirmed
            self._task(pve.ct_start(guest), "start")
            if status.ha_managed:
                self._await_status("running")
            r.left_stopped = False
            r.restarted = True
            self.step("restart", "ok", f"CT {self.vmid} restarted; GPU verified clean while it was stopped")
            return facts
        except E.PvegpuError as exc:
            self.step("restart", "failed", exc.message, hint=exc.hint)
            r.diagnosis.append((exc.message, exc.hint or ""))
            r.pve_error = exc.exit_code
            return facts

    def _task(self, upid: str, what: str) -> None:
        node, clock, pve = self.located.guest.node if self.located else "", self.p.clock, self.p.pve
        deadline = clock.monotonic() + self.policy.task_timeout
        while True:
            st = pve.task_status(node, upid)
            if st.get("status") == "stopped":
                break
            if clock.monotonic() >= deadline:
                raise E.TaskTimeout(f"{what} task of CT {self.vmid} still running after {self.policy.task_timeout:g} s ({upid})",
                                    f"look at it: `pvesh get /nodes/{node}/tasks/{upid}/log`; raise reset.task_timeout")
            clock.sleep(0.2)
        exitstatus = str(st.get("exitstatus", ""))
        if exitstatus != "OK" and not exitstatus.startswith("WARNINGS"):
            tail = pve.task_log(node, upid)[-5:]
            hint = "see `pvesh get /nodes/%s/tasks/%s/log`" % (node, upid)
            if "hookscript" in exitstatus:
                hint = "the container's hookscript refused (a start gate?): run `pvegpu check %d` for the reason" % self.vmid
            raise E.TaskFailed(f"{what} task of CT {self.vmid} failed: {exitstatus}", hint, tuple(tail))
        self.step("task", "ok", f"{what} task OK ({upid})", upid=upid)

    def _await_status(self, want: str) -> None:
        assert self.located is not None
        clock, deadline = self.p.clock, self.p.clock.monotonic() + self.policy.task_timeout
        while self.p.pve.ct_status(self.located.guest).status != want:
            if clock.monotonic() >= deadline:
                raise E.TaskTimeout(f"HA did not bring CT {self.vmid} to {want} within {self.policy.task_timeout:g} s",
                                    f"check `ha-manager status` for ct:{self.vmid}")
            clock.sleep(0.2)

    # -- the verdict ----------------------------------------------------------------------------
    def _finish(self, facts: dict[int, GpuFacts]) -> None:
        r = self.report
        r.after = facts
        if self.clean(facts):
            r.outcome = "clean" if r.pve_error is None else "clean, but the restart failed"
            r.exit_code = E.EXIT_OK if r.pve_error is None else r.pve_error
            return
        r.outcome = "not clean"
        whole = r.after = self.inspect(whole_host=True)
        r.diagnosis.extend(diagnose(self.vmid, whole, self.policy.threshold_bytes))
        r.exit_code = r.pve_error if r.pve_error is not None else _exit_for(whole)


def restart_would_not_help(facts: dict[int, GpuFacts]) -> str | None:
    """Why restarting the target cannot fix what is left (None: it may). A restart is for residue of the
    target itself; it must not stop an innocent container for another workload's holder."""
    if any(not f.sample.known for f in facts.values()):
        return "a GPU cannot be read, so the result could not be verified"
    if any(f.ct_holders or f.unreadable for f in facts.values()):
        return None
    unlisted = sorted({h.pid for f in facts.values() for h in f.other_holders if "nvml" not in h.via})
    if unlisted:
        return (f"the memory left is likely held by process(es) {', '.join(map(str, unlisted))} outside this container "
                "that NVML does not list (fork-inherited contexts)")
    return None


def _exit_for(facts: dict[int, GpuFacts]) -> int:
    if any(not f.sample.known for f in facts.values()):
        return E.EXIT_GPU_UNKNOWN
    if any(f.ct_holders or f.unreadable for f in facts.values()):
        return E.EXIT_HOLDERS_LEFT
    return E.EXIT_MEMORY_LEFT


def _describe(h: Holder) -> dict[str, object]:
    return {"pid": h.pid, "ns_pid": h.info.ns_pid, "comm": h.info.comm, "cgroup": h.info.cgroup,
            "state": h.info.state, "via": sorted(h.via)}


def mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / MIB:.0f} MiB"


def diagnose(vmid: int, facts: dict[int, GpuFacts], threshold: int) -> list[tuple[str, str]]:
    """What is left on each GPU, and what the admin can do about it."""
    out: list[tuple[str, str]] = []
    for f in facts.values():
        g = f"GPU minor {f.gpu.minor}"
        if not f.sample.known:
            out.append((f"{g} could not be read: {f.sample.error}", "check `nvidia-smi`; `dmesg | grep -i xid` (GPU lost?)"))
            continue
        for h in f.ct_holders:
            if h.info.state == "D":
                out.append((f"pid {h.pid} ({h.info.comm}) in CT {vmid} is stuck in the driver (state D) on {g}",
                            "no signal can stop it and a container stop will likely hang; check `dmesg | grep -i xid`; a host reboot is the reliable fix"))
            elif h.info.is_ct_init:
                out.append((f"the init of CT {vmid} (pid {h.pid}, {h.info.comm}) holds {g}; pvegpu never signals a container's init",
                            f"restart the container: `pvegpu reset {vmid}` without --no-restart, or `pct reboot {vmid}`"))
            else:
                out.append((f"pid {h.pid} ({h.info.comm}, CT pid {h.info.ns_pid}) in CT {vmid} still holds {g} (state {h.info.state})",
                            f"a service may be restarting it: `pct exec {vmid} -- systemctl list-units --state=running`; or let pvegpu restart the CT"))
        for pid in f.unreadable:
            out.append((f"could not read the open files of pid {pid} in CT {vmid}", "run pvegpu as root"))
        for h in f.other_holders:
            where = f"CT {h.info.placement.vmid}" if h.info.placement.vmid else "the host"
            out.append((f"{g} is also used by pid {h.pid} ({h.info.comm}) in {where}; not touched", "that is another workload; leave it or deal with it there"))
        for pid in f.ghosts:
            out.append((f"NVML still lists pid {pid} on {g}, which no longer exists",
                        "an unlisted process inherited its GPU context, or the driver has not let go; `fuser -v /dev/nvidia*` on the host"))
        res = f.residual_bytes
        if res is not None and res > threshold and not f.ct_holders and not f.other_holders:
            out.append((f"{g} still has {mib(res)} allocated with no holder anywhere: a driver-level leak",
                        f"stop every container using it, then `nvidia-smi -pm 0; nvidia-smi -r -i {f.gpu.index}`, or reboot the host"))
        elif res is None and f.sample.known:
            out.append((f"{g}: memory of other processes is not reported (MIG?), so leftovers cannot be measured", "check with `nvidia-smi`"))
    return out


def reset(vmid: int, ports: Ports, policy: ResetPolicy, on_step: Callable[[Step], None] | None = None) -> ResetReport:
    """Run ``pvegpu reset`` for one container and return the full report (never half-silent)."""
    return Resetter(vmid, ports, policy, on_step).run()


__all__ = ["Ports", "ResetPolicy", "ResetReport", "reset", "is_clean", "diagnose", "ProcIdentity"]
