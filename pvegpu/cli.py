"""The ``pvegpu`` command line (typer). Thin: settings and ports come from ``wiring``, the work from the core,
the text from ``render``; errors propagate to ``run``, which renders them once (``errors.render``).

``check`` and ``hook VMID PHASE`` never reach typer: the front door sends them down the gate's light path
(``pvegpu.hook``); they are listed here so that ``pvegpu --help`` shows them.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

import typer
import typer.exceptions as typer_exc
from typer._click import exceptions as click_exc
from typer.core import TyperCommand, TyperGroup

from . import contract, wiring
from . import errors as E
from .locate import check_vmid
from .settings import ApiSettings, GateSettings, ResetSettings

_R, _G, _A = ResetSettings(), GateSettings(), ApiSettings()
CONTEXT = {"help_option_names": ["-h", "--help"]}


def _plain(params: list[Any]) -> list[Any]:
    """Flags show no ``<bool>`` type in help: a flag takes no value."""
    for p in params:
        if getattr(p, "is_flag", False):
            p.display_type_rich = lambda ctx: None
    return params


class _Command(TyperCommand):
    """Help as admins read it: ``pvegpu reset [OPTIONS] VMID``, flags without a type."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [p.strip("{}") for p in super().collect_usage_pieces(ctx)]


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain(super().get_params(ctx))


app = typer.Typer(cls=_Group, add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False, context_settings=CONTEXT,
                  help="Verified GPU reclaim, start gate and audit for Proxmox VE LXC containers.\n\n"
                       "Global options (anywhere on the line): --config FILE, --version, -h/--help.")
hook_app = typer.Typer(cls=_Group, no_args_is_help=True, context_settings=CONTEXT,
                       help="The start gate. As PVE calls it: `pvegpu hook VMID PHASE` (PHASE: pre-start, post-start, pre-stop, "
                            "post-stop; pre-start exits 10 to refuse a start). Manage it with install, uninstall, status, allow-once.")
app.add_typer(hook_app, name="hook")

_OPTS = wiring.GlobalOptions()


def _settings(overrides: dict[str, Any] | None = None) -> Any:
    return wiring.settings(_OPTS, overrides)


def _echo_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


@app.callback()
def _main(
    config: str | None = typer.Option(None, "--config", metavar="FILE", help="settings file (default /etc/pvegpu/pvegpu.toml, or PVEGPU_CONFIG)"),
) -> None:
    """(Global options are taken off the line by the front door; this callback only documents them.)"""


# -- reset --------------------------------------------------------------------------------------------------


def do_vm_reset(s: Any, vmid: int, *, dry_run: bool, json_out: bool, verbose: bool = False) -> int:
    """A VM: its holders are found and stopped inside the guest, through the guest agent (pvegpu/vmreset.py)."""
    from .logs import configure
    from .ports import Interrupted
    from .vmreset import reset_vm, vm_human

    log = configure(verbose=verbose, json_lines=json_out and verbose)
    on_step = None if json_out else (lambda st: _say(f"[{st.name}] {st.detail.get('msg', st.outcome)}", err=False))
    on_wait = None if json_out else (lambda text: _say(f"[wait] {text}", err=False))
    with _Signals(vmid, "VM") as signals:  # the container path's handling: see do_reset
        try:
            with wiring.ct_lock(s, vmid, s.reset.lock_wait):
                report = reset_vm(vmid, wiring.vm_api(s), wiring.system_clock(), wiring.vm_policy(s, dry_run=dry_run), on_step, log,
                                  interrupts=signals, on_progress=on_wait)
                signals.done = True
        except Interrupted as exc:  # before any power action (after it, reset_vm() reports the signal itself)
            line = (f"pvegpu reset of VM {vmid} interrupted by {exc.signame} before any power action: VM {vmid} was not stopped "
                    "(guest processes may have been signalled)")
            wiring.journal_line(line)
            raise E.SignalledError(line, f"run `pvegpu reset {vmid}` again to finish", exc.exit_code) from None
    if report.interrupted or report.left_stopped:
        wiring.journal_line(next((p for p, _ in report.diagnosis if "interrupted by" in p), "")
                            or f"pvegpu reset of VM {vmid}: VM {vmid} was left STOPPED ({report.outcome.value}, exit {report.exit_code})")
    _say(json.dumps(contract.document("reset", report.to_json()), indent=2) if json_out else "\n" + vm_human(report), err=False)
    return int(report.exit_code)


