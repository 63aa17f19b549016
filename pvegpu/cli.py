"""The ``pvegpu`` command line (typer). Thin: settings and ports come from ``wiring``, the work from the core,
the text from ``render``; errors propagate to ``run``, where they render themselves once (``PvegpuError.show``).

``check`` and ``hook VMID PHASE`` never reach typer: the front door sends them down the gate's light path
(``pvegpu.hook``); they are listed here so that ``pvegpu --help`` shows them.
"""

from __future__ import annotations

import inspect
import json
import signal
import sys
from typing import Any

import typer
import typer.exceptions as typer_exc
from typer._click import exceptions as click_exc
from typer._click.utils import PacifyFlushWrapper
from typer.core import TyperCommand, TyperGroup

from . import auditcmd, contract, resetcmd, wiring
from . import errors as E
from .locate import check_vmid
from .resetcmd import _say, _Signals, do_reset, do_vm_reset  # noqa: F401 - moved to resetcmd (no typer on the reset path)
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


def reset_cmd(**values: Any) -> None:
    raise typer.Exit(resetcmd.run(values, _OPTS))


def _reset_params() -> list[inspect.Parameter]:
    """The typer parameters of ``pvegpu reset``, from ``resetcmd.OPTIONS`` (the table the light parser reads)."""
    name, metavar, text = resetcmd.ARGUMENT
    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=str, default=typer.Argument(..., metavar=metavar, help=text))]
    for o in resetcmd.OPTIONS:
        flag = o.kind == "flag"
        opt = typer.Option(False if flag else None, *o.decls, help=o.help, metavar=o.metavar or None)
        params.append(inspect.Parameter(o.dest, inspect.Parameter.KEYWORD_ONLY, annotation=bool if flag else float | None, default=opt))
    return params


reset_cmd.__signature__ = inspect.Signature(_reset_params())  # type: ignore[attr-defined]
reset_cmd.__annotations__ = {p.name: p.annotation for p in reset_cmd.__signature__.parameters.values()}  # type: ignore[attr-defined]
reset_cmd.__doc__ = resetcmd.HELP
app.command("reset", cls=_Command)(reset_cmd)


@app.command("check", cls=_Command, add_help_option=False, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def check_cmd(ctx: typer.Context) -> None:
    """May the container start now? `pvegpu check VMID [--json]`: exit 0 yes, 10 refused (the hookscript's decision)."""
    from . import hook

    raise typer.Exit(hook.main(["check", *ctx.args], _OPTS))  # not reached: the front door routes `check` to hook


# -- audit --------------------------------------------------------------------------------------------------


def audit_cmd(**values: Any) -> None:
    raise typer.Exit(auditcmd.run(values, _OPTS))


def _audit_params() -> list[inspect.Parameter]:
    """The typer parameters of ``pvegpu audit``, from ``auditcmd.OPTIONS`` (the table the light parser reads)."""
    kinds: dict[str, Any] = {"flag": bool, "seconds": float, "text": str | None, "texts": list[str]}
    params = []
    for o in auditcmd.OPTIONS:
        default = [] if o.kind == "texts" else o.default
        opt = typer.Option(default, *o.decls, help=o.help, metavar=o.metavar or None, hidden=o.hidden)
        params.append(inspect.Parameter(o.dest, inspect.Parameter.KEYWORD_ONLY, annotation=kinds[o.kind], default=opt))
    return params


audit_cmd.__signature__ = inspect.Signature(_audit_params())  # type: ignore[attr-defined]
audit_cmd.__annotations__ = {p.name: p.annotation for p in audit_cmd.__signature__.parameters.values()}  # type: ignore[attr-defined]
audit_cmd.__doc__ = auditcmd.HELP
app.command("audit", cls=_Command)(audit_cmd)


# -- demo ---------------------------------------------------------------------------------------------------


def _audit_table(s: Any) -> str:
    from .audit import audit_document, audit_once
    from .render import audit_text

    p = wiring.world(s).audit_ports()
    rep = audit_once(p.open_probe, pve=p.pve, host=p.host, files=p.files, threshold_bytes=p.threshold_bytes, clock=p.clock, users=p.users)
    return audit_text(audit_document([rep], clock=p.clock))


class _Terminated(Exception):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


@app.command("demo", cls=_Command)
def demo_cmd(
    scenario: str = typer.Option("demo", "--scenario", metavar="NAME", help="a built-in scenario (demo, idle, leak) or a scenario JSON file"),
    grace: float = typer.Option(1.0, "--grace", metavar="SECONDS", help="SIGTERM grace in the demo (short, so the demo is quick)"),
) -> None:
    """Run the real reset code against a built-in simulated node: no Proxmox, GPU or root needed."""
    global _OPTS
    from .install import GUARD, guard_text, template
    from .sim import scenario as sc
    from .sim.lifecycle import create
    from .textfit import said

    data = sc.named(scenario)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)  # a killed demo still takes its workloads with it
    sim = None
    results: list[str] = []
    code = 0
    try:
        sim = create(None, data, (GUARD, guard_text(template())))
        _OPTS = wiring.GlobalOptions(_OPTS.config, sim.root)
        s = _settings({"reset.grace": grace})
        typer.echo(said(f"Simulated node {sim.node} in {sim.root}: containers are real processes, NVML and the API are simulated.",
                        rest="") + "\n")
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
        typer.echo("\n" + said(f"{', '.join(results) or 'nothing to reset'}; simulated node removed (exit {code})", "demo: ", "      "))
    raise typer.Exit(code)


# -- sim create | remove --------------------------------------------------------------------------------------

sim_app = typer.Typer(cls=_Group, no_args_is_help=True, context_settings=CONTEXT,
                      help="A lasting simulated node: `pvegpu sim create DIR`, then `pvegpu --simulate DIR COMMAND`, then `pvegpu sim remove DIR`.")
app.add_typer(sim_app, name="sim")


@sim_app.command("create", cls=_Command)
def sim_create(
    directory: str = typer.Argument(..., metavar="DIR", help="a new directory for the simulated node (made here, mode 700)"),
    scenario: str = typer.Option("demo", "--scenario", metavar="NAME", help="a built-in scenario (demo, idle, leak) or a scenario JSON file"),
) -> None:
    """Build a simulated node in DIR and start its containers (real processes); no Proxmox, GPU or root needed."""
    from .install import GUARD, guard_text, template
    from .sim.lifecycle import create, created

    typer.echo(created(create(directory, scenario, (GUARD, guard_text(template())))))


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
    except click_exc.ClickException as exc:  # a bad line; with --json its consumer still gets a pvegpu-error document
        err = E.UsageError(exc.format_message(), "`pvegpu --help`, or `pvegpu COMMAND --help`")
        if json_out:
            _echo_json(contract.error_document(err, _command(args)))
        return err.show(sys.stderr)
    except typer_exc.Abort:
        sys.stderr.write("aborted\n")
        return 130
    except SystemExit as exc:  # typer turns a closed stdout pipe (`pvegpu demo | head -1`) into a quiet exit 1
        if isinstance(sys.stdout, PacifyFlushWrapper):
            return 141  # as a shell reports a writer that SIGPIPE ended; nothing more to say
        raise exc
    except E.PvegpuError as exc:  # the JSON consumer gets JSON; the person watching still gets the message
        if json_out:
            _echo_json(contract.error_document(exc, _command(args)))
        return exc.show(sys.stderr)
