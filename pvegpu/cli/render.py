"""Human and JSON renderings of reports (no I/O: returns strings / dicts)."""

from __future__ import annotations

from typing import Any

from pvegpu.audit.render import audit_table
from pvegpu.core.holders import GpuFacts, memory_by_pid
from pvegpu.core.model import MIB
from pvegpu.core.textfit import WIDTH, fit, said
from pvegpu.core.units import mib
from pvegpu.reset.report import ResetOutcome, ResetReport
from pvegpu.reset.vocab import Diagnosis


def _mib(n: int | None) -> str:
    return mib(n, grouped=True)


def _facts_json(f: GpuFacts) -> dict[str, Any]:
    memory = memory_by_pid(f)
    return {
        "index": f.gpu.index, "minor": f.gpu.minor, "uuid": f.gpu.uuid,
        "used_mib": None if f.used_bytes is None else round(f.used_bytes / MIB, 1),
        "residual_mib": None if f.residual_bytes is None else round(f.residual_bytes / MIB, 1),
        "used_bytes": f.used_bytes, "residual_bytes": f.residual_bytes, "baseline_bytes": f.baseline_bytes,
        "ct_holders": [{"pid": h.pid, "ns_pid": h.info.ns_pid, "comm": h.info.comm, "state": h.info.state,
                        "init": h.info.is_ct_init, "via": sorted(h.via),
                        "memory_bytes": memory.get(h.pid, 0)} for h in f.ct_holders],  # 0: an fd, no memory on this GPU
        "other_holders": [{"pid": h.pid, "comm": h.info.comm, "vmid": h.info.placement.vmid,
                           "place": h.info.placement.place.value} for h in f.other_holders],
        "ghost_pids": f.ghosts, "error": f.sample.error,
        "heirs": {str(g): h for g, h in f.heirs.items()}, "target_ghost_pids": f.target_ghosts,
        "unexplained_ghost_pids": f.unexplained_ghosts, "recycled_pids": f.recycled,
        "foreign_ghost_pids": f.foreign_ghosts, "linked_ghost_pids": f.linked, "unproven_ghost_pids": f.unproven,
        "contexts_outside": f.contexts_outside,
        "baseline_mib": round(f.baseline_bytes / MIB, 1),  # left before the reset by others: not held against the target
    }


def _diagnosis_json(d: Diagnosis) -> dict[str, Any]:
    """One diagnosis line: problem and action, plus its kind and whether it is information only (added keys)."""
    return {"problem": d.problem, "action": d.action, "kind": d.kind.value, "info": d.info}


def reset_json(r: ResetReport) -> dict[str, Any]:
    return {
        "vmid": r.vmid, "node": r.node, "outcome": r.outcome.value, "outcome_kind": r.outcome.slug, "exit_code": r.exit_code,
        "elapsed_s": round(r.elapsed, 3), "restarted": r.restarted, "left_stopped": r.left_stopped, "app_container": r.app_container,
        "ct_state": r.ct_state, "task_log": r.task_log, "respawns": [x.as_json() for x in r.respawns], "interrupted": r.interrupted,
        "gpus": r.gpus,
        "before": [_facts_json(f) for _, f in sorted(r.before.items())],
        "after": [_facts_json(f) | ({"clean": r.clean[m]} if m in r.clean else {}) for m, f in sorted(r.after.items())],
        "signalled": r.signalled, "plan": r.plan,
        "steps": [{"name": s.name, "outcome": s.outcome, **s.detail} for s in r.steps],
        "diagnosis": [_diagnosis_json(d) for d in r.diagnosis], "notes": r.notes,
    }


def step_line(name: str, msg: str, wide: bool = False) -> str:
    """A step as it happens, ``[name] msg`` (also ``[wait] ...``), in 80 columns unless ``wide``."""
    return said(msg, f"[{name}] ", "    ", wide)


OTHERS = 6  # the table's column that grows with the neighbours: wrapped inside its column to keep 80


def _owners(f: GpuFacts) -> str:
    """The target's processes whose memory this GPU held (NVML lists them here, or an heir of one): a rank of a
    tensor-parallel job holds every GPU's device node, but only its own GPU's memory."""
    mine = {h.pid for h in f.ct_holders}
    pids = sorted(p for p in memory_by_pid(f) if p in mine)
    return "-" if not pids else str(pids[0]) + (f" +{len(pids) - 1}" if len(pids) > 1 else "")


