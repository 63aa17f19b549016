"""The ``pvegpu`` command line (typer). Thin: builds ports, calls the core, renders, maps exit codes."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from . import errors as E
from .audit import audit as run_audit
from .locate import check_vmid
from .model import MIB
from .reclaim import Ports, ResetPolicy, reset
from .render import audit_text, reset_json, reset_table
from .settings import Settings, load

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Verified GPU reclaim, start gate and audit for Proxmox VE LXC containers.")
hook_app = typer.Typer(no_args_is_help=True, help="The start-gate hookscript: `pvegpu hook VMID PHASE` (as PVE calls it), install, uninstall, status.")
app.add_typer(hook_app, name="hook")

_STATE: dict[str, Any] = {}


def _settings(overrides: dict[str, Any] | None = None) -> Settings:
    return load(_STATE.get("config"), overrides=(overrides or {}) | ({"simulate": _STATE["simulate"]} if _STATE.get("simulate") else {}))


def _fail(exc: E.PvegpuError) -> None:
    typer.echo(f"Error: {exc.message}", err=True)
    if exc.hint:
        typer.echo(f"Hint: {exc.hint}", err=True)
    raise typer.Exit(exc.exit_code)


@app.callback()
def _main(
    config: str | None = typer.Option(None, "--config", help="settings file (default /etc/pvegpu/pvegpu.toml)"),
    simulate: str | None = typer.Option(None, "--simulate", help="run against a simulated node's state directory", hidden=True),
) -> None:
    _STATE.update(config=config, simulate=simulate)


def _ports(s: Settings, need_api: bool = True) -> tuple[Any, Any, Any, Any]:
    from .adapters.factory import build_clock, build_host, build_probe, build_pve

    return build_pve(s, need_api), build_probe(s), build_host(s), build_clock()


def do_reset(s: Settings, vmid: int, *, dry_run: bool, json_out: bool, verbose: bool) -> int:
    from .logs import configure

    log = configure(verbose=verbose, json_lines=json_out)
    pve, probe, host, clock = _ports(s, need_api=not dry_run)
    r = s.reset
    policy = ResetPolicy(grace=r.grace, kill_wait=r.kill_wait, timeout=r.timeout, poll=r.poll, settle=r.settle, rounds=r.rounds,
                         threshold_bytes=r.threshold_mib * MIB, restart=r.restart, dry_run=dry_run, task_timeout=r.task_timeout)
    on_step = None if json_out else (lambda st: typer.echo(f"[{st.name}] {st.detail.get('msg', st.outcome)}"))
    report = reset(vmid, Ports(pve, probe, host, clock, log), policy, on_step)
    if json_out:
        typer.echo(json.dumps(reset_json(report), indent=2))
        return report.exit_code
    typer.echo("")
    typer.echo(reset_table(report))
    for p in report.plan:
        typer.echo(f"  would: pid {p['pid']} ({p['comm']}, CT pid {p['ns_pid']}, {p['cgroup']}): {p['action']}")
    for note in report.notes:
        typer.echo(f"note: {note}")
    verdict = {"clean": f"CT {vmid}: GPU memory verified free in {report.elapsed:.2f} s" + (" (after a restart)" if report.restarted else ""),
               "dry-run": f"CT {vmid}: dry run, nothing was signalled"}.get(report.outcome, f"CT {vmid}: {report.outcome} after {report.elapsed:.2f} s")
    typer.echo(verdict)
    for problem, action in report.diagnosis:
        typer.echo(f"  problem: {problem}\n     what to do: {action}")
    if report.left_stopped:
        typer.echo(f"  CT {vmid} was left STOPPED; start it with `pct start {vmid}` once the GPU is clean.")
    return report.exit_code


@app.command("reset")
def reset_cmd(
    vmid: str = typer.Argument(..., help="container id, e.g. 129"),
    dry_run: bool = typer.Option(False, "--dry-run", help="show what would be signalled and why; signal nothing"),
    no_restart: bool = typer.Option(False, "--no-restart", help="never restart the container through the API"),
    timeout: float | None = typer.Option(None, "--timeout", help="seconds to wait for the memory to come back (default 30)"),
    grace: float | None = typer.Option(None, "--grace", help="seconds between SIGTERM and SIGKILL (default 10)"),
    json_out: bool = typer.Option(False, "--json", help="print the report as JSON (events as JSON lines on stderr)"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="log every event"),
) -> None:
    """Stop every process of the container that holds its GPUs, verify with NVML that the memory is back,
    and restart the container through the API if it is not."""
    try:
        s = _settings({"reset.timeout": timeout, "reset.grace": grace, "reset.restart": False if no_restart else None})
        code = do_reset(s, check_vmid(vmid), dry_run=dry_run, json_out=json_out, verbose=verbose)
    except E.PvegpuError as exc:
        _fail(exc)
    raise typer.Exit(code)


@app.command("check")
def check_cmd(vmid: str = typer.Argument(...), json_out: bool = typer.Option(False, "--json")) -> None:
    """May the container start now? Exit 0 yes, 10 refused (same decision as the hookscript)."""
    from .hook import main_fast

    raise typer.Exit(main_fast(["check", vmid] + (["--json"] if json_out else [])))


@app.command("audit")
def audit_cmd(
    cluster: bool = typer.Option(False, "--cluster", help="every node: this one, and each other online member's own audit over root SSH"),
    json_out: bool = typer.Option(False, "--json", help="the versioned JSON document (schema pvegpu-audit, version 1)"),
    prometheus: str | None = typer.Option(None, "--prometheus", metavar="FILE",
                                          help="also write a node_exporter textfile (atomically), e.g. /var/lib/prometheus/node-exporter/pvegpu.prom"),
    ssh_timeout: float = typer.Option(30.0, "--ssh-timeout", help="--cluster: seconds to wait for each other node's answer"),
    ssh_option: list[str] = typer.Option([], "--ssh-option", hidden=True, help="extra ssh argument (tests: port, key, known hosts)"),
) -> None:
    """Which guest holds which GPU, right now and by configuration; exit 8 when something needs attention."""
    from .audit import audit_document, audit_once
    from .model import MIB

    try:
        s = _settings()
        from .adapters.factory import build_host, build_probe, build_pve
        from .adapters.nodefiles import LocalNodeFiles

        files = LocalNodeFiles(s.pve_root)
        if s.simulate:
            from .sim.nodefiles import SimNodeFiles

            files = SimNodeFiles(s.simulate)
        rep = audit_once(lambda: build_probe(s), pve=build_pve(s, cluster), host=build_host(s), files=files, cluster=cluster,
                         threshold_bytes=s.gate.threshold_mib * MIB)
        if cluster:
            from .adapters.ssh import SshAudits
            from .cluster import audit_cluster, parse_members

            if ssh_timeout <= 0:
                raise E.UsageError(f"--ssh-timeout {ssh_timeout:g}: must be more than 0 seconds", "e.g. --ssh-timeout 30")
            members = parse_members(files.read_pve(".members"))
            doc = audit_document(audit_cluster(rep, members, SshAudits(timeout=ssh_timeout, options=ssh_option)))
        else:
            doc = audit_document([rep])
        if prometheus:
            from .prom import write_textfile

            write_textfile(prometheus, doc)
    except E.PvegpuError as exc:
        _fail(exc)
    if json_out:
        typer.echo(json.dumps(doc, indent=2))
    elif not prometheus:
        typer.echo(audit_text(doc))
    else:
        typer.echo(f"{prometheus}: {len(rep.gpus)} GPU(s), {sum(f.kind.attention for f in rep.flags)} finding(s) needing attention")
    raise typer.Exit(E.EXIT_AUDIT_ATTENTION if doc["attention"] else E.EXIT_OK)


@app.command("demo")
def demo_cmd(
    scenario: str | None = typer.Option(None, "--scenario", help="a scenario JSON file (default: the built-in one)"),
    grace: float = typer.Option(1.0, "--grace", help="SIGTERM grace in the demo (short, so the demo is quick)"),
) -> None:
    """Run the real reset code against a built-in simulated node: no Proxmox, GPU or root needed."""
    from .sim import scenario as sc

    try:
        data = sc.load(scenario) if scenario else sc.DEMO
        sim = sc.build(data)
    except E.PvegpuError as exc:
        _fail(exc)
    code = 0
    try:
        _STATE["simulate"] = sim.root
        s = _settings({"reset.grace": grace})
        typer.echo(f"Simulated node {sim.node} in {sim.root}: containers are real processes, NVML and the API are simulated.\n")
        typer.echo("$ pvegpu audit")
        pve, probe, host, _ = _ports(s)
        typer.echo(audit_text(run_audit(pve=pve, probe=probe, host=host).to_json()))
        targets = [int(c["vmid"]) for c in data.get("containers", []) if c.get("workloads") and c.get("status", "running") == "running"]
        for vmid in targets[:-1] if len(targets) > 2 else targets:
            typer.echo(f"\n$ pvegpu reset {vmid}")
            code = max(code, do_reset(s, vmid, dry_run=False, json_out=False, verbose=False))
        typer.echo("\n$ pvegpu audit")
        typer.echo(audit_text(run_audit(pve=pve, probe=probe, host=host).to_json()))
    except E.PvegpuError as exc:
        sim.teardown()
        _fail(exc)
    finally:
        sim.teardown()
    raise typer.Exit(code)


def _install_ctx(need_root: bool) -> tuple[Settings, str, Any]:
    import os

    from .adapters.etcpve import EtcPve

    s = _settings()
    if need_root and os.geteuid() != 0:
        raise E.UsageError("installing the guard needs root on the node", "`pct set --hookscript` is allowed for root@pam only; use sudo")
    if not EtcPve.present(s.pve_root):
        raise E.UsageError(f"{s.pve_root}/.vmlist not found: not a Proxmox VE node", "run it on the node that runs the containers")
    node = EtcPve(s.pve_root, node=s.node).local_node() or ""
    lister: Any = None
    try:
        from .adapters.factory import resolve_backend
        from .adapters.pve import ProxmoxerPve, connect

        backend = resolve_backend(s)
        if backend:
            api = ProxmoxerPve(connect(s.api, backend), node=node)

            def _list(n: str, _api: Any = api) -> set[str] | None:
                try:
                    return set(_api.snippets(n, _STATE.get("storage", "local")))
                except E.PvegpuError:
                    return None

            lister = _list
    except E.PvegpuError:
        lister = None
    return s, node, lister


def _print_plan(plan: Any) -> None:
    for line in plan.done:
        typer.echo(f"done: {line}")
    for line in plan.refused:
        typer.echo(f"refused: {line}", err=True)
    for line in plan.warnings:
        typer.echo(f"warning: {line}", err=True)


@hook_app.command("install")
def hook_install(
    vmids: list[str] = typer.Argument(None, help="containers to guard (default: every GPU container of this node)"),
    storage: str = typer.Option("local", "--storage", help="snippets storage"),
    chain: bool = typer.Option(False, "--chain", help="keep an existing hookscript: run pvegpu's guard first, then it"),
) -> None:
    """Install the guard snippet and set it as the containers' hookscript (`pct set VMID --hookscript ...`)."""
    from . import install as ins

    try:
        _STATE["storage"] = storage
        s, node, lister = _install_ctx(need_root=True)
        plan = ins.install([check_vmid(v) for v in vmids or []], pve_root=s.pve_root, node=node, storage_name=storage,
                           chain=chain, lister=lister)
    except E.PvegpuError as exc:
        _fail(exc)
    _print_plan(plan)
    raise typer.Exit(0 if plan.ok else 1)


