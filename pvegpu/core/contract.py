"""The one JSON contract of every ``--json`` output: a versioned document with one vocabulary.

Every document starts with ``"schema": "pvegpu-<kind>"`` and ``"schema_version": 1`` (kinds: ``audit``,
``reset``, ``check``, ``hook-status``, ``error``); its JSON Schema (draft 2020-12) ships in the package as
``pvegpu/data/schema/<kind>.json`` and the tests validate every output against it (never at run time).

One vocabulary, whatever the command: memory in **bytes** (``*_bytes``; ``null`` is unknown, never 0), NVML-listed
pids that no longer exist are ``dead_pids``, where a process runs is ``location`` (``container``, ``vm``,
``host``, ``monitor``, ``unknown``), how long a run took is ``duration_seconds``, a guest's state after a reset is
``guest_state``. The names used before (``DEPRECATED``) stay beside the canonical ones as deprecated aliases for
as long as ``schema_version`` is 1: fields are only ever added within a version.

This is a post-processing layer over the commands' own dicts (called where the JSON is printed), pure: ``check
--json`` runs on the start gate's path. It never raises on what it is given (another node's audit passes through
it too): a value it does not expect is copied as it is. ``dumps`` is the one JSON writer, for every document.
"""

from __future__ import annotations

import json

SCHEMA_VERSION = 1
KINDS = ("audit", "reset", "check", "hook-status", "error")

# where a process runs: one word per place, whichever command reports it (the audit said lxc/qemu before)
LOCATIONS = {"container": "container", "lxc": "container", "vm": "vm", "qemu": "vm", "host": "host",
             "monitor": "monitor", "unknown": "unknown"}

# deprecated alias -> its canonical name; kept in every schema_version 1 document (README "JSON contract")
DEPRECATED = {
    "version": "schema_version",  # audit, top level
    "elapsed_s": "duration_seconds",  # reset
    "ct_state": "guest_state",  # reset of a container
    "vm_state": "guest_state",  # reset of a VM
    "place": "location",  # audit holders ("lxc", "qemu"), reset's other holders
    "ghost_pids": "dead_pids",  # reset, check
    "target_ghost_pids": "target_dead_pids",
    "unexplained_ghost_pids": "unexplained_dead_pids",
    "foreign_ghost_pids": "foreign_dead_pids",
    "linked_ghost_pids": "linked_dead_pids",
    "unproven_ghost_pids": "unproven_dead_pids",
    "used_mib": "used_bytes",  # reset (float), check, audit (rounded)
    "residual_mib": "residual_bytes",
    "baseline_mib": "baseline_bytes",
    "unattributed_mib": "unattributed_bytes",
    "listed_gone": "dead_pids",  # reset of a VM: pids the guest's nvidia-smi lists that the guest does not run
}

_MAX_DEPTH = 64  # deeper than any document pvegpu writes; below it a value is copied unchanged


def _canonical(value: object, depth: int = 0) -> object:
    """``value`` with each deprecated key's canonical twin added beside it (an existing canonical key wins)."""
    if depth > _MAX_DEPTH:
        return value
    if isinstance(value, list):
        return [_canonical(v, depth + 1) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict[object, object] = {}
    for key, v in value.items():
        out[key] = v = _canonical(v, depth + 1)
        new = DEPRECATED.get(key) if isinstance(key, str) else None
        if new is None or new in value or key.endswith("_mib"):  # bytes come from the source, exactly, never from rounded MiB
            continue
        out[new] = (LOCATIONS.get(v, "unknown") if isinstance(v, str) else "unknown") if key == "place" else v
    return out


def document(kind: str, payload: dict) -> dict:
    """``payload`` (a command's JSON dict) as a versioned ``pvegpu-<kind>`` document in the one vocabulary."""
    body = _canonical(payload)
    assert isinstance(body, dict)
    head: dict[object, object] = {"schema": f"pvegpu-{kind}"}
    if kind == "audit" and "version" in body:  # the audit's header since its first version, read by other nodes
        head["version"] = body["version"]
    head["schema_version"] = SCHEMA_VERSION
    if (kind == "reset" or (kind == "check" and body.get("error") is None)) and "type" not in body:
        head["type"] = "lxc"  # a VM's report and verdict say "qemu"; a check that failed cannot tell
    rest = {k: v for k, v in body.items() if k not in head}
    return head | rest


def error_document(exc: object, command: str | None = None) -> dict:
    """An error for ``--json`` consumers (``pvegpu-error``): the message, the hint, the exit code."""
    return document("error", {"command": command, "error": getattr(exc, "message", str(exc)), "hint": getattr(exc, "hint", None),
                              "exit_code": int(getattr(exc, "exit_code", 1))})


def check_error_document(exc: object, vmid: int | None) -> dict:
    """``check --json`` when no decision could be made (NVML hung, bad settings, bad input): still a check
    document, and it says ``allow: false`` (the gate fails closed), with the error beside it."""
    message = getattr(exc, "message", str(exc))
    return document("check", {"vmid": vmid, "allow": False, "reasons": [message], "fix": [h for h in [getattr(exc, "hint", None)] if h],
                              "gpus": [], "error": message, "hint": getattr(exc, "hint", None),
                              "exit_code": int(getattr(exc, "exit_code", 1))})


def dumps(doc: object) -> str:
    """The one JSON writer of pvegpu: ``doc`` indented by two spaces, ASCII only (every other character escaped);
    a value JSON has no type for (a path, a timestamp) is written as its ``str``."""
    return json.dumps(doc, indent=2, default=str)
