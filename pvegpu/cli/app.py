"""The ``pvegpu`` command line: the one typer app, which parses every human command.

One option table per command (its function's parameters), the global options (``--config``, ``--simulate``,
``--version``) declared once, in the app's callback, before the subcommand: ``pvegpu --config FILE reset 129``.
Settings and ports come from ``wiring``, the work from the command modules and the core; errors propagate to
``main``, where they are rendered once (``PvegpuError.show``; with ``--json`` also a ``pvegpu-error`` document).
``pvegpu hook VMID PHASE`` is no command line but PVE's call of the guard: ``__main__`` hands it to ``pvegpu.cli.hook``
without coming here; ``pvegpu hook --help`` documents it.

Help is click's plain help (one style), at most 80 columns, with no type names: a value's name says what it is.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from typing import Any

import typer
from typer._click import exceptions as click_exc
from typer._click.utils import PacifyFlushWrapper
from typer.core import TyperCommand, TyperGroup

from pvegpu import __version__, wiring
from pvegpu.adapters.override import allow_once
from pvegpu.audit.run import audit_document, audit_once
from pvegpu.cli import audit as auditcmd
from pvegpu.cli import hook
from pvegpu.cli import install as ins
from pvegpu.core import contract
from pvegpu.core import errors as E
from pvegpu.core.locate import check_vmid, find_guest
from pvegpu.core.safetext import escape
from pvegpu.core.settings import ResetSettings
from pvegpu.core.textfit import said

# Each command imports its own modules (reset, gpu-reset, the simulated node) in its body: `pvegpu audit`, run every
# minute by monitoring, pays for no other command's.

_R = ResetSettings()
WIDTH = 80  # help fits an 80-column terminal (a narrower one gets narrower help)
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": WIDTH}


def _arg_name(p: Any) -> str:
    """An argument as help shows it: ``VMID``, ``[VMID]...``; never its type."""
    name = str(p.metavar or p.name.upper())
    return (name if p.required else f"[{name}]") + ("..." if p.nargs != 1 else "")


def _format_params(cmd: Any, ctx: Any, formatter: Any) -> None:
    """Arguments and options, each with its help only: a value's name (``SECONDS``, ``FILE``) says what it is."""
    args, opts = [], []
    for p in cmd.get_params(ctx):
        if p.hidden:
            continue
        if p.param_type_name == "argument":
            args.append((_arg_name(p), p.help or ""))
        elif (rec := p.get_help_record(ctx)) is not None:
            opts.append(rec)
    for title, rows in (("Arguments", args), ("Options", opts)):
        if rows:
            with formatter.section(title):
                formatter.write_dl(rows)


def _help_option(opt: Any) -> Any:
    if opt is not None:
        opt.help = "show this help and exit"  # in the words of every other option's help
    return opt


class _Command(TyperCommand):
    """Help as admins read it: ``pvegpu reset [OPTIONS] VMID``, arguments and options without types."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return ["[OPTIONS]"] * any(p.param_type_name == "option" for p in self.get_params(ctx)) + [
            _arg_name(p) for p in self.get_params(ctx) if p.param_type_name == "argument"]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_params(self, ctx, formatter)

    def get_help_option(self, ctx: Any) -> Any:
        return _help_option(super().get_help_option(ctx))


class _Group(TyperGroup):
    def get_help_option(self, ctx: Any) -> Any:
        return _help_option(super().get_help_option(ctx))

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # before a command's own handlers: typer would make it a silent exit 130
            raise E.SignalledError("interrupted", None, 130) from None

    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_params(self, ctx, formatter)
        self.format_commands(ctx, formatter)


class _HookGroup(_Group):
    """``pvegpu hook``: its subcommands, and a word that is none of them (a VMID: PVE's ``hook VMID PHASE`` reaches
    ``pvegpu.cli.hook`` straight from ``__main__``, so here it came with options): help, or what to do instead."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            if any(a in ctx.help_option_names for a in args):
                typer.echo(ctx.get_help())
                ctx.exit(0)
            if args[0][:1].isdigit():  # as __main__.is_hook_call tells PVE's call
                raise E.UsageError("`pvegpu hook VMID PHASE` is how PVE runs the guard: it takes no options", hook.HOOK_HINT)
        return super().resolve_command(ctx, args)


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings=CONTEXT,
                  help="Verified GPU reclaim, start gate and audit for Proxmox VE LXC containers and VMs.\n\n"
                       "Global options stand before the command: `pvegpu --simulate DIR check 129`.")
