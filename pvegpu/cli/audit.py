"""``pvegpu audit``'s run: this node's audit (or the cluster's), then the table, the JSON document or the
Prometheus textfile. Its command line is parsed by typer (``cli.audit_cmd``), which calls ``run``.
"""

from __future__ import annotations

import sys

from pvegpu import wiring
from pvegpu.audit.cluster import audit_cluster, parse_members
from pvegpu.audit.render import audit_table
from pvegpu.audit.run import audit_document, audit_once
from pvegpu.core import contract
from pvegpu.core import errors as E


def run(opts: wiring.GlobalOptions, *, cluster: bool = False, json_out: bool = False, prometheus: str | None = None,
        ssh_timeout: float = 30.0, ssh_options: list[str] | None = None, wide: bool = False) -> int:
    """``pvegpu audit``. This node's whole-node scan starts first (``wiring.scan_ahead``): everything else is read
    while it runs."""
    wiring.scan_ahead(opts)
    try:
        return _run(opts, cluster, json_out, prometheus, ssh_timeout, list(ssh_options or []), wide)
    finally:
        wiring.end_scan_ahead()


def _run(opts: wiring.GlobalOptions, cluster: bool, json_out: bool, prometheus: str | None, ssh_timeout: float,
         ssh_options: list[str], wide: bool) -> int:
    if ssh_timeout <= 0:
        raise E.UsageError(f"--ssh-timeout {ssh_timeout:g}: must be more than 0 seconds", "e.g. --ssh-timeout 30")
    s = wiring.settings(opts)
    ports = wiring.world(s).audit_ports(scan_ahead=True)
    try:
        rep = audit_once(ports.open_probe, pve=ports.pve, host=ports.host, files=ports.files, cluster=cluster,
                         threshold_bytes=ports.threshold_bytes, clock=ports.clock, users=ports.users, kernlog=ports.kernlog)
    finally:
        ports.done()
    if cluster:
        members = parse_members(ports.files.read_pve(".members"))
        doc = audit_document(audit_cluster(rep, members, wiring.cluster_audits(ssh_timeout, ssh_options)), clock=ports.clock)
    else:
        doc = audit_document([rep], clock=ports.clock)
    if prometheus:
        wiring.write_textfile(prometheus, doc)
    if json_out:
        _out(contract.dumps(contract.document("audit", doc)))
    elif not prometheus:
        _out(audit_table(doc, wide))
    else:
        _out(f"{prometheus}: {len(rep.gpus)} GPU(s), {sum(f.kind.attention for f in rep.flags)} finding(s) needing attention")
    return E.EXIT_AUDIT_ATTENTION if doc["attention"] else E.EXIT_OK


def _out(text: str) -> None:
    """One text on stdout, flushed (a closed pipe propagates: ``pvegpu`` then exits 141)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
