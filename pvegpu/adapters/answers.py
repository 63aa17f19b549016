"""The shape of each Proxmox answer pvegpu reads, checked before use (after PVE's API schema, trimmed to what we read).

A wrong shape (``data: null``, a string where rows were expected, a row without ``vmid``) raises
BadAnswer naming what was wrong; the adapter turns it into an exit-4 PveApiError naming the call.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .pvesh import UPID_RE

_INT = re.compile(r"^-?\d+$")


class BadAnswer(Exception):
    """The answer does not have the documented shape."""


def _kind(value: Any) -> str:
    return "null" if value is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
                                         int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def obj(value: Any, where: str = "the answer") -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise BadAnswer(f"{where} is {_kind(value)}, expected an object")
    return value


def rows(value: Any, where: str = "the answer") -> list[Mapping[str, Any]]:
    if not isinstance(value, list):
        raise BadAnswer(f"{where} is {_kind(value)}, expected a list")
    return [obj(r, f"{where}[{i}]") for i, r in enumerate(value)]


def text(row: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> str | None:
    v = row.get(key)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise BadAnswer(f"{where}.{key} is {_kind(v)}, expected a string")
    return str(v)


def integer(row: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> int | None:
    """PVE sends integers as numbers or, through some paths, as digit strings; both are accepted."""
    v = row.get(key)
    if v is None and not required:
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and _INT.match(v.strip()):
        return int(v)
    raise BadAnswer(f"{where}.{key} is {_kind(v) if not isinstance(v, str) else repr(v[:40])}, expected an integer")


def resources(value: Any) -> list[tuple[int, str, str, str]]:
    """``GET /cluster/resources?type=vm``: (vmid, node, type, name) per guest row."""
    out = []
    for i, r in enumerate(rows(value)):
        where = f"row {i}"
        kind = text(r, "type", where) or ""
        if kind not in ("lxc", "qemu"):
            continue
        out.append((integer(r, "vmid", where) or 0, text(r, "node", where) or "", kind, text(r, "name", where, required=False) or ""))
    return out


def ct_config(value: Any) -> dict[str, Any]:
    """``GET /nodes/{node}/lxc/{vmid}/config``: an object of option -> scalar value, and ``lxc``: a list of
    [key, value] pairs (the raw ``lxc.*`` lines). Anything else is not PVE's answer: never read as "no GPU"."""
    conf = dict(obj(value))
    for key, v in conf.items():
        if key == "lxc":
            pairs = v if isinstance(v, list) else None
            if pairs is None or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs):
                raise BadAnswer(f"lxc is {_kind(v)}, expected a list of [key, value] pairs")
        elif not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise BadAnswer(f"{key} is {_kind(v)}, expected a string or a number")
    return conf


def ct_status(value: Any, vmid: int | None = None) -> tuple[str, bool, str | None, str | None]:
    """``GET .../status/current``: (status, HA managed, lock, HA state). An answer whose ``vmid`` names another
    guest (a misrouting proxy or cache) is refused, never taken for CT ``vmid``'s."""
    st = obj(value)
    if vmid is not None and st.get("vmid") is not None and integer(st, "vmid", "the answer") != vmid:
        raise BadAnswer(f"the answer is about guest {integer(st, 'vmid', 'the answer')}, not {vmid} (a proxy or cache answering for another guest?)")
    status = text(st, "status", "the answer") or ""
    if status not in ("running", "stopped"):
        raise BadAnswer(f"status is {status!r}, expected running or stopped")
    ha = st.get("ha")
    managed = bool(integer(obj(ha, "ha"), "managed", "ha", required=False) or 0) if ha is not None else False
    ha_state = text(obj(ha, "ha"), "state", "ha", required=False) if managed and ha is not None else None
    lock = text(st, "lock", "the answer", required=False) or None
    return status, managed, lock, ha_state


def task_status(value: Any, upid: str | None = None) -> dict[str, Any]:
    """``GET /nodes/{node}/tasks/{upid}/status``: status running|stopped, exitstatus a string once stopped; an
    answer naming another task is refused."""
    st = dict(obj(value))
    if upid is not None and st.get("upid") is not None and str(st.get("upid")).strip() != upid.strip():
        raise BadAnswer(f"the answer is about task {str(st.get('upid'))[:80]!r}, not {upid}")
    status = text(st, "status", "the answer")
    if status not in ("running", "stopped"):
        raise BadAnswer(f"status is {status!r}, expected running or stopped")
    if status == "stopped":
        text(st, "exitstatus", "the answer")
    return st


def task_log(value: Any) -> list[str]:
    """``GET /nodes/{node}/tasks/{upid}/log``: rows {n, t}."""
    return [text(r, "t", f"row {i}") or "" for i, r in enumerate(rows(value))]


def storage_content(value: Any) -> list[str]:
    """``GET /nodes/{node}/storage/{storage}/content``: the volid of each row."""
    return [text(r, "volid", f"row {i}") or "" for i, r in enumerate(rows(value))]


def upid(value: Any) -> str:
    """A task id as PVE prints it: ``UPID:node:pid:pstart:starttime:type:id:user:``."""
    if not isinstance(value, str) or not UPID_RE.fullmatch(value.strip()):
        shown = repr(value)[:80] if isinstance(value, str) else _kind(value)
        raise BadAnswer(f"the answer is {shown}, expected a task id (UPID:node:pid:pstart:starttime:type:id:user:)")
    return value.strip()
