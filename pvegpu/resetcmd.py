"""``pvegpu reset``: its one option table, the light parser the front door uses, and the reset entry point.

``pvegpu reset`` does not pay for typer (which imports pydantic and rich: ~110 ms): the front door parses its
arguments here, from ``OPTIONS``, the one table that also builds the typer command (``cli.reset_cmd``), so
``pvegpu reset --help`` and this parser cannot disagree. Anything this parser is not sure of (``--help``, an
unknown option, a missing or bad value, ``--``) goes to typer, which says what is wrong exactly as before.
Both ways end in ``run``.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C core: the module adds enums (enum: ~2-5 ms of start-up)
import sys

from . import contract, wiring
from . import errors as E
from .locate import check_vmid
from .model import SIGNAL_NAMES
from .record import record
from .settings import ResetSettings

TYPE_CHECKING = False  # typing is not imported at run time
if TYPE_CHECKING:
    from typing import Any

_R = ResetSettings()


@record(frozen=True)
class Opt:
    """One option of ``pvegpu reset``: a flag, or one taking seconds; ``setting`` is the settings key it overrides."""

    dest: str  # the parameter's name (typer) and the key of ``parse``'s answer
    decls: tuple[str, ...]  # as typed: "--dry-run", or ("-v", "--verbose")
    help: str
    kind: str = "flag"  # flag | seconds
    setting: str = ""  # "reset.timeout"; a flag with a setting sets it False (--no-restart: reset.restart = false)
    metavar: str = ""


ARGUMENT = ("vmid", "VMID", "container id, e.g. 129, or a VM's (reset inside the guest)")
OPTIONS = (
    Opt("dry_run", ("--dry-run",), "show what would be signalled and why; signal nothing"),
    Opt("no_restart", ("--no-restart",), "never restart the container through the API", setting="reset.restart"),
    Opt("timeout", ("--timeout",), f"wait for the memory to come back (reset.timeout, default {_R.timeout:g})", "seconds",
        "reset.timeout", "SECONDS"),
    Opt("grace", ("--grace",), f"between SIGTERM and SIGKILL (reset.grace, default {_R.grace:g})", "seconds", "reset.grace", "SECONDS"),
    Opt("settle", ("--settle",), f"clean must hold this long (reset.settle, default {_R.settle:g})", "seconds", "reset.settle", "SECONDS"),
    Opt("json_out", ("--json",), "print the report as JSON (with -v, every event as a JSON line on stderr)"),
    Opt("verbose", ("-v", "--verbose"), "log every event (structlog)"),
)
HELP = ("Stop every process of the container that holds its GPUs, verify with NVML that the memory is back,\n"
        "    and restart the container through the API if it is not. A VM: the same inside the guest, through its guest agent.")


def parse(args: list[str]) -> dict[str, Any] | None:
    """``reset``'s arguments as ``{dest: value}`` (flags False, seconds None when not given), or None when this
    parser is not sure (help, an unknown option, a bad or missing value, ``--``, not exactly one VMID): typer decides."""
    from .lightargs import scan

    got = scan(args, {d: o for o in OPTIONS for d in o.decls})
    if got is None or len(got[1]) != 1:
        return None
    values: dict[str, Any] = {o.dest: (False if o.kind == "flag" else None) for o in OPTIONS}
    for opt, text in got[0]:
        if text is None:
            values[opt.dest] = True
            continue
        if text.startswith("-"):
            return None
        try:
            values[opt.dest] = float(text)  # what click's FLOAT does; settings then check the range
        except ValueError:
            return None
    values[ARGUMENT[0]] = got[1][0]
    return values


def overrides(values: dict[str, Any]) -> dict[str, Any]:
    """The settings the options override (None: not given, the file or the default stands)."""
    out: dict[str, Any] = {}
    for o in OPTIONS:
        if o.setting:
            v = values.get(o.dest)
            out[o.setting] = (False if v else None) if o.kind == "flag" else v
    return out


def run(values: dict[str, Any], opts: wiring.GlobalOptions) -> int:
    """``pvegpu reset`` with parsed arguments: the one entry point of the typer command and of the light path."""
    s = wiring.settings(opts, overrides(values))
    return do_reset(s, check_vmid(values["vmid"]), dry_run=bool(values["dry_run"]), json_out=bool(values["json_out"]),
                    verbose=bool(values["verbose"]))


def main(args: list[str], opts: wiring.GlobalOptions) -> int | None:
    """The front door's ``reset``: the exit code, or None to let typer handle the line (help, an error in it)."""
    values = parse(args)
    if values is None:
        return None
    json_out = bool(values["json_out"])
    try:
        return run(values, opts)
    except E.PvegpuError as exc:  # as cli.run: the JSON consumer gets JSON; the person watching still gets the message
        if json_out:
            _say(contract.dumps(contract.error_document(exc, "reset")), err=False)
        return exc.show(sys.stderr)
    except KeyboardInterrupt:  # before the handlers were in place: the front door says so on stderr (exit 130)
        if json_out:
            _say(contract.dumps(contract.error_document(E.SignalledError("interrupted", None, 130), "reset")), err=False)
        raise
    except Exception as exc:  # noqa: BLE001 - the front door renders it (one line); --json still gets its document
        if json_out:
            _say(contract.dumps(contract.error_document(E.PvegpuError(f"internal error: {type(exc).__name__}: {exc}"), "reset")),
                 err=False)
        raise