@hook_app.command("uninstall")
def hook_uninstall(
    vmids: list[str] = typer.Argument(None, help="containers to unguard (default: every guarded container of this node)"),
    storage: str = typer.Option("local", "--storage"),
) -> None:
    """Remove the guard from the containers (restoring a chained hookscript) and the snippet once unused."""
    from . import install as ins

    try:
        s, node, _ = _install_ctx(need_root=True)
        plan = ins.uninstall([check_vmid(v) for v in vmids or []], pve_root=s.pve_root, node=node, storage_name=storage)
    except E.PvegpuError as exc:
        _fail(exc)
    _print_plan(plan)
    raise typer.Exit(0 if plan.ok else 1)


@hook_app.command("status")
def hook_status(storage: str = typer.Option("local", "--storage"), json_out: bool = typer.Option(False, "--json")) -> None:
    """Guarded and unguarded GPU containers of this node, and nodes missing the snippet. Exit 1 if anything needs attention."""
    from . import install as ins

    try:
        _STATE["storage"] = storage
        s, node, lister = _install_ctx(need_root=False)
        st = ins.status(pve_root=s.pve_root, node=node, storage_name=storage, lister=lister)
    except E.PvegpuError as exc:
        _fail(exc)
    if json_out:
        typer.echo(json.dumps(st, indent=2))
    else:
        for row in st["containers"]:  # type: ignore[attr-defined]
            typer.echo(f"CT {row['vmid']}: {row['state']}" + (f" ({row['hookscript']})" if row["hookscript"] else ""))
        for p in st["problems"]:  # type: ignore[attr-defined]
            typer.echo(f"problem: {p}")
    bad = st["problems"] or any(r["state"] != "guarded" for r in st["containers"])  # type: ignore[attr-defined]
    raise typer.Exit(1 if bad else 0)


@hook_app.command("allow-once")
def hook_allow_once(vmid: str = typer.Argument(..., help="container to let through the gate at its next start")) -> None:
    """Let the next start of a container through the start gate once (token expires after gate.override_ttl)."""
    from .hook import allow_once

    try:
        s = _settings()
        path = allow_once(check_vmid(vmid), s)
    except E.PvegpuError as exc:
        _fail(exc)
    except OSError as exc:
        _fail(E.UsageError(f"cannot write the override: {exc}", "run as root on the node"))
    typer.echo(f"the next start of CT {vmid} passes the gate once ({path}, valid {s.gate.override_ttl:g} s)")


def run() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
