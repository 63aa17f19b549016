"""``pvegpu audit --cluster``: this node's audit plus every other node's own, fetched live.

The node list and addresses come from the cluster membership (``/etc/pve/.members``, as ``pvecm nodes``
shows it). Each other online node is asked over the root SSH trust PVE sets up between nodes
(``ssh -o BatchMode=yes root@<ip> pvegpu audit --json``, see ``adapters/ssh.py``), in parallel, each with a
deadline. A node that is offline, unreachable, without pvegpu or answering garbage is an error row carrying
its configured guests (read here from ``/etc/pve/nodes/<node>/``), never a silent gap.

Another node's answer is remote text: every string in it (keys too) is escaped here (``safetext.shown``), before
a table, the JSON, a log or the textfile sees it, and an entry that the table or the textfile cannot draw (a
field missing, of the wrong type) is that node's error row, never the whole audit's failure.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pvegpu.audit.model import SCHEMA, SCHEMA_VERSION, Flag, FlagKind, NodeAudit
from pvegpu.audit.render import node_text
from pvegpu.core.contract import dumps
from pvegpu.core.safetext import shown

MAX_DEPTH = 32  # nesting of a node's answer (an audit document is 6 deep)
MAX_STRING = 4096  # characters of any one string of it, after escaping


def depth_exceeds(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests deeper than ``limit`` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            if d > limit:
                return True
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def _cleaned(value: Any) -> Any:
    """``value`` with every string (and key) made safe to show; call only on depth-checked values."""
    if isinstance(value, dict):
        return {shown(k, MAX_STRING): _cleaned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cleaned(v) for v in value]
    if isinstance(value, str):
        return shown(value, MAX_STRING)
    return value


@dataclass(frozen=True)
class Member:
    """One node of the cluster membership: ``/etc/pve/.members`` ``nodelist`` entry."""

    name: str
    ip: str
    online: bool


def parse_members(text: str | None) -> list[Member]:
    """``/etc/pve/.members`` (JSON) → members, sorted by name; [] when not a cluster or unreadable."""
    try:
        data = json.loads(text or "")
    except ValueError:
        return []
    nodes = data.get("nodelist") if isinstance(data, dict) else None
    if not isinstance(nodes, dict):
        return []
    out = []
    for name, n in nodes.items():
        if isinstance(n, dict) and isinstance(name, str):
            out.append(Member(name, str(n.get("ip") or ""), bool(n.get("online"))))
    return sorted(out, key=lambda m: m.name)


Fetch = Callable[[list[Member]], Mapping[str, "Mapping[str, Any] | str"]]  # node -> its audit document, or why not


def _error_row(name: str, why: str, guests: list[dict[str, Any]]) -> dict[str, Any]:
    flag = Flag(FlagKind.NODE_UNREACHABLE, f"node {name}", why)
    return {"node": name, "ok": False, "error": why, "duration_seconds": None, "attention": True, "gpus": [],
            "guests": guests, "passthrough": [], "flags": [flag.to_json()]}


def _node_from(answer: Mapping[str, Any] | str, name: str) -> tuple[dict[str, Any] | None, str | None]:
    """The node's entry of a remote document (escaped, and drawable), or why it cannot be used."""
    if isinstance(answer, str):
        return None, shown(answer, 300)
    if depth_exceeds(answer, MAX_DEPTH):
        return None, f"answer is nested deeper than {MAX_DEPTH} levels"
    doc: dict[str, Any] = dict(_cleaned(dict(answer)))
    version = doc.get("schema_version", doc.get("version"))  # schema_version (the JSON contract); version before it
    if doc.get("schema") != SCHEMA or not isinstance(version, int) or isinstance(version, bool):
        return None, "answer is not a pvegpu audit document"
    if version > SCHEMA_VERSION:
        return None, f"pvegpu there writes audit schema version {version}; this pvegpu reads up to {SCHEMA_VERSION} (upgrade it here)"
    listed = doc.get("nodes")
    nodes = [n for n in listed if isinstance(n, Mapping)] if isinstance(listed, list) else []
    if len(nodes) != 1:
        return None, f"expected one node in its answer, got {len(nodes)}"
    node = dict(nodes[0])
    if node.get("node") != name:
        return None, f"answered as node {shown(node.get('node'), 80)!r}: check the address in /etc/pve/.members"
    if (why := _undrawable(node)) is not None:
        return None, why
    return node, None


def _undrawable(node: dict[str, Any]) -> str | None:
    """Why the table or the textfile could not show this entry (a malformed answer), or None when both can."""
    from pvegpu.audit.prom import render  # prometheus_client: only for --cluster and --prometheus, not every audit

    try:
        node_text(node)
        render({"nodes": [node], "generated_at": 0})
        dumps(node)
    except Exception as exc:  # noqa: BLE001 - anything another node sends is its own error row, never ours
        return f"answer is malformed ({type(exc).__name__}: {shown(exc, 120)})"
    return None


def audit_cluster(local: NodeAudit, members: list[Member], fetch: Fetch) -> list[dict[str, Any]]:
    """Node entries for the JSON document: this node first, then every other member (live, or an error row).

    ``local`` may list other nodes' guests (read from configs); they move to those nodes' error rows when the
    node does not answer, and are dropped when it does (its own audit lists them, with their status).
    """
    mine = local.to_json()
    others_guests: dict[str, list[dict[str, Any]]] = {}
    kept = []
    for g in mine["guests"]:
        if g["node"] == local.node:
            kept.append(g)
        else:
            others_guests.setdefault(g["node"], []).append(g)
    mine["guests"] = kept
    others = [m for m in members if m.name != local.node]
    answers = fetch([m for m in others if m.online]) if any(m.online for m in others) else {}
    out = [mine]
    for m in others:
        if not m.online:
            out.append(_error_row(m.name, "offline in the cluster membership (`pvecm status`)", others_guests.get(m.name, [])))
            continue
        node, why = _node_from(answers.get(m.name, "no answer"), m.name)
        out.append(node if node is not None else _error_row(m.name, why or "no answer", others_guests.get(m.name, [])))
    known = {m.name for m in members} | {local.node}
    for name in sorted(set(others_guests) - known):  # guests on a node the membership does not list
        out.append(_error_row(name, "not in the cluster membership", others_guests[name]))
    return out
