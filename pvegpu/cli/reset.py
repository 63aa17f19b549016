"""``pvegpu reset``'s run: the guest located once, a container's or a VM's reset under the signal handlers, the
report printed. Its command line is parsed by typer (``cli.reset_cmd``), which calls ``do_reset``.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from pvegpu import wiring
from pvegpu.adapters.logs import configure
from pvegpu.cli.render import reset_human, reset_json, step_line
from pvegpu.core import contract
from pvegpu.core import errors as E
from pvegpu.core.model import SIGNAL_NAMES
from pvegpu.core.ports import Interrupted
from pvegpu.core.textfit import said
from pvegpu.reset import reset
from pvegpu.vm.reset import reset_vm, vm_human


def do_vm_reset(s: Any, vmid: int, *, dry_run: bool, json_out: bool, verbose: bool = False) -> int:
    """A VM: its holders are found and stopped inside the guest, through the guest agent (pvegpu/vm/reset.py)."""
    with _Signals(vmid, "VM") as signals:
        return _guarded(signals, lambda: _vm_reset(s, vmid, signals, dry_run=dry_run, json_out=json_out, verbose=verbose))


def _guarded(signals: _Signals, body: Any) -> int:
    """``body()`` under the handlers: a signal that ends it (before the stop request, or one escaping at its very
    start) is one error line and the journal's, saying what was, or may have been, stopped."""
    try:
        return int(body())
    except Interrupted as exc:  # after the stop request, reset() / reset_vm() report the signal themselves
        signals.done = True
        kind, vmid = signals.kind, signals.vmid
        if kind is None:  # before the guest was located: pvegpu does not know yet whether it is a CT or a VM
            line = (f"pvegpu reset of guest {vmid} interrupted by {exc.signame} before it was located: "
                    f"guest {vmid} was not stopped and nothing in it was signalled")
            hint = f"run `pvegpu reset {vmid}` again to finish"
        elif signals.in_critical:  # the stop (a VM's shutdown) may have been requested: never claim it was not
            line = (f"pvegpu reset of {kind} {vmid} interrupted by {exc.signame} as it asked for the "
                    f"{'stop' if kind == 'CT' else 'shutdown'}: {kind} {vmid} may be STOPPED")
            hint = (f"check `{'pct' if kind == 'CT' else 'qm'} status {vmid}`; `pvegpu reset {vmid}` again finishes it")
        elif kind == "VM":
            line = (f"pvegpu reset of VM {vmid} interrupted by {exc.signame} before any power action: VM {vmid} was not stopped "
                    "(guest processes may have been signalled)")
            hint = f"run `pvegpu reset {vmid}` again to finish"
        else:
            line = f"pvegpu reset of CT {vmid} interrupted by {exc.signame} before any stop was requested: CT {vmid} was not stopped"
            hint = f"run `pvegpu reset {vmid}` again to finish; `pvegpu check {vmid}` says whether it may start"
        wiring.journal_line(line)
        raise E.SignalledError(line, hint, exc.exit_code) from None


def _vm_reset(s: Any, vmid: int, signals: _Signals, *, dry_run: bool, json_out: bool, verbose: bool) -> int:
    """A VM's reset, under the handlers; the report is printed before they go (``done``: a signal is then recorded)."""
    signals.kind = "VM"
    log = configure(verbose=verbose, json_lines=json_out and verbose)
    on_step = None if json_out else (lambda st: _say(step_line(st.name, str(st.detail.get("msg", st.outcome)), verbose), err=False))
    on_wait = None if json_out else (lambda text: _say(step_line("wait", text, verbose), err=False))
    with wiring.ct_lock(s, vmid, s.reset.lock_wait, kind="VM"):
        report = reset_vm(vmid, wiring.vm_api(s), wiring.system_clock(), wiring.vm_policy(s, dry_run=dry_run), on_step, log,
                          interrupts=signals, on_progress=on_wait)
        signals.done = True
    if report.interrupted or report.left_stopped:
        wiring.journal_line(next((p for p, _ in report.diagnosis if "interrupted by" in p), "")
                            or f"pvegpu reset of VM {vmid}: VM {vmid} was left STOPPED ({report.outcome.value}, exit {report.exit_code})")
    _say(contract.dumps(contract.document("reset", report.to_json())) if json_out else "\n" + vm_human(report, verbose), err=False)
    return int(report.exit_code)