hook_app = typer.Typer(cls=_HookGroup, no_args_is_help=True, rich_markup_mode=None, context_settings=CONTEXT,
                       help="The start gate. PVE runs the guard as `pvegpu hook VMID PHASE`, with no options (settings: "
                            "PVEGPU_CONFIG or /etc/pvegpu/pvegpu.toml). PHASE is one of: pre-start (exit 10 refuses the "
                            "start), post-start, pre-stop, post-stop. Manage the guard with install, uninstall, status and "
                            "allow-once.")
sim_app = typer.Typer(cls=_Group, no_args_is_help=True, rich_markup_mode=None, context_settings=CONTEXT,
                      help="A lasting simulated node: `pvegpu sim create DIR`, then `pvegpu --simulate DIR COMMAND`, "
                           "then `pvegpu sim remove DIR`.")
app.add_typer(hook_app, name="hook")
app.add_typer(sim_app, name="sim")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pvegpu {__version__}")
        raise typer.Exit(0)


@app.callback()
def _global(
    ctx: typer.Context,
    config: str | None = typer.Option(None, "--config", metavar="FILE",
                                      help="settings file (default /etc/pvegpu/pvegpu.toml, or PVEGPU_CONFIG)"),
    simulate: str | None = typer.Option(None, "--simulate", metavar="DIR",
                                        help="act on the simulated node in DIR (`pvegpu sim create DIR`), never this node"),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_version, help="print the version and exit"),
) -> None:
    """The global options, kept for every command (``_opts``)."""
    ctx.obj = wiring.GlobalOptions(config, simulate)


def _opts(ctx: typer.Context) -> wiring.GlobalOptions:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, wiring.GlobalOptions) else wiring.GlobalOptions()


def _echo_json(data: Any) -> None:
    typer.echo(contract.dumps(data))


# -- reset, check, audit ------------------------------------------------------------------------------------


@app.command("reset", cls=_Command)
def reset_cmd(
    ctx: typer.Context,
    vmid: str = typer.Argument(..., metavar="VMID", help="container id, e.g. 129, or a VM's (reset inside the guest)",
                               show_default=False),
    dry_run: bool = typer.Option(False, "--dry-run", help="show what would be signalled and why; signal nothing"),
    no_restart: bool = typer.Option(False, "--no-restart", help="never restart the container through the API"),
    timeout: float | None = typer.Option(None, "--timeout", metavar="SECONDS",
                                         help=f"wait for the memory to come back (reset.timeout, default {_R.timeout:g})"),
    grace: float | None = typer.Option(None, "--grace", metavar="SECONDS",
                                       help=f"between SIGTERM and SIGKILL (reset.grace, default {_R.grace:g})"),
    settle: float | None = typer.Option(None, "--settle", metavar="SECONDS",
                                        help=f"clean must hold this long (reset.settle, default {_R.settle:g})"),
    json_out: bool = typer.Option(False, "--json", help="print the report as JSON (with -v, every event as a JSON line on stderr)"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="log every event (structlog)"),
) -> None:
    """Stop every process of the container that holds its GPUs, verify with NVML that the memory is back, and
    restart the container through the API if it is not. A VM: the same inside the guest, through its guest agent."""
    from pvegpu.cli.reset import do_reset  # its command's own (see above)

    s = wiring.settings(_opts(ctx), {"reset.restart": False if no_restart else None, "reset.timeout": timeout,
                                     "reset.grace": grace, "reset.settle": settle})
    raise typer.Exit(do_reset(s, check_vmid(vmid), dry_run=dry_run, json_out=json_out, verbose=verbose))


