"""The shape of each Proxmox answer pvegpu reads, checked before use (after PVE's API schema, trimmed to what we read).

A wrong shape (``data: null``, a string where rows were expected, a row without ``vmid``) raises
BadAnswer naming what was wrong; the adapter turns it into an exit-4 PveApiError naming the call.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pvegpu.adapters.pvesh import UPID_RE

_INT = re.compile(r"^-?\d+$")


class BadAnswer(Exception):
    """The answer does not have the documented shape."""


def _kind(value: Any) -> str:
    return "null" if value is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
                                         int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def decoded(value: Any) -> None:
    """proxmoxer answers ``{"errors": <the body's bytes>}`` for a 200 whose body is not JSON (an HTML page, a proxy
    re-encoding it): JSON never holds bytes, so this is that, refused, never read as an object."""
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get("errors"), (bytes, bytearray)):
        body = bytes(value["errors"])
        raise BadAnswer(f"the answer is not JSON ({len(body)} bytes: {body[:60].decode('utf-8', 'replace')!r})")


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


def _about(st: Mapping[str, Any], vmid: int | None) -> None:
    """An answer whose ``vmid`` names another guest (a misrouting proxy or cache) is refused, never taken for ``vmid``'s."""
    if vmid is not None and st.get("vmid") is not None and integer(st, "vmid", "the answer") != vmid:
        raise BadAnswer(f"the answer is about guest {integer(st, 'vmid', 'the answer')}, not {vmid} (a proxy or cache answering for another guest?)")


def _power_state(st: Mapping[str, Any]) -> str:
    status = text(st, "status", "the answer") or ""
    if status not in ("running", "stopped"):
        raise BadAnswer(f"status is {status!r}, expected running or stopped")
    return status


def _ha(st: Mapping[str, Any]) -> tuple[bool, str | None]:
    """``ha``: (managed, HA's state of the resource when managed)."""
    ha = st.get("ha")
    managed = bool(integer(obj(ha, "ha"), "managed", "ha", required=False) or 0) if ha is not None else False
    return managed, text(obj(ha, "ha"), "state", "ha", required=False) if managed and ha is not None else None


def ct_status(value: Any, vmid: int | None = None) -> tuple[str, bool, str | None, str | None]:
    """``GET .../status/current``: (status, HA managed, lock, HA state). An answer whose ``vmid`` names another
    guest (a misrouting proxy or cache) is refused, never taken for CT ``vmid``'s."""
    st = obj(value)
    _about(st, vmid)
    status = _power_state(st)
    managed, ha_state = _ha(st)
    lock = text(st, "lock", "the answer", required=False) or None
    return status, managed, lock, ha_state


def vm_status(value: Any, vmid: int | None = None) -> dict[str, Any]:
    """``GET /nodes/{node}/qemu/{vmid}/status/current``: status (running|stopped), qmpstatus, lock and ha {managed,
    state}, checked and nothing else kept. An answer about another guest is refused, as a container's."""
    st = obj(value)
    _about(st, vmid)
    status = _power_state(st)
    managed, ha_state = _ha(st)
    return {"status": status, "qmpstatus": text(st, "qmpstatus", "the answer", required=False),
            "lock": text(st, "lock", "the answer", required=False) or None, "ha": {"managed": int(managed), "state": ha_state}}


def vm_config(value: Any) -> Mapping[str, Any]:
    """``GET /nodes/{node}/qemu/{vmid}/config``: an object; what pvegpu reads (``hostpciN``, ``agent``, ``ostype``) is
    a string or a number: a wrongly typed ``hostpci0`` is not PVE's answer, never read as "no passthrough device"."""
    conf = obj(value)
    for key, v in conf.items():
        if (str(key).startswith("hostpci") or key in ("agent", "ostype")) and (isinstance(v, bool) or not isinstance(v, (str, int, float))):
            raise BadAnswer(f"{key} is {_kind(v)}, expected a string or a number")
    return conf


def flag(row: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> bool | None:
    """A PVE boolean: ``1``/``0`` (JSON true/false, or digit strings through some paths)."""
    v = row.get(key)
    if v is None and not required:
        return None
    if isinstance(v, bool):
        return v
    if (isinstance(v, int) and v in (0, 1)) or (isinstance(v, str) and v.strip() in ("0", "1")):
        return int(v) == 1
    raise BadAnswer(f"{where}.{key} is {_kind(v) if not isinstance(v, str) else repr(v[:40])}, expected 1 or 0")


def exec_status(value: Any) -> dict[str, Any]:
    """``GET .../agent/exec-status``: ``exited`` is required (an answer without it is not the agent's, never read as
    "still running"); ``exitcode`` and ``signal`` are integers, ``out-data``/``err-data`` text, ``out-truncated`` /
    ``err-truncated`` flags (the agent cut that output at its limit). Returned with every key, checked."""
    st = obj(value)
    out: dict[str, Any] = {"exited": flag(st, "exited", "the answer")}
    for key in ("exitcode", "signal"):
        out[key] = integer(st, key, "the answer", required=False)
    for key in ("out-data", "err-data"):
        v = st.get(key)
        if v is not None and not isinstance(v, str):
            raise BadAnswer(f"{key} is {_kind(v)}, expected a string")
        out[key] = v or ""
    for key in ("out-truncated", "err-truncated"):
        out[key] = bool(flag(st, key, "the answer", required=False))
    return out


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