class _Signals:
    """SIGINT, SIGTERM and SIGHUP during ``pvegpu reset`` (the ``Interrupts`` port). Before the stop request a
    signal ends the run at once (nothing was stopped). From it on, the first signal is recorded and said, and
    the restart is finished (then exit 128+n); a second one abandons it (the report still says where the CT is)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, vmid: int, kind: str | None = "CT") -> None:
        self.vmid, self.kind = vmid, kind  # kind None: not located yet ("guest VMID" until it is "CT" or "VM")
        self.in_critical = self.done = self.raised = False
        self.got: tuple[str, int] | None = None
        self.previous: dict[int, Any] = {}
        self.announce: str | None = None  # what the first signal after the stop request says (gpu-reset's own words)

    def __enter__(self) -> _Signals:
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def critical(self) -> None:
        self.in_critical = True

    def received(self) -> tuple[str, int] | None:
        return self.got

    def _handle(self, signum: int, frame: Any) -> None:
        name, code = SIGNAL_NAMES.get(signum, f"signal {signum}"), 128 + signum
        if self.done:  # the report is being printed: let it finish
            self.got = self.got or (name, code)
            return
        if self.raised:  # it raised once already (the run is ending, or the abandon is being reported): record only
            self.got = self.got or (name, code)
            return
        if not self.in_critical:
            self.raised = True
            raise Interrupted(name, code)
        if self.got is None:
            self.got = (name, code)
            _say(said(f"{name}: " + (self.announce or f"{self.kind or 'guest'} {self.vmid}'s "
                      f"{'shutdown' if self.kind == 'VM' else 'stop'} was requested, so pvegpu finishes the restart first")
                      + f" (then exits {code}); a second Ctrl-C or SIGTERM abandons it", "pvegpu: ", "    "))
            return
        if signum == signal.SIGHUP:  # a dropped session can deliver several (the shell's and the kernel's): never abandon
            return
        self.raised = True  # at most once: a third signal must not break the abandon's report
        raise Interrupted(name, code, abandoned=True)


def _say(text: str, err: bool = True) -> None:
    """Print (and flush, as typer.echo did), ignoring a terminal that is gone (SIGHUP: the session dropped); the
    journal line is the record."""
    stream = sys.stderr if err else sys.stdout
    try:
        stream.write(text + "\n")
        stream.flush()
    except OSError:
        pass


def do_reset(s: Any, vmid: int, *, dry_run: bool, json_out: bool, verbose: bool) -> int:
    with _Signals(vmid, None) as signals:  # from before the guest is located: a Ctrl-C anywhere is one of ours
        return _guarded(signals, lambda: _located(s, vmid, signals, dry_run=dry_run, json_out=json_out, verbose=verbose))


def _located(s: Any, vmid: int, signals: _Signals, *, dry_run: bool, json_out: bool, verbose: bool) -> int:
    world = wiring.world(s)  # one node world for the whole run: the same PVE port locates the guest and resets it
    guest = world.pve.where(vmid)
    if guest is not None and guest.type == "qemu":
        return _vm_reset(s, vmid, signals, dry_run=dry_run, json_out=json_out, verbose=verbose)
    if guest is not None:  # a container: NVML starts now, beside the imports and the lock
        signals.kind = "CT"  # located: from here on the wording is a container's
        world.warm_up()
    return _ct_reset(s, vmid, world, signals, dry_run=dry_run, json_out=json_out, verbose=verbose, guest=guest)


def _ct_reset(s: Any, vmid: int, world: Any, signals: _Signals, *, dry_run: bool, json_out: bool, verbose: bool,
              guest: Any = None) -> int:
    """A container's reset, under the handlers; the report is printed before they go (``done``: a signal is then recorded).
    ``guest`` (located): refused while a gpu-reset drains one of its GPUs."""
    log = configure(verbose=verbose, json_lines=json_out and verbose)  # -v: also one line per item (as check's)
    on_step = None if json_out else (lambda st: _say(step_line(st.name, str(st.detail.get("msg", st.outcome)), verbose), err=False))
    on_wait = None if json_out else (lambda text: _say(step_line("wait", text, verbose), err=False))
    with wiring.ct_lock(s, vmid, s.reset.lock_wait, on_wait) as lock, world.reset_ports(log, exiting=True) as ports:
        ports.lock, ports.interrupts = lock, signals
        if guest is not None and (mark := wiring.ct_draining(s, world.pve, guest)):
            raise E.BusyError(f"CT {vmid}: {mark}", "let it finish: it starts the containers it stopped itself (a mark that "
                              "cannot be read: look at gpureset.drain_dir)")
        report = reset(vmid, ports, wiring.reset_policy(s, dry_run=dry_run), on_step, on_wait)
        signals.done = True  # the report is final: a later signal must not turn it into another message
    if report.interrupted or report.left_stopped:
        wiring.journal_line(next((p for p, _ in report.diagnosis if "interrupted by" in p), "")
                            or f"pvegpu reset of CT {vmid}: CT {vmid} was left STOPPED ({report.outcome.value}, exit {report.exit_code})")
    _say(contract.dumps(contract.document("reset", reset_json(report))) if json_out else "\n" + reset_human(report, verbose), err=False)
    return int(report.exit_code)