@app.command("gpu-reset", cls=_Command)
def gpu_reset_cmd(
    ctx: typer.Context,
    gpu: str = typer.Argument(..., metavar="N", help="the GPU: index, minor (/dev/nvidiaN), UUID or PCI bus id", show_default=False),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the plan (guests, processes, refusals); stop nothing"),
    yes: bool = typer.Option(False, "--yes", help="do not ask (needed without a terminal)"),
    json_out: bool = typer.Option(False, "--json", help="print the report as JSON (schema pvegpu-gpu-reset)"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="log every event (structlog)"),
) -> None:
    """Reset one GPU (`nvidia-smi -r`) as a verified procedure: stop the containers on it, reset, verify with NVML,
    start them again through the gate. docs/gpu-reset.md."""
    from pvegpu.cli.gpureset import do_gpu_reset  # its command's own (see above)

    raise typer.Exit(do_gpu_reset(wiring.settings(_opts(ctx)), gpu, dry_run=dry_run, yes=yes, json_out=json_out, verbose=verbose))


@app.command("check", cls=_Command)
def check_cmd(
    ctx: typer.Context,
    vmid: str = typer.Argument(..., metavar="VMID", help="container (or VM) id, e.g. 129", show_default=False),
    json_out: bool = typer.Option(False, "--json", help="print the decision as JSON (errors too)"),
    wide: bool = typer.Option(False, "--wide", "-v", "--verbose", help="the decision as one line, as the task log shows it"),
) -> None:
    """May the guest start now? The start gate's decision, exactly as the hookscript makes it: exit 0 yes (or it
    runs: no start to decide, what it holds is printed), 10 refused (the reason and the fix are printed), 5 a GPU
    of a running CT cannot be read."""
    raise typer.Exit(hook.check(vmid, _opts(ctx), json_out=json_out, wide=wide, out=sys.stdout, err=sys.stderr))


@app.command("audit", cls=_Command)
def audit_cmd(
    ctx: typer.Context,
    cluster: bool = typer.Option(False, "--cluster", help="every node: this one, and each other online member's own audit over root SSH"),
    json_out: bool = typer.Option(False, "--json", help="the versioned JSON document (schema pvegpu-audit, version 1)"),
    prometheus: str | None = typer.Option(None, "--prometheus", metavar="FILE",
                                          help="also write a node_exporter textfile (atomically), e.g. "
                                               "/var/lib/prometheus/node-exporter/pvegpu.prom"),
    ssh_timeout: float = typer.Option(30.0, "--ssh-timeout", metavar="SECONDS", show_default=False,
                                      help="--cluster: how long to wait for each other node's answer (default 30)"),
    ssh_option: list[str] = typer.Option([], "--ssh-option", hidden=True, help="extra ssh argument (tests: port, key, known hosts)"),
    wide: bool = typer.Option(False, "--wide", "-v", "--verbose", help="one line per item with every detail (whole command lines)"),
) -> None:
    """Which guest holds which GPU, right now and by configuration; exit 8 when something needs attention."""
    raise typer.Exit(auditcmd.run(_opts(ctx), cluster=cluster, json_out=json_out, prometheus=prometheus, ssh_timeout=ssh_timeout,
                                  ssh_options=ssh_option, wide=wide))


# -- demo ---------------------------------------------------------------------------------------------------


def _audit_table(s: Any) -> str:
    from pvegpu.cli.render import audit_text  # its command's own (see above)

    p = wiring.world(s).audit_ports()
    rep = audit_once(p.open_probe, pve=p.pve, host=p.host, files=p.files, threshold_bytes=p.threshold_bytes, clock=p.clock, users=p.users, kernlog=p.kernlog)
    return audit_text(audit_document([rep], clock=p.clock))


