"""The on-disk state of a simulated node (shared by every process that looks at it)."""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from typing import Any

from ..contract import dumps


def write_json(path: str, data: Any) -> None:
    """Atomic write (other processes read these files while we write)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(dumps(data))
    os.replace(tmp, path)


def read_json(path: str, default: Any = None) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def read_dir(path: str) -> list[Any]:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    out = []
    for n in names:
        if n.endswith(".json") and not n.startswith("."):
            d = read_json(os.path.join(path, n))
            if d is not None:
                out.append(d)
    return out


class SimState:
    """Paths inside a simulated node's directory."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    @property
    def etc_pve(self) -> str:
        return os.path.join(self.root, "etc-pve")

    @property
    def snippets(self) -> str:
        return os.path.join(self.root, "snippets")

    def gpus(self) -> list[dict[str, Any]]:
        return list(read_json(os.path.join(self.root, "gpus.json"), []))

    def set_gpus(self, gpus: list[dict[str, Any]]) -> None:
        """A GPU without ``stand_in`` gets the node's own: ``dev/nvidia<minor>`` under the root, made here."""
        write_json(os.path.join(self.root, "gpus.json"),
                   [g if "stand_in" in g else g | {"stand_in": self.private_stand_in(int(g["minor"]), bool(g.get("mappable")))} for g in gpus])

    def private_stand_in(self, minor: int, mappable: bool = False) -> str:
        """A file no process outside this node opens; empty (its holders show as fd-only, like ``/dev/full``'s)
        or, ``mappable``, one page the workloads also map (as CUDA maps ``/dev/nvidiaN``)."""
        path = os.path.join(self.root, "dev", f"nvidia{minor}")
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(mmap.PAGESIZE if mappable else 0)
        return path

    def ct(self, vmid: int) -> dict[str, Any]:
        return dict(read_json(os.path.join(self.root, "cts", f"{vmid}.json"), {}))

    def set_ct(self, vmid: int, data: dict[str, Any]) -> None:
        write_json(os.path.join(self.root, "cts", f"{vmid}.json"), data)

    def cts(self) -> list[dict[str, Any]]:
        return read_dir(os.path.join(self.root, "cts"))

    def contexts(self) -> list[dict[str, Any]]:
        return read_dir(os.path.join(self.root, "ctx"))

    def holders(self) -> list[dict[str, Any]]:
        return read_dir(os.path.join(self.root, "holders"))

    def add_context(self, owner: int, start: int, gpu: int, nbytes: int, *, leaks: bool = False) -> None:
        write_json(os.path.join(self.root, "ctx", f"{owner}.json"),
                   {"owner": owner, "start": start, "gpu": gpu, "bytes": nbytes, "leaks": leaks})

    def add_holder(self, pid: int, start: int, owner: int) -> None:
        write_json(os.path.join(self.root, "holders", f"{pid}.json"), {"pid": pid, "start": start, "owner": owner})

    def mark_context(self, owner: int, dead_since: float) -> None:
        """Keep when the context's last holder was seen dead (the driver's release latency runs from then)."""
        path = os.path.join(self.root, "ctx", f"{owner}.json")
        ctx = read_json(path)
        if ctx is not None and ctx.get("dead_since") is None:
            write_json(path, {**ctx, "dead_since": dead_since})

    def drop(self, kind: str, pid: int) -> bool:
        """Remove one record; True when this call removed it."""
        try:
            os.unlink(os.path.join(self.root, kind, f"{pid}.json"))
        except FileNotFoundError:
            return False
        return True
