"""The readable ``pvegpu audit`` table, drawn from the JSON document (so other nodes' audits read the same)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pvegpu.core.safetext import shown
from pvegpu.core.textfit import WIDTH, command, elide, fit
from pvegpu.core.units import mib_figure as _mib

_safe = shown  # tenant or remote text (comm, cmdline, errors): it never draws on the admin's terminal


def _health(h: Mapping[str, Any]) -> str:
    def word(v: Any, yes: str) -> str | None:
        return None if v is False else (f"{yes}?" if v is None else yes)

    parts = [w for w in (word(h.get("remap_pending"), "remap pending"), word(h.get("retired_pages_pending"), "retirement pending"),
                         word(h.get("remap_failed"), "remap failed")) if w and not w.endswith("?")]
    mig = h.get("mig_enabled")
    parts.append("MIG ?" if mig is None else ("MIG on" if mig else "MIG off"))
    verdict = (h.get("verdict") or {}).get("state")
    if verdict not in (None, "ok"):
        parts.insert(0, _safe(verdict))
    return ", ".join(parts)


def _user(h: Mapping[str, Any]) -> str:
    """The host user's name; its number when the host has none (a container's mapped uid) or another node did not say."""
    if h.get("user"):
        return _safe(h["user"])
    return "" if h.get("uid") is None else f"uid {h['uid']}"


def _holder(h: Mapping[str, Any]) -> str:
    """One holder as one wide line (``--wide``): everything, the whole command line."""
    who = h["owner"] + (f" ({h['hostname']})" if h.get("hostname") else "")
    inside = f", pid {h['ns_pid']} inside" if h.get("ns_pid") is not None and h.get("place") == "lxc" else ""
    user = f", user {_safe(h['user'])}" if h.get("user") else (f", {_user(h)}" if _user(h) else "")
    via = h.get("via", [])
    mem = f"{_mib(h.get('used_bytes'))} MiB" if "nvml" in via else "- MiB"
    cmd = _safe(h.get("cmdline") or h.get("comm", ""))
    return f"    {who:<24} pid {h['pid']}{inside}{user}  {mem:>9}  via {'+'.join(via)}  {cmd}{_client(h)}"


def _client(h: Mapping[str, Any]) -> str:
    via = h.get("via", [])
    return "  (NVML client: no context)" if h.get("place") in ("host", "monitor") and not {"nvml", "maps"} & set(via) else ""


def _holder_lines(h: Mapping[str, Any]) -> list[str]:
    """One holder in 80 columns: who, pids, user, memory and how it was seen; then the telling part of its command."""
    who = h["owner"] + (f" ({elide(_safe(h['hostname']), 16)})" if h.get("hostname") else "")
    pid = f"pid {h['pid']}" + (f" ({h['ns_pid']} inside)" if h.get("ns_pid") is not None and h.get("place") == "lxc" else "")
    via = h.get("via", [])
    mem = f"{_mib(h.get('used_bytes'))} MiB" if "nvml" in via else "- MiB"
    parts = [f"{who:<18}", pid, elide(_user(h), 16), f"{mem:>9}", "+".join(via)]
    lines = fit("  ".join(p for p in parts if p), "    ", "      ")
    client = _client(h)
    lines.append("      " + command(_safe(h.get("cmdline") or ""), _safe(h.get("comm", "")), WIDTH - 6 - len(client)) + client)
    return lines


def _fd_only(h: Mapping[str, Any]) -> bool:
    """A guest's process with the device open and nothing more (not listed, no mapping, no context): no memory here,
    as every rank of a tensor-parallel job has every GPU's device node open but allocates on its own GPU only."""
    return list(h.get("via", [])) == ["fd"] and not h.get("may_own_context") and h.get("place") in ("lxc", "qemu")


