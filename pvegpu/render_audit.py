"""The readable ``pvegpu audit`` table, drawn from the JSON document (so other nodes' audits read the same)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .safetext import shown
from .units import mib_figure as _mib

_safe = shown  # tenant or remote text (comm, cmdline, errors): it never draws on the admin's terminal


def _health(h: Mapping[str, Any]) -> str:
    def word(v: Any, yes: str) -> str | None:
        return None if v is False else (f"{yes}?" if v is None else yes)

    parts = [w for w in (word(h.get("remap_pending"), "remap pending"), word(h.get("retired_pages_pending"), "retirement pending"),
                         word(h.get("remap_failed"), "remap failed")) if w and not w.endswith("?")]
    mig = h.get("mig_enabled")
    parts.append("MIG ?" if mig is None else ("MIG on" if mig else "MIG off"))
    return ", ".join(parts)


def _holder(h: Mapping[str, Any]) -> str:
    who = h["owner"] + (f" ({h['hostname']})" if h.get("hostname") else "")
    inside = f", pid {h['ns_pid']} inside" if h.get("ns_pid") is not None and h.get("place") == "lxc" else ""
    user = f", uid {h['uid']}" if h.get("uid") is not None else ""
    via = h.get("via", [])
    mem = f"{_mib(h.get('used_bytes'))} MiB" if "nvml" in via else "- MiB"
    cmd = _safe(h.get("cmdline") or h.get("comm", ""))
    client = "  (NVML client: no context)" if h.get("place") in ("host", "monitor") and not {"nvml", "maps"} & set(via) else ""
    return f"    {who:<24} pid {h['pid']}{inside}{user}  {mem:>9}  via {'+'.join(via)}  {cmd[:60]}{client}"


def node_text(n: Mapping[str, Any]) -> list[str]:
    lines = [f"node {_safe(n['node'])}" + ("" if n.get("ok", True) else f": {_safe(n.get('error'))}")]
    for g in n.get("gpus", []):
        if not g.get("readable", True):
            dev = f"/dev/nvidia{g['minor']}" if g["minor"] >= 0 else "/dev/nvidia?"
            lines.append(f"GPU {g['index']}  {dev}  {g['bus_id']}  {g['uuid']}  UNREADABLE: {_safe(g.get('error'))}")
            continue
        unattr = g.get("unattributed_bytes")
        lines.append(f"GPU {g['index']}  /dev/nvidia{g['minor']}  {g['bus_id']}  {g['name']}  {g['uuid']}")
        lines.append(f"  memory: {_mib(g.get('used_bytes'))} used, {_mib(g.get('reserved_bytes'))} reserved, "
                     f"{_mib(g.get('total_bytes'))} total MiB; {_mib(unattr)} MiB unattributed; health: {_health(g.get('health', {}))}")
        lines.append(f"  configured for: {', '.join(g.get('granted_to', [])) or '-'}" + (f"   [{', '.join(g['flags'])}]" if g.get("flags") else ""))
        for h in g.get("holders", []):
            lines.append(_holder(h))
        for pid in g.get("dead_pids", []):
            lines.append(f"    NVML lists pid {pid}, which no longer exists")
    for p in n.get("passthrough", []):
        lines.append(f"PCI {p['bus_id']}  {p['id']} ({p['key']}{', mapping ' + p['mapping'] if p.get('mapping') else ''}): {p['note']}")
    if n.get("guests"):
        lines.append("configured guests:")
        for c in n["guests"]:
            what = "all GPUs" if c["all_gpus"] else ", ".join([f"/dev/nvidia{m}" for m in c["minors"]] + list(c.get("bus_ids", [])))
            lines.append(f"  {c['id']:<10} {c.get('name') or '':<16} {c['status']:<8} on {c['node']}: {what}"
                         + (f"  ({'; '.join(c['notes'])})" if c.get("notes") else ""))
    for f in n.get("flags", []):
        mark = "!" if f.get("attention") else "i"
        lines.append(f"{mark} {f['kind']}: {f['subject']}: {_safe(f['detail'])}\n    -> {f['advice']}")
    return lines


def audit_table(doc: Mapping[str, Any]) -> str:
    """Every node of the document, then the verdict line."""
    lines: list[str] = []
    for n in doc.get("nodes", []):
        if lines:
            lines.append("")
        lines.extend(node_text(n))
    lines.append("")
    lines.append("attention needed (exit 8)" if doc.get("attention") else "nothing needs attention")
    return "\n".join(lines)