def _state(r: ResetReport, minor: int) -> str:
    """This GPU's verdict: the reset's when it has one for every GPU, else whether this GPU kept the target's memory."""
    if r.outcome in (ResetOutcome.DRY_RUN, ResetOutcome.NOT_VERIFIED) or r.outcome.verified_clean or minor not in r.clean:
        return {ResetOutcome.DRY_RUN: "(dry run)", ResetOutcome.NOT_VERIFIED: "NOT verified"}.get(
            r.outcome, "clean" if r.outcome.verified_clean else "NOT clean")
    return "clean" if r.clean[minor] else "NOT clean"


def _items(text: str, width: int) -> list[str]:
    """A ", "-separated list in lines of ``width``, never breaking an item ("CT 131") across two lines."""
    lines: list[str] = []
    for item in text.split(", "):
        if lines and len(lines[-1]) + 2 + len(item) <= width:
            lines[-1] += ", " + item
        else:
            if lines:
                lines[-1] += ","
            lines.append(item)
    return lines


def reset_table(r: ResetReport, wide: bool = False) -> str:
    """One row per GPU (8 of a tensor-parallel job read in 80 columns): its memory before and after, how many of the
    target's processes held it (``holders``, an open fd is enough) and whose memory it was (``owner``: the pid NVML
    listed there, ``+N`` more), the neighbours, its verdict."""
    rows = [("GPU", "minor", "before", "after", "holders", "owner", "others", "state")]
    for minor in r.gpus:
        b, a = r.before.get(minor), r.after.get(minor)
        if b is None or a is None:
            continue
        others = ", ".join(sorted({f"CT {h.info.placement.vmid}" if h.info.placement.vmid else "host" for h in a.other_holders})) or "-"
        rows.append((str(b.gpu.index), str(minor), _mib(b.used_bytes), _mib(a.used_bytes),
                     f"{len(b.ct_holders)} -> {len(a.ct_holders)}", _owners(b), others, _state(r, minor)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    if not wide:
        room = WIDTH - sum(w for i, w in enumerate(widths) if i != OTHERS) - 2 * (len(widths) - 1)
        widths[OTHERS] = min(widths[OTHERS], max(room, len(rows[0][OTHERS])))
    out = []
    for row in rows:
        cells = [[c] if len(c) <= w else _items(c, w) if i == OTHERS else fit(c, "", "", w) for i, (c, w) in enumerate(zip(row, widths))]
        for k in range(max(len(c) for c in cells)):
            out.append("  ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(out)


def audit_text(rep: Any, wide: bool = False) -> str:
    """The audit table, from a NodeAudit, the JSON document, or one node's JSON (80 columns; ``wide``: every detail)."""
    doc = rep.to_json() if hasattr(rep, "to_json") else rep
    if "nodes" not in doc:
        doc = {"nodes": [doc], "attention": doc.get("attention")}
    return audit_table(doc, wide)


def reset_human(r: ResetReport, wide: bool = False) -> str:
    """The table, the dry-run plan, notes, the verdict line, the diagnosis and any "left stopped" warning; in 80
    columns (long text, a tenant's too, wrapped, never cut), or one line per item when ``wide`` (``-v``)."""
    lines = [reset_table(r, wide)]
    for p in r.plan:
        lines.append(said(f"pid {p['pid']} ({p['comm']}, CT pid {p['ns_pid']}, {p['cgroup']}): {p['action']}", "  would: ", "      ", wide))
    lines.extend(said(note, "note: ", "    ", wide) for note in r.notes)
    outcome = str(getattr(r.outcome, "value", r.outcome))
    if outcome == "clean":
        verdict = f"GPU memory verified free in {r.elapsed:.2f} s" + (" (after a restart)" if r.restarted else "")
    elif outcome == "dry-run":
        verdict = "dry run, nothing was signalled"
    elif outcome == "not verified":
        verdict = (f"NOT verified after {r.elapsed:.2f} s: the memory came back, but too late to hold for the settle "
                   "window before the deadline; run it again or raise --timeout")
    else:
        verdict = f"{outcome} after {r.elapsed:.2f} s"
    lines.append(said(verdict, f"CT {r.vmid}: ", "    ", wide))
    for d in r.diagnosis:
        if d.info:  # a neighbour: information, nothing to do here
            lines.append(said(d.problem, "  note: ", "      ", wide))
        else:
            lines.append(said(d.problem, "  problem: ", "      ", wide) + "\n" + said(d.action, "     what to do: ", "       ", wide))
    if r.left_stopped:
        lines.append(said(f"CT {r.vmid} was left STOPPED; start it with `pct start {r.vmid}` once the GPU is clean.", "  ", "    ", wide))
    if r.interrupted:
        lines.append(said(f"interrupted by {r.interrupted['signal']}: pvegpu {r.interrupted['action']}; exit {r.exit_code}",
                          "  ", "    ", wide))
    return "\n".join(lines)