class _Terminated(Exception):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


@app.command("demo", cls=_Command)
def demo_cmd(
    ctx: typer.Context,
    scenario: str = typer.Option("demo", "--scenario", metavar="NAME", show_default=False,
                                 help="a built-in scenario (demo (default), idle, leak, app, tp8, health) or a scenario JSON file; "
                                      "the default also shows tp8 and health after it"),
    grace: float = typer.Option(1.0, "--grace", metavar="SECONDS", show_default=False,
                                help="SIGTERM grace in the demo (default 1: short, so the demo is quick)"),
) -> None:
    """Run the real reset code against a built-in simulated node: no Proxmox, GPU or root needed."""
    from pvegpu.sim import scenario as sc  # its command's own (see above)

    data = sc.named(scenario)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)  # a killed demo still takes its workloads with it
    results: list[str] = []
    code = 0
    try:
        if data is sc.HEALTH:
            code = _demo_node(ctx, data, grace, results, [], audit_after=False, health=True)
        else:
            code = _demo_node(ctx, data, grace, results, _demo_targets(data), audit_after=True)
        if scenario == "demo" and code < 128:  # then the multi-GPU incident: a TP=8 job, one rank's fork child on GPU 1
            code = max(code, _demo_node(ctx, sc.TP8, grace, results, [129], audit_after=False))
        if scenario == "demo" and code < 128:  # then a GPU that needs a reset: the gate refuses, gpu-reset, the gate allows
            code = max(code, _demo_node(ctx, sc.HEALTH, grace, results, [], audit_after=False, health=True))
    except (_Terminated, E.SignalledError) as exc:  # a reset's own handlers turn SIGTERM into SignalledError
        typer.echo("demo: terminated; simulated containers stopped and removed", err=True)
        code = getattr(exc, "exit_code", 143)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code < 128:
        typer.echo("\n" + said(f"{', '.join(results) or 'nothing to reset'}; simulated node removed (exit {code})", "demo: ", "      "))
    raise typer.Exit(code)


def _demo_targets(data: dict[str, Any]) -> list[int]:
    """The containers the demo resets: each running one with workloads, but the last of three or more (a neighbour)."""
    targets = [int(c["vmid"]) for c in data.get("containers", []) if c.get("workloads") and c.get("status", "running") == "running"]
    return targets[:-1] if len(targets) > 2 else targets


def _demo_node(ctx: typer.Context, data: dict[str, Any], grace: float, results: list[str], targets: list[int], *,
               audit_after: bool, health: bool = False) -> int:
    """Build the node of ``data``, audit it, reset ``targets`` (a result each in ``results``), with ``health`` show the
    gate's refusal, a gpu-reset and the start allowed (``_demo_health``), remove it; the worst exit."""
    from pvegpu.cli.reset import do_reset  # its command's own (see above)
    from pvegpu.sim.lifecycle import create

    sim = None
    code = 0
    try:
        sim = create(None, data, (ins.GUARD, ins.guard_text(ins.template())))
        s = wiring.settings(wiring.GlobalOptions(_opts(ctx).config, sim.root), {"reset.grace": grace})
        gpus = len(data.get("gpus", []))
        typer.echo(said(f"Simulated node {sim.node} in {sim.root}: {f'{gpus} GPUs; ' if gpus > 1 else ''}containers are real "
                        "processes, NVML and the API are simulated.", rest="") + "\n")
        typer.echo("$ pvegpu audit")
        typer.echo(_audit_table(s))
        for vmid in targets:
            typer.echo(f"\n$ pvegpu reset {vmid}")
            rc = do_reset(s, vmid, dry_run=False, json_out=False, verbose=False)
            results.append(f"CT {vmid}{f' ({gpus} GPUs)' if gpus > 1 else ''} {'clean' if rc == 0 else f'exit {rc}'}")
            code = max(code, rc)
            if rc >= 128:  # interrupted by a signal (the reset finished what it had started): stop the demo
                return code
        if health:
            code = max(code, _demo_health(ctx, s, sim.root, data, results))
        if audit_after:
            typer.echo("\n$ pvegpu audit")
            typer.echo(_audit_table(s))
    finally:
        if sim is not None:
            sim.teardown()
    return code