def _folded(holders: list[Mapping[str, Any]]) -> list[list[str]]:
    """The holders' lines in 80 columns, a guest's fd-only processes (two or more) folded into one entry where the
    first of them stands: on an 8-GPU job every GPU would otherwise list every rank of it."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for h in holders:
        if _fd_only(h):
            groups.setdefault(h["owner"], []).append(h)
    out: list[list[str]] = []
    for h in holders:
        group = groups.get(h["owner"], []) if _fd_only(h) else []
        if len(group) < 2:
            out.append(_holder_lines(h))
        elif h is group[0]:
            who = h["owner"] + (f" ({elide(_safe(h['hostname']), 16)})" if h.get("hostname") else "")
            pids = ", ".join(str(g["pid"]) for g in group)
            out.append(fit(f"{who:<18}  {len(group)} processes with the device open, no memory on it (fd): pids {pids}", "    ", "      "))
    return out


def node_text(n: Mapping[str, Any], wide: bool = False) -> list[str]:
    """One node's part of the table: in 80 columns, or (``wide``) one line per item with every detail."""
    def put(text: str, hang: str = "    ") -> None:
        if wide:
            lines.append(text)
            return
        body = text.lstrip(" ")
        lead = text[: len(text) - len(body)]
        lines.extend(fit(body, lead, lead + hang))

    lines: list[str] = []
    put(f"node {_safe(n['node'])}" + ("" if n.get("ok", True) else f": {_safe(n.get('error'))}"))
    for g in n.get("gpus", []):
        if not g.get("readable", True):
            dev = f"/dev/nvidia{g['minor']}" if g["minor"] >= 0 else "/dev/nvidia?"
            put(f"GPU {g['index']}  {dev}  {g['bus_id']}  {g['uuid']}  UNREADABLE: {_safe(g.get('error'))}")
            continue
        unattr = g.get("unattributed_bytes")
        put(f"GPU {g['index']}  /dev/nvidia{g['minor']}  {g['bus_id']}  {g['name']}  {g['uuid']}")
        memory = (f"  memory: {_mib(g.get('used_bytes'))} used, {_mib(g.get('reserved_bytes'))} reserved, "
                  f"{_mib(g.get('total_bytes'))} total MiB; {_mib(unattr)} MiB unattributed")
        health = f"health: {_health(g.get('health', {}))}"
        if wide:
            lines.append(f"{memory}; {health}")
        else:
            put(memory)
            put(f"  {health}")
        put(f"  configured for: {', '.join(g.get('granted_to', [])) or '-'}" + (f"   [{', '.join(g['flags'])}]" if g.get("flags") else ""))
        if wide:
            lines.extend(_holder(h) for h in g.get("holders", []))
        else:
            lines.extend(line for entry in _folded(list(g.get("holders", []))) for line in entry)
        for pid in g.get("dead_pids", []):
            put(f"    NVML lists pid {pid}, which no longer exists")
    for p in n.get("passthrough", []):
        put(f"PCI {p['bus_id']}  {p['id']} ({p['key']}{', mapping ' + p['mapping'] if p.get('mapping') else ''}): {p['note']}")
    if n.get("guests"):
        lines.append("configured guests:")
        for c in n["guests"]:
            what = "all GPUs" if c["all_gpus"] else ", ".join([f"/dev/nvidia{m}" for m in c["minors"]] + list(c.get("bus_ids", [])))
            put(f"  {c['id']:<10} {c.get('name') or '':<16} {c['status']:<8} on {c['node']}: {what}"
                + (f"  ({'; '.join(c['notes'])})" if c.get("notes") else ""), "      ")
    for f in n.get("flags", []):
        mark = "!" if f.get("attention") else "i"
        put(f"{mark} {f['kind']}: {f['subject']}: {_safe(f['detail'])}")
        put(f"    -> {f['advice']}", "   ")
    return lines


def audit_table(doc: Mapping[str, Any], wide: bool = False) -> str:
    """Every node of the document, then the verdict line (80 columns; ``wide``: one line per item, every detail)."""
    lines: list[str] = []
    for n in doc.get("nodes", []):
        if lines:
            lines.append("")
        lines.extend(node_text(n, wide))
    lines.append("")
    lines.append("attention needed (exit 8)" if doc.get("attention") else "nothing needs attention")
    return "\n".join(lines)