def do_vm_reset(s: Any, vmid: int, *, dry_run: bool, json_out: bool, verbose: bool = False) -> int:
    """A VM: its holders are found and stopped inside the guest, through the guest agent (pvegpu/vmreset.py)."""
    with _Signals(vmid, "VM") as signals:
        return _guarded(signals, lambda: _vm_reset(s, vmid, signals, dry_run=dry_run, json_out=json_out, verbose=verbose))


def _guarded(signals: _Signals, body: Any) -> int:
    """``body()`` under the handlers: a signal that ends it (before the stop request, or one escaping at its very
    start) is one error line and the journal's, saying what was, or may have been, stopped."""
    from .ports import Interrupted

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
    from .logs import configure
    from .render import step_line
    from .vmreset import reset_vm, vm_human

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

    SIGNALS = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)

    def __init__(self, vmid: int, kind: str | None = "CT") -> None:
        self.vmid, self.kind = vmid, kind  # kind None: not located yet ("guest VMID" until it is "CT" or "VM")
        self.in_critical = self.done = self.raised = False
        self.got: tuple[str, int] | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for sig in self.SIGNALS:
            self.previous[sig] = _signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            _signal.signal(sig, handler)

    def critical(self) -> None:
        self.in_critical = True

    def received(self) -> tuple[str, int] | None:
        return self.got

    def _handle(self, signum: int, frame: Any) -> None:
        from .ports import Interrupted

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
            from .textfit import said

            _say(said(f"{name}: {self.kind or 'guest'} {self.vmid}'s {'shutdown' if self.kind == 'VM' else 'stop'} was requested, "
                      f"so pvegpu finishes the restart first (then exits {code}); a second Ctrl-C or SIGTERM abandons it",
                      "pvegpu: ", "    "))
            return
        if signum == _signal.SIGHUP:  # a dropped session can deliver several (the shell's and the kernel's): never abandon
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
    return _ct_reset(s, vmid, world, signals, dry_run=dry_run, json_out=json_out, verbose=verbose)


def _ct_reset(s: Any, vmid: int, world: Any, signals: _Signals, *, dry_run: bool, json_out: bool, verbose: bool) -> int:
    """A container's reset, under the handlers; the report is printed before they go (``done``: a signal is then recorded)."""
    from .logs import configure
    from .render import reset_human, reset_json, step_line
    from .reset import reset

    log = configure(verbose=verbose, json_lines=json_out and verbose)  # -v: also one line per item (as check's)
    on_step = None if json_out else (lambda st: _say(step_line(st.name, str(st.detail.get("msg", st.outcome)), verbose), err=False))
    on_wait = None if json_out else (lambda text: _say(step_line("wait", text, verbose), err=False))
    with wiring.ct_lock(s, vmid, s.reset.lock_wait, on_wait) as lock, world.reset_ports(log, exiting=True) as ports:
        ports.lock, ports.interrupts = lock, signals
        report = reset(vmid, ports, wiring.reset_policy(s, dry_run=dry_run), on_step, on_wait)
        signals.done = True  # the report is final: a later signal must not turn it into another message
    if report.interrupted or report.left_stopped:
        wiring.journal_line(next((p for p, _ in report.diagnosis if "interrupted by" in p), "")
                            or f"pvegpu reset of CT {vmid}: CT {vmid} was left STOPPED ({report.outcome.value}, exit {report.exit_code})")
    _say(contract.dumps(contract.document("reset", reset_json(report))) if json_out else "\n" + reset_human(report, verbose), err=False)
    return int(report.exit_code)