def _demo_health(ctx: typer.Context, s: Any, root: str, data: dict[str, Any], results: list[str]) -> int:
    """On a node whose GPU 0 needs a reset: the gate refuses the stopped CT's start (exit 10, expected), `gpu-reset 0
    --yes` stops, resets, verifies and starts the running CTs, then the gate allows the start. The worst exit of the
    reset and the second check."""
    from pvegpu.cli.gpureset import do_gpu_reset  # its command's own (see above)

    vmid = next(int(c["vmid"]) for c in data["containers"] if c.get("status") == "stopped")
    opts = wiring.GlobalOptions(_opts(ctx).config, root)

    def check() -> int:
        typer.echo(f"\n$ pvegpu check {vmid}")
        sys.stdout.flush()  # check prints through print(); keep the order with typer's echo
        return hook.check(str(vmid), opts, json_out=False, wide=False, out=sys.stdout, err=sys.stderr)

    before = check()
    typer.echo("\n$ pvegpu gpu-reset 0 --yes")
    rc = do_gpu_reset(s, "0", dry_run=False, yes=True, json_out=False, verbose=False)
    after = check() if rc < 128 else rc
    results.append(f"CT {vmid}'s start {'refused' if before == E.EXIT_REFUSED else f'exit {before}'}, GPU 0 "
                   f"{'reset' if rc == 0 else f'exit {rc}'}, then {'allowed' if after == 0 else f'exit {after}'}")
    return max(rc, after)


# -- sim create | remove --------------------------------------------------------------------------------------


@sim_app.command("create", cls=_Command)
def sim_create(
    directory: str = typer.Argument(..., metavar="DIR", help="a new directory for the simulated node (made here, mode 700)",
                                    show_default=False),
    scenario: str = typer.Option("demo", "--scenario", metavar="NAME", show_default=False,
                                 help="a built-in scenario (demo (default), idle, leak, app, tp8, health) or a scenario JSON file"),
) -> None:
    """Build a simulated node in DIR and start its containers (real processes); no Proxmox, GPU or root needed."""
    from pvegpu.sim.lifecycle import create, created  # its command's own (see above)

    typer.echo(created(create(directory, scenario, (ins.GUARD, ins.guard_text(ins.template())))))


@sim_app.command("remove", cls=_Command)
def sim_remove(directory: str = typer.Argument(..., metavar="DIR", help="a simulated node made by `pvegpu sim create`",
                                               show_default=False)) -> None:
    """Stop a simulated node's containers and remove DIR."""
    from pvegpu.sim import scenario as sc  # its command's own (see above)

    if not (os.path.isfile(os.path.join(directory, "scenario.json")) and os.path.isfile(os.path.join(directory, "etc-pve", ".vmlist"))):
        raise E.UsageError(f"{directory} is not a simulated node (no scenario.json and etc-pve/.vmlist there): not removed",
                           "`pvegpu sim remove` removes only a directory `pvegpu sim create` made")
    sc.SimNode(directory).teardown()
    shutil.rmtree(directory)
    typer.echo(f"simulated node in {directory} stopped and removed")


# -- hook install | uninstall | status | allow-once --------------------------------------------------------


def _print_plan(plan: Any) -> None:
    """The install plan's lines; they carry storage paths and hookscript names from /etc/pve: escaped."""
    for line in plan.done:
        typer.echo(f"done: {escape(line)}")
    for line in plan.refused:
        typer.echo(f"refused: {escape(line)}", err=True)
    for line in plan.warnings:
        typer.echo(f"warning: {escape(line)}", err=True)


