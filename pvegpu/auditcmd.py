"""``pvegpu audit``: its one option table, the light parser the front door uses, and the audit entry point.

As ``pvegpu reset`` (``resetcmd``), ``pvegpu audit`` does not pay for typer (pydantic, rich: ~110 ms, as long as
the scan of a node of 2,000 processes): the front door parses its arguments here, from ``OPTIONS``, the one table
that also builds the typer command (``cli.audit_cmd``), so ``pvegpu audit --help`` and this parser cannot
disagree. Anything this parser is not sure of (``--help``, an unknown option, a missing or bad value, a value that
starts with ``-`` given as the next word, ``--``, any word) goes to typer, which says what is wrong exactly as
before. Both ways end in ``run``, with the same output and exit codes.
"""

from __future__ import annotations

import sys

from . import errors as E
from . import wiring
from .record import record

TYPE_CHECKING = False  # typing is not imported at run time
if TYPE_CHECKING:
    from typing import Any


@record(frozen=True)
class Opt:
    """One option of ``pvegpu audit``: a flag, a number of seconds, a text, or a text that may be repeated."""

    dest: str  # the parameter's name (typer) and the key of ``parse``'s answer
    decls: tuple[str, ...]  # as typed: "--json", or ("--wide", "-v", "--verbose")
    help: str
    kind: str = "flag"  # flag | seconds | text | texts (repeatable)
    metavar: str = ""
    default: Any = None  # flags: False; texts: an empty list (a fresh one per parse)
    hidden: bool = False


OPTIONS = (
    Opt("cluster", ("--cluster",), "every node: this one, and each other online member's own audit over root SSH", default=False),
    Opt("json_out", ("--json",), "the versioned JSON document (schema pvegpu-audit, version 1)", default=False),
    Opt("prometheus", ("--prometheus",), "also write a node_exporter textfile (atomically), e.g. "
        "/var/lib/prometheus/node-exporter/pvegpu.prom", "text", "FILE"),
    Opt("ssh_timeout", ("--ssh-timeout",), "--cluster: how long to wait for each other node's answer", "seconds", "SECONDS", 30.0),
    Opt("ssh_option", ("--ssh-option",), "extra ssh argument (tests: port, key, known hosts)", "texts", hidden=True),
    Opt("wide", ("--wide", "-v", "--verbose"), "one line per item with every detail (whole command lines), not 80 columns",
        default=False),
)
HELP = "Which guest holds which GPU, right now and by configuration; exit 8 when something needs attention."


def defaults() -> dict[str, Any]:
    """Every option's value when not given (what typer passes for it)."""
    return {o.dest: ([] if o.kind == "texts" else o.default) for o in OPTIONS}


def parse(args: list[str]) -> dict[str, Any] | None:
    """``audit``'s arguments as ``{dest: value}``, or None when this parser is not sure (help, an unknown option, a
    flag given a value, a bad or missing value, ``--``, any positional word): typer decides."""
    from .lightargs import scan

    got = scan(args, {d: o for o in OPTIONS for d in o.decls})
    if got is None or got[1]:
        return None  # audit takes no argument: typer says so
    values = defaults()
    for opt, text in got[0]:
        if text is None:
            values[opt.dest] = True
        elif opt.kind == "seconds":
            try:
                values[opt.dest] = float(text)  # what click's FLOAT does; run() then checks the range
            except ValueError:
                return None
        elif opt.kind == "texts":
            values[opt.dest].append(text)
        else:
            values[opt.dest] = text
    return values


def run(values: dict[str, Any], opts: wiring.GlobalOptions) -> int:
    """``pvegpu audit`` with parsed arguments: the one entry point of the typer command and of the light path.
    This node's whole-node scan starts first (``wiring.scan_ahead``): everything else is read while it runs."""
    wiring.scan_ahead(opts)
    try:
        return _run(values, opts)
    finally:
        wiring.end_scan_ahead()


def _run(values: dict[str, Any], opts: wiring.GlobalOptions) -> int:

    from . import contract
    from .audit import audit_document, audit_once

    cluster, prometheus, ssh_timeout = bool(values["cluster"]), values["prometheus"], float(values["ssh_timeout"])
    if ssh_timeout <= 0:
        raise E.UsageError(f"--ssh-timeout {ssh_timeout:g}: must be more than 0 seconds", "e.g. --ssh-timeout 30")
    s = wiring.settings(opts)
    ports = wiring.world(s).audit_ports(scan_ahead=True)
    try:
        rep = audit_once(ports.open_probe, pve=ports.pve, host=ports.host, files=ports.files, cluster=cluster,
                         threshold_bytes=ports.threshold_bytes, clock=ports.clock, users=ports.users)
    finally:
        ports.done()
    if cluster:
        from .cluster import audit_cluster, parse_members

        members = parse_members(ports.files.read_pve(".members"))
        doc = audit_document(audit_cluster(rep, members, wiring.cluster_audits(ssh_timeout, list(values["ssh_option"]))),
                             clock=ports.clock)
    else:
        doc = audit_document([rep], clock=ports.clock)
    if prometheus:
        wiring.write_textfile(prometheus, doc)
    if values["json_out"]:
        _out(contract.dumps(contract.document("audit", doc)))
    elif not prometheus:
        from .render_audit import audit_table  # render.audit_text without render's reset imports

        _out(audit_table(doc, bool(values["wide"])))
    else:
        _out(f"{prometheus}: {len(rep.gpus)} GPU(s), {sum(f.kind.attention for f in rep.flags)} finding(s) needing attention")
    return E.EXIT_AUDIT_ATTENTION if doc["attention"] else E.EXIT_OK


def main(args: list[str], opts: wiring.GlobalOptions) -> int | None:
    """The front door's ``audit``: the exit code, or None to let typer handle the line (help, an error in it)."""
    values = parse(args)
    if values is None:
        return None
    try:
        return run(values, opts)
    except E.PvegpuError as exc:  # as cli.run: the JSON consumer gets JSON; the person watching still gets the message
        if values["json_out"]:
            import json

            from . import contract

            _out(json.dumps(contract.error_document(exc, "audit"), indent=2, default=str))
        return exc.show(sys.stderr)


def _out(text: str) -> None:
    """One text on stdout, flushed, as ``typer.echo`` writes it (a closed pipe propagates: the front door exits 141)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