class _Signals:
    """SIGINT, SIGTERM and SIGHUP during ``pvegpu reset`` (the ``Interrupts`` port). Before the stop request a
    signal ends the run at once (nothing was stopped). From it on, the first signal is recorded and said, and
    the restart is finished (then exit 128+n); a second one abandons it (the report still says where the CT is)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, vmid: int, kind: str = "CT") -> None:
        self.vmid, self.kind = vmid, kind
        self.in_critical = self.done = False
        self.got: tuple[str, int] | None = None
        self.previous: dict[int, Any] = {}

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
        from .ports import Interrupted

        name, code = signal.Signals(signum).name, 128 + signum
        if self.done:  # the report is being printed: let it finish
            self.got = self.got or (name, code)
            return
        if not self.in_critical:
            raise Interrupted(name, code)
        if self.got is None:
            self.got = (name, code)
            _say(f"pvegpu: {name}: {self.kind} {self.vmid}'s {'stop' if self.kind == 'CT' else 'shutdown'} was requested, "
                 "so pvegpu finishes the restart first "
                 f"(then exits {code}); a second Ctrl-C or SIGTERM abandons it")
            return
        if signum == signal.SIGHUP:  # a dropped session can deliver several (the shell's and the kernel's): never abandon
            return
        raise Interrupted(name, code, abandoned=True)


def _say(text: str, err: bool = True) -> None:
    """Print, ignoring a terminal that is gone (SIGHUP: the session dropped); the journal line is the record."""
    try:
        typer.echo(text, err=err)
    except OSError:
        pass


def do_reset(s: Any, vmid: int, *, dry_run: bool, json_out: bool, verbose: bool) -> int:
    guest = wiring.pve_port(s).where(vmid)
    if guest is not None and guest.type == "qemu":
        return do_vm_reset(s, vmid, dry_run=dry_run, json_out=json_out, verbose=verbose)
    from .logs import configure
    from .ports import Interrupted
    from .reclaim import reset
    from .render import reset_human, reset_json

    log = configure(verbose=verbose, json_lines=json_out and verbose)
    on_step = None if json_out else (lambda st: _say(f"[{st.name}] {st.detail.get('msg', st.outcome)}", err=False))
    on_wait = None if json_out else (lambda text: _say(f"[wait] {text}", err=False))
    with _Signals(vmid) as signals:
        try:
            with wiring.ct_lock(s, vmid, s.reset.lock_wait, on_wait) as lock, wiring.node(s, log) as ports:
                ports.lock, ports.interrupts = lock, signals
                report = reset(vmid, ports, wiring.reset_policy(s, dry_run=dry_run), on_step, on_wait)
                signals.done = True  # the report is final: a later signal must not turn it into another message
        except Interrupted as exc:  # before any stop was requested (after it, reset() reports the signal itself)
            line = f"pvegpu reset of CT {vmid} interrupted by {exc.signame} before any stop was requested: CT {vmid} was not stopped"
            wiring.journal_line(line)
            raise E.SignalledError(line, f"run `pvegpu reset {vmid}` again to finish; `pvegpu check {vmid}` says whether it may start",
                                     exc.exit_code) from None
    if report.interrupted or report.left_stopped:
        wiring.journal_line(next((p for p, _ in report.diagnosis if "interrupted by" in p), "")
                            or f"pvegpu reset of CT {vmid}: CT {vmid} was left STOPPED ({report.outcome.value}, exit {report.exit_code})")
    _say(json.dumps(contract.document("reset", reset_json(report)), indent=2) if json_out else "\n" + reset_human(report), err=False)
    return int(report.exit_code)


@app.command("reset", cls=_Command)
def reset_cmd(
    vmid: str = typer.Argument(..., metavar="VMID", help="container id, e.g. 129, or a VM's (reset inside the guest)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="show what would be signalled and why; signal nothing"),
    no_restart: bool = typer.Option(False, "--no-restart", help="never restart the container through the API"),
    timeout: float | None = typer.Option(None, "--timeout", metavar="SECONDS", help=f"wait for the memory to come back (reset.timeout, default {_R.timeout:g})"),
    grace: float | None = typer.Option(None, "--grace", metavar="SECONDS", help=f"between SIGTERM and SIGKILL (reset.grace, default {_R.grace:g})"),
    settle: float | None = typer.Option(None, "--settle", metavar="SECONDS", help=f"clean must hold this long (reset.settle, default {_R.settle:g})"),
    json_out: bool = typer.Option(False, "--json", help="print the report as JSON (with -v, every event as a JSON line on stderr)"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="log every event (structlog)"),
) -> None:
    """Stop every process of the container that holds its GPUs, verify with NVML that the memory is back,
    and restart the container through the API if it is not. A VM: the same inside the guest, through its guest agent."""
    s = _settings({"reset.timeout": timeout, "reset.grace": grace, "reset.settle": settle, "reset.restart": False if no_restart else None})
    raise typer.Exit(do_reset(s, check_vmid(vmid), dry_run=dry_run, json_out=json_out, verbose=verbose))


@app.command("check", cls=_Command, add_help_option=False, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def check_cmd(ctx: typer.Context) -> None:
    """May the container start now? `pvegpu check VMID [--json]`: exit 0 yes, 10 refused (the hookscript's decision)."""
    from . import hook

    raise typer.Exit(hook.main(["check", *ctx.args], _OPTS))  # not reached: the front door routes `check` to hook


# -- audit --------------------------------------------------------------------------------------------------


@app.command("audit", cls=_Command)
def audit_cmd(
    cluster: bool = typer.Option(False, "--cluster", help="every node: this one, and each other online member's own audit over root SSH"),
    json_out: bool = typer.Option(False, "--json", help="the versioned JSON document (schema pvegpu-audit, version 1)"),
    prometheus: str | None = typer.Option(None, "--prometheus", metavar="FILE",
                                          help="also write a node_exporter textfile (atomically), e.g. /var/lib/prometheus/node-exporter/pvegpu.prom"),
    ssh_timeout: float = typer.Option(30.0, "--ssh-timeout", metavar="SECONDS", help="--cluster: how long to wait for each other node's answer"),
    ssh_option: list[str] = typer.Option([], "--ssh-option", hidden=True, help="extra ssh argument (tests: port, key, known hosts)"),
    wide: bool = typer.Option(False, "--wide", "-v", "--verbose", help="one line per item with every detail (whole command lines), not 80 columns"),
) -> None:
    """Which guest holds which GPU, right now and by configuration; exit 8 when something needs attention."""
    from .audit import audit_document, audit_once
    from .render import audit_text

    if ssh_timeout <= 0:
        raise E.UsageError(f"--ssh-timeout {ssh_timeout:g}: must be more than 0 seconds", "e.g. --ssh-timeout 30")
    s = _settings()
    ports = wiring.audit_ports(s)
    rep = audit_once(ports.open_probe, pve=ports.pve, host=ports.host, files=ports.files, cluster=cluster, threshold_bytes=ports.threshold_bytes,
                     users=ports.users)
    if cluster:
        from .cluster import audit_cluster, parse_members

        members = parse_members(ports.files.read_pve(".members"))
        doc = audit_document(audit_cluster(rep, members, wiring.cluster_audits(ssh_timeout, ssh_option)))
    else:
        doc = audit_document([rep])
    if prometheus:
        wiring.write_textfile(prometheus, doc)
    if json_out:
        typer.echo(json.dumps(contract.document("audit", doc), indent=2))
    elif not prometheus:
        typer.echo(audit_text(doc, wide))
    else:
        typer.echo(f"{prometheus}: {len(rep.gpus)} GPU(s), {sum(f.kind.attention for f in rep.flags)} finding(s) needing attention")
    raise typer.Exit(E.EXIT_AUDIT_ATTENTION if doc["attention"] else E.EXIT_OK)


# -- demo ---------------------------------------------------------------------------------------------------


def _audit_table(s: Any) -> str:
    from .audit import audit_document, audit_once
    from .render import audit_text

    p = wiring.audit_ports(s)
    return audit_text(audit_document([audit_once(p.open_probe, pve=p.pve, host=p.host, files=p.files, threshold_bytes=p.threshold_bytes,
                                                 users=p.users)]))


class _Terminated(Exception):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def _demo_guard(sim: Any, data: dict[str, Any]) -> None:
    """pvegpu's guard in the simulated node's snippets when a container names it (the simulated start runs it)."""
    import os

    from . import install as ins

    if any(c.get("hookscript") == f"local:snippets/{ins.GUARD}" for c in data.get("containers", [])):
        ins.write_atomic(os.path.join(sim.state.snippets, ins.GUARD), ins.guard_text(ins.template()), 0o755)


@app.command("demo", cls=_Command)
def demo_cmd(
    scenario: str | None = typer.Option(None, "--scenario", metavar="FILE", help="a scenario JSON file (default: the built-in one)"),
    grace: float = typer.Option(1.0, "--grace", metavar="SECONDS", help="SIGTERM grace in the demo (short, so the demo is quick)"),
) -> None:
    """Run the real reset code against a built-in simulated node: no Proxmox, GPU or root needed."""
    global _OPTS
    from .sim import scenario as sc

    data = sc.load(scenario) if scenario else sc.DEMO
    previous = signal.signal(signal.SIGTERM, _on_sigterm)  # a killed demo still takes its workloads with it
    sim = None
    results: list[str] = []
    code = 0
    try:
        sim = sc.build(data)
        _demo_guard(sim, data)
        _OPTS = wiring.GlobalOptions(_OPTS.config, sim.root)
        s = _settings({"reset.grace": grace})
        typer.echo(f"Simulated node {sim.node} in {sim.root}: containers are real processes, NVML and the API are simulated.\n")
        typer.echo("$ pvegpu audit")
        typer.echo(_audit_table(s))
        targets = [int(c["vmid"]) for c in data.get("containers", []) if c.get("workloads") and c.get("status", "running") == "running"]
        for vmid in targets[:-1] if len(targets) > 2 else targets:
            typer.echo(f"\n$ pvegpu reset {vmid}")
            rc = do_reset(s, vmid, dry_run=False, json_out=False, verbose=False)
            results.append(f"CT {vmid} {'clean' if rc == 0 else f'exit {rc}'}")
            code = max(code, rc)
            if rc >= 128:  # interrupted by a signal (the reset finished what it had started): stop the demo
                break
        typer.echo("\n$ pvegpu audit")
        typer.echo(_audit_table(s))
    except (_Terminated, E.SignalledError) as exc:  # a reset's own handlers turn SIGTERM into SignalledError
        typer.echo("demo: terminated; simulated containers stopped and removed", err=True)
        code = getattr(exc, "exit_code", 143)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if sim is not None:
            sim.teardown()
    if code < 128:
        typer.echo(f"\ndemo: {', '.join(results) or 'nothing to reset'}; simulated node removed (exit {code})")
    raise typer.Exit(code)


# -- sim create | remove --------------------------------------------------------------------------------------

sim_app = typer.Typer(cls=_Group, no_args_is_help=True, context_settings=CONTEXT,
                      help="A lasting simulated node: `pvegpu sim create DIR`, then `pvegpu --simulate DIR COMMAND`, then `pvegpu sim remove DIR`.")
app.add_typer(sim_app, name="sim")


@sim_app.command("create", cls=_Command)
def sim_create(
    directory: str = typer.Argument(..., metavar="DIR", help="a new (or empty) directory for the simulated node"),
    scenario: str = typer.Option("demo", "--scenario", metavar="NAME", help="a built-in scenario (demo, idle, leak) or a scenario JSON file"),
) -> None:
    """Build a simulated node in DIR and start its containers (real processes); no Proxmox, GPU or root needed."""
    import os

    from .sim import scenario as sc

    data = sc.named(scenario)
    if os.path.lexists(directory) and (not os.path.isdir(directory) or os.path.islink(directory) or os.listdir(directory)):
        raise E.UsageError(f"{directory} exists and is not an empty directory", "name a new directory; `pvegpu sim remove DIR` removes an old node")
    sim = sc.build(data, directory)
    _demo_guard(sim, data)
    running = [c["vmid"] for c in data.get("containers", []) if c.get("status", "running") == "running"]
    typer.echo(f"simulated node {sim.node} in {sim.root}: {len(data.get('containers', []))} container(s), "
               f"running: {', '.join(map(str, running)) or 'none'}")
    typer.echo(f"try: pvegpu --simulate {sim.root} audit; remove it: pvegpu sim remove {sim.root}")


@sim_app.command("remove", cls=_Command)
def sim_remove(directory: str = typer.Argument(..., metavar="DIR", help="a simulated node made by `pvegpu sim create`")) -> None:
    """Stop a simulated node's containers and remove DIR."""
    import os
    import shutil

    from .sim.scenario import SimNode

    if not (os.path.isfile(os.path.join(directory, "scenario.json")) and os.path.isfile(os.path.join(directory, "etc-pve", ".vmlist"))):
        raise E.UsageError(f"{directory} is not a simulated node (no scenario.json and etc-pve/.vmlist there): not removed",
                           "`pvegpu sim remove` removes only a directory `pvegpu sim create` made")
    SimNode(directory).teardown()
    shutil.rmtree(directory)
    typer.echo(f"simulated node in {directory} stopped and removed")


# -- hook install | uninstall | status | allow-once --------------------------------------------------------


def _print_plan(plan: Any) -> None:
    for line in plan.done:
        typer.echo(f"done: {line}")
    for line in plan.refused:
        typer.echo(f"refused: {line}", err=True)
    for line in plan.warnings:
        typer.echo(f"warning: {line}", err=True)


@hook_app.command("install", cls=_Command)
def hook_install(
    vmids: list[str] = typer.Argument(None, metavar="[VMID]...", help="containers to guard (default: every GPU container of this node)"),
    storage: str = typer.Option("local", "--storage", help="snippets storage"),
    chain: bool = typer.Option(False, "--chain", help="keep an existing hookscript: run pvegpu's guard first, then it"),
) -> None:
    """Install the guard snippet and set it as the containers' hookscript (`pct set VMID --hookscript ...`)."""
    from . import install as ins

    t = wiring.install_target(_settings(), storage, need_root=True)
    plan = ins.install([check_vmid(v) for v in vmids or []], pve_root=t.pve_root, node=t.node, storage_name=storage, chain=chain,
                       lister=t.lister, run=t.run)
    _print_plan(plan)
    raise typer.Exit(0 if plan.ok else E.EXIT_AUDIT_ATTENTION)


@hook_app.command("uninstall", cls=_Command)
def hook_uninstall(
    vmids: list[str] = typer.Argument(None, metavar="[VMID]...", help="containers to unguard (default: every guarded container of this node)"),
    storage: str = typer.Option("local", "--storage", help="snippets storage"),
) -> None:
    """Remove the guard from the containers (restoring a chained hookscript) and the snippet once unused."""
    from . import install as ins

    t = wiring.install_target(_settings(), storage, need_root=True)
    plan = ins.uninstall([check_vmid(v) for v in vmids or []], pve_root=t.pve_root, node=t.node, storage_name=storage, run=t.run)
    _print_plan(plan)
    raise typer.Exit(0 if plan.ok else E.EXIT_AUDIT_ATTENTION)


@hook_app.command("status", cls=_Command)
def hook_status(
    storage: str = typer.Option("local", "--storage", help="snippets storage"),
    json_out: bool = typer.Option(False, "--json", help="print the status as JSON"),
) -> None:
    """Guarded and unguarded GPU containers of this node, and nodes missing the snippet. Exit 8 if anything needs attention."""
    from . import install as ins

    t = wiring.install_target(_settings(), storage, need_root=False)
    st = ins.status(pve_root=t.pve_root, node=t.node, storage_name=storage, lister=t.lister)
    if json_out:
        _echo_json(contract.document("hook-status", st.to_json() | {"attention": not st.ok}))
    else:
        for row in st.containers:
            typer.echo(f"CT {row.vmid}: {row.state.value}" + (f" ({row.hookscript})" if row.hookscript else ""))
        for p in st.problems:
            typer.echo(f"problem: {p}")
    raise typer.Exit(0 if st.ok else E.EXIT_AUDIT_ATTENTION)


@hook_app.command("allow-once", cls=_Command)
def hook_allow_once(vmid: str = typer.Argument(..., metavar="VMID", help="container to let through the gate at its next start")) -> None:
    """Let the next start of a container through the start gate once (token expires after gate.override_ttl)."""
    from .adapters.override import allow_once
    from .locate import find_guest

    s = _settings()
    n = check_vmid(vmid)
    pve = wiring.gate_ports(s).pve
    g = pve.where(n)
    if g is not None and g.type == "qemu":  # a VM's start is gated too (pvegpu/vmgate.py)
        local = pve.local_node()
        if local is not None and g.node != local:
            raise E.NotFoundError(f"VM {n} lives on node {g.node}, this is {local}", f"run it there: `ssh {g.node} pvegpu hook allow-once {n}`")
    else:
        find_guest(n, pve)  # an unknown CT or one on another node: say so, write nothing
    try:
        path = allow_once(s.gate.override_dir, n)
    except OSError as exc:
        raise E.UsageError(f"cannot write the override in {s.gate.override_dir}: {exc.strerror or exc}", "run as root on the node") from None
    typer.echo(f"the next start of {'VM' if g is not None and g.type == 'qemu' else 'CT'} {n} passes the gate once ({path}, valid {s.gate.override_ttl:g} s)")


# -- running it ---------------------------------------------------------------------------------------------


def _command(args: list[str]) -> str | None:
    """The command a line runs (``reset``, ``hook status``), for the error document."""
    words = [a for a in args if not a.startswith("-")]
    if not words:
        return None
    return " ".join(words[:2]) if words[0] in ("hook", "sim") and len(words) > 1 else words[0]


def run(args: list[str], opts: wiring.GlobalOptions) -> int:
    """Run the typer app on ``args`` (global options already taken off); errors rendered once, here."""
    global _OPTS
    _OPTS = opts
    json_out = "--json" in args
    try:
        rv = app(args=args, prog_name="pvegpu", standalone_mode=False)
        return int(rv or 0)
    except typer_exc.Exit as exc:
        return int(exc.exit_code)
    except click_exc.NoArgsIsHelpError as exc:
        return int(exc.exit_code) if exc.exit_code else 0
    except click_exc.ClickException as exc:
        sys.stderr.write(E.render(E.UsageError(exc.format_message(), "`pvegpu --help`, or `pvegpu COMMAND --help`")) + "\n")
        return E.EXIT_USAGE
    except typer_exc.Abort:
        sys.stderr.write("aborted\n")
        return 130
    except E.PvegpuError as exc:
        if json_out:  # the JSON consumer gets JSON; the person watching still gets the message
            _echo_json(contract.error_document(exc, _command(args)))
        sys.stderr.write(E.render(exc) + "\n")
        return exc.exit_code