STORAGE = typer.Option("local", "--storage", metavar="NAME", help="snippets storage (default: local)", show_default=False)


@hook_app.command("install", cls=_Command)
def hook_install(
    ctx: typer.Context,
    vmids: list[str] = typer.Argument(None, metavar="VMID", help="containers to guard (default: every GPU container of this node)",
                                      show_default=False),
    storage: str = STORAGE,
    chain: bool = typer.Option(False, "--chain", help="keep an existing hookscript: run pvegpu's guard first, then it"),
) -> None:
    """Install the guard snippet and set it as the containers' hookscript (`pct set VMID --hookscript ...`)."""
    t = wiring.install_target(wiring.settings(_opts(ctx)), storage, need_root=True)
    plan = ins.install([check_vmid(v) for v in vmids or []], pve_root=t.pve_root, node=t.node, storage_name=storage, chain=chain,
                       lister=t.lister, run=t.run)
    _print_plan(plan)
    raise typer.Exit(0 if plan.ok else E.EXIT_AUDIT_ATTENTION)


@hook_app.command("uninstall", cls=_Command)
def hook_uninstall(
    ctx: typer.Context,
    vmids: list[str] = typer.Argument(None, metavar="VMID", show_default=False,
                                      help="containers to unguard (default: every guarded container of this node)"),
    storage: str = STORAGE,
) -> None:
    """Remove the guard from the containers (restoring a chained hookscript) and the snippet once unused."""
    t = wiring.install_target(wiring.settings(_opts(ctx)), storage, need_root=True)
    plan = ins.uninstall([check_vmid(v) for v in vmids or []], pve_root=t.pve_root, node=t.node, storage_name=storage, run=t.run)
    _print_plan(plan)
    raise typer.Exit(0 if plan.ok else E.EXIT_AUDIT_ATTENTION)


@hook_app.command("status", cls=_Command)
def hook_status(
    ctx: typer.Context,
    storage: str = STORAGE,
    json_out: bool = typer.Option(False, "--json", help="print the status as JSON"),
) -> None:
    """Guarded and unguarded GPU containers of this node, and nodes missing the snippet. Exit 8 if anything needs attention."""
    t = wiring.install_target(wiring.settings(_opts(ctx)), storage, need_root=False)
    st = ins.status(pve_root=t.pve_root, node=t.node, storage_name=storage, lister=t.lister)
    if json_out:
        _echo_json(contract.document("hook-status", st.to_json() | {"attention": not st.ok}))
    else:
        for row in st.containers:
            typer.echo(f"CT {row.vmid}: {row.state.value}" + (f" ({row.hookscript})" if row.hookscript else ""))
        for p in st.problems:
            typer.echo(f"problem: {p}")
        for n in st.notes:
            typer.echo(f"note: {n}")
    raise typer.Exit(0 if st.ok else E.EXIT_AUDIT_ATTENTION)


@hook_app.command("allow-once", cls=_Command)
def hook_allow_once(
    ctx: typer.Context,
    vmid: str = typer.Argument(..., metavar="VMID", help="guest to let through the gate at its next start", show_default=False),
) -> None:
    """Let the next start of a guest through the start gate once (token expires after gate.override_ttl)."""
    s = wiring.settings(_opts(ctx))
    n = check_vmid(vmid)
    pve = wiring.gate_pve(s)
    g = pve.where(n)
    if g is not None and g.type == "qemu":  # a VM's start is gated too (pvegpu/gate/vm.py)
        local = pve.local_node()
        if local is not None and g.node != local:
            raise E.NotFoundError(f"VM {n} lives on node {g.node}, this is {local}", f"run it there: `ssh {g.node} pvegpu hook allow-once {n}`")
    else:
        find_guest(n, pve)  # an unknown CT or one on another node: say so, write nothing
    try:
        path = allow_once(s.gate.override_dir, n).path
    except OSError as exc:
        raise E.UsageError(f"cannot write the override in {s.gate.override_dir}: {exc.strerror or exc}", "run as root on the node") from None
    typer.echo(f"the next start of {'VM' if g is not None and g.type == 'qemu' else 'CT'} {n} passes the gate once ({path}, valid {s.gate.override_ttl:g} s)")


# -- running it ---------------------------------------------------------------------------------------------


def _command(args: list[str]) -> str | None:
    """The command a line runs (``reset``, ``hook status``), for the error document: the words after the global options."""
    words: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a in ("--config", "--simulate") and not words:
            skip = True
        elif not a.startswith("-"):
            words.append(a)
    if not words:
        return None
    return " ".join(words[:2]) if words[0] in ("hook", "sim") and len(words) > 1 else words[0]


GLOBAL_OPTIONS = {"--config": " FILE", "--simulate": " DIR", "--version": ""}  # and their values' names


def _usage_error(exc: click_exc.ClickException) -> E.UsageError:
    """click's complaint as pvegpu's usage error: the bad word, a suggestion where click has one, and where help is."""
    ctx = getattr(exc, "ctx", None)
    where = f"see `{ctx.command_path} --help`" if ctx is not None else "see `pvegpu --help`"
    if isinstance(exc, click_exc.NoSuchOption):
        name = exc.option_name.partition("=")[0]
        if name in GLOBAL_OPTIONS:
            command = "" if name == "--version" or ctx is None else " " + ctx.command_path.partition(" ")[2] + " ..."
            return E.UsageError(f"{name} is a global option: it stands before the command",
                                f"`pvegpu {name}{GLOBAL_OPTIONS[name]}{command}`")
        if exc.possibilities:
            return E.UsageError(f"{exc.message} (Did you mean {' or '.join(sorted(exc.possibilities))}?)", where)
    elif isinstance(exc, click_exc.BadOptionUsage) and exc.option_name in GLOBAL_OPTIONS:  # `pvegpu --simulate` alone
        return E.UsageError(exc.format_message(), f"e.g. `pvegpu {exc.option_name}{GLOBAL_OPTIONS[exc.option_name]} check 129`; {where[4:]}")
    return E.UsageError(exc.format_message(), where)


def main(args: list[str]) -> int:
    """Run the typer app on ``args``; every error is rendered once, here (``--json``: also a pvegpu-error document)."""
    json_out = "--json" in args
    try:
        return int(app(args=args, prog_name="pvegpu", standalone_mode=False) or 0)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except click_exc.NoArgsIsHelpError as exc:  # `pvegpu`, `pvegpu hook`, `pvegpu sim` alone: the help, as click shows it
        exc.show()
        return int(exc.exit_code)
    except click_exc.ClickException as exc:  # a bad line; with --json its consumer still gets a pvegpu-error document
        return _fail(_usage_error(exc), args, json_out)
    except SystemExit as exc:  # typer turns a closed stdout pipe (`pvegpu demo | head -1`) into a quiet exit 1
        if isinstance(sys.stdout, PacifyFlushWrapper):
            return 141  # as a shell reports a writer that SIGPIPE ended; nothing more to say
        raise exc
    except E.PvegpuError as exc:  # the JSON consumer gets JSON; the person watching still gets the message
        return _fail(exc, args, json_out)
    except Exception as exc:  # noqa: BLE001 - one line (and the JSON document), not a traceback
        if os.environ.get("PVEGPU_DEBUG") == "1":
            raise
        return _fail(E.internal(exc), args, json_out)


def _fail(err: E.PvegpuError, args: list[str], json_out: bool) -> int:
    if json_out:
        _echo_json(contract.error_document(err, _command(args)))
    return err.show(sys.stderr)
