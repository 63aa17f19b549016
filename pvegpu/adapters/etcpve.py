"""Read a PVE node's own view from ``/etc/pve`` (pmxcfs) without the API: fast, no credentials.

The one reader of ``/etc/pve``: ``EtcPve`` (the PveApi reads), ``read_pve`` / ``read_pve_or_none`` (any file
below the root: ``storage.cfg``, ``.members``, ``mapping/pci.cfg``), ``ha_files`` (``ha/*.cfg``), ``node_names`` and ``ct_confs`` (every
container's config, for ``hook install | status``). Used by the start gate (which must never call the API while
PVE holds the config lock) and by reset/audit/install on the node. Manual equivalent: ``cat /etc/pve/.vmlist``,
``cat /etc/pve/lxc/<vmid>.conf``, ``ls /etc/pve/nodes/*/lxc/``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from pvegpu.core.errors import NeedsRootError, NotFoundError, NotPveNodeError, PmxcfsDownError, PveApiError, PvegpuError
from pvegpu.core.ha import FILES as HA_FILES
from pvegpu.core.ha import HaFiles
from pvegpu.core.lxcconf import parse_config
from pvegpu.core.model import CtStatus, Guest, TaskResult


def _denied(path: str) -> NeedsRootError | None:
    """Why a user may not read ``path``: pvegpu runs as root on a node (pmxcfs gives its configs to root and
    www-data only); None for root, whose refusal is a real fault (an OSError to report as it is)."""
    uid = os.geteuid()
    return NeedsRootError(path, uid) if uid != 0 else None


def read_pve(root: str, relpath: str) -> str:
    """The UTF-8 text of ``root/relpath``; raises NeedsRootError (a user other than root may not read it), OSError
    (absent, unreadable) or UnicodeDecodeError."""
    path = os.path.join(root, relpath)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except PermissionError:
        if (denied := _denied(path)) is not None:
            raise denied from None
        raise


def read_pve_or_none(root: str, relpath: str) -> str | None:
    """``read_pve``, or None when the file is absent, unreadable (also to a user other than root) or not UTF-8."""
    try:
        return read_pve(root, relpath)
    except (OSError, UnicodeDecodeError, NeedsRootError):
        return None


def ha_files(root: str) -> HaFiles:
    """``ha/resources.cfg``, ``ha/groups.cfg``, ``ha/rules.cfg`` under ``root``: each one's text, None when it is
    absent (nothing of that kind configured), or why it could not be read (then HA state is unknown, never guessed)."""
    texts: dict[str, str | None] = {}
    unreadable: dict[str, str] = {}
    for name in HA_FILES:
        try:
            texts[name] = read_pve(root, os.path.join("ha", name))
        except FileNotFoundError:
            texts[name] = None
        except NeedsRootError as exc:
            unreadable[name] = exc.message
        except (OSError, UnicodeDecodeError) as exc:
            unreadable[name] = str(getattr(exc, "strerror", None) or exc)
    return HaFiles(texts, unreadable)


def node_names(root: str) -> list[str]:
    """The cluster's node directories under ``root/nodes`` (sorted; [] when there is none)."""
    nodes_dir = os.path.join(root, "nodes")
    return sorted(os.listdir(nodes_dir)) if os.path.isdir(nodes_dir) else []


def _guest_confs(root: str, node: str | None, kind: str) -> dict[int, tuple[str, str]]:
    out: dict[int, tuple[str, str]] = {}
    for n in node_names(root):
        if node and n != node:
            continue
        d = os.path.join(root, "nodes", n, kind)
        for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            if f.endswith(".conf") and f[:-5].isdigit():
                out[int(f[:-5])] = (n, read_pve(root, os.path.join("nodes", n, kind, f)))
    return out


def ct_confs(root: str, node: str | None = None) -> dict[int, tuple[str, str]]:
    """vmid -> (node, conf text) for every container (of one node, or the cluster)."""
    return _guest_confs(root, node, "lxc")


def vm_confs(root: str, node: str | None = None) -> dict[int, tuple[str, str]]:
    """vmid -> (node, conf text) for every VM (qemu-server; of one node, or the cluster)."""
    return _guest_confs(root, node, "qemu-server")


class EtcPve:
    """The PveApi reads, from a pmxcfs tree (``root``) and ``/proc/net/unix``."""

    def __init__(self, root: str = "/etc/pve", proc: str = "/proc", node: str = "", *, local_first: bool = False) -> None:
        self.root = root
        self.proc = proc
        self._node = node
        self._local_first = local_first  # where(): this node's config files first (the start gate: no json for .vmlist)

    @staticmethod
    def present(root: str = "/etc/pve") -> bool:
        """Is there a node's ``/etc/pve`` at ``root`` (its ``.vmlist``)? Raises NeedsRootError when there is one that
        this user, not root, may not read: every command on a node then says "run it as root" before reading anything
        (not "pmxcfs is down", not a guest-by-guest "config unreadable")."""
        path = os.path.join(root, ".vmlist")
        try:
            os.stat(path)
        except PermissionError:  # /etc/pve itself closed to this user
            if (denied := _denied(path)) is not None:
                raise denied from None
            return False
        except OSError:
            return False
        if os.geteuid() != 0 and not os.access(path, os.R_OK, effective_ids=os.access in os.supports_effective_ids):
            raise NeedsRootError(path, os.geteuid())
        return True

    def local_node(self) -> str | None:
        if self._node:
            return self._node
        try:
            return os.path.basename(os.readlink(os.path.join(self.root, "local")))
        except OSError:
            return os.uname().nodename.split(".")[0]

    def _vmlist(self) -> dict[str, Any]:
        try:
            doc = json.loads(read_pve(self.root, ".vmlist"))
            if not isinstance(doc, dict):
                raise ValueError(f"not a JSON object but {type(doc).__name__}")
            ids = doc.get("ids", {})
            return ids if isinstance(ids, dict) else {}
        except RecursionError:  # nested deeper than any .vmlist pmxcfs writes
            raise PveApiError(f"cannot read {self.root}/.vmlist: nested too deeply to be a guest list",
                              "is pve-cluster (pmxcfs) running? `systemctl status pve-cluster`") from None
        except (OSError, ValueError) as exc:
            raise PveApiError(f"cannot read {self.root}/.vmlist: {exc}", "is pve-cluster (pmxcfs) running? `systemctl status pve-cluster`") from exc

    def where(self, vmid: int) -> Guest | None:
        """Where ``vmid`` lives, as ``.vmlist`` says. With ``local_first``, a config of this node's (``nodes/<node>/
        lxc|qemu-server/<vmid>.conf``) answers first: pmxcfs builds ``.vmlist`` from those very files, and a vmid is
        one guest's in the whole cluster, so the answer is the same, without parsing ``.vmlist``."""
        if self._local_first and (guest := self.local_guest(vmid)) is not None:
            return guest
        entry = self._vmlist().get(str(vmid))
        if not entry:
            return None
        return Guest(vmid, str(entry.get("node", "")), str(entry.get("type", "")))

    def local_guest(self, vmid: int) -> Guest | None:
        """``vmid`` when this node's config directory holds its config (``nodes/<node>/lxc|qemu-server/<vmid>.conf``),
        else None (not here, or not known here: ``where`` then asks ``.vmlist``)."""
        node = self.local_node()
        for kind, gtype in (("lxc", "lxc"), ("qemu-server", "qemu")):
            if node and os.path.isfile(os.path.join(self.root, "nodes", node, kind, f"{vmid}.conf")):
                return Guest(vmid, node, gtype)
        return None

    def guests(self) -> list[Guest]:
        return sorted((Guest(int(k), str(v.get("node", "")), str(v.get("type", ""))) for k, v in self._vmlist().items()),
                      key=lambda g: g.vmid)

    @staticmethod
    def conf_relpath(guest: Guest) -> str:
        kind = "lxc" if guest.type == "lxc" else "qemu-server"
        return os.path.join("nodes", guest.node, kind, f"{guest.vmid}.conf")

    def conf_path(self, guest: Guest) -> str:
        return os.path.join(self.root, self.conf_relpath(guest))

    def ct_config(self, guest: Guest) -> str:
        try:
            return read_pve(self.root, self.conf_relpath(guest))
        except FileNotFoundError:
            raise NotFoundError(f"no config for CT {guest.vmid} at {self.conf_path(guest)}", "`pct list` shows the containers of this node") from None
        except OSError as exc:
            raise PveApiError(f"cannot read {self.conf_path(guest)}: {exc}", "run pvegpu as root on the node") from exc

    def running(self, vmid: int) -> bool | None:
        """Is the container running? (PVE's own test: lxc's abstract command socket exists.)"""
        try:
            with open(os.path.join(self.proc, "net", "unix"), encoding="utf-8") as f:
                return f"@/var/lib/lxc/{vmid}/command" in f.read()
        except OSError:
            return None

    def ct_status(self, guest: Guest) -> CtStatus:
        running = self.running(guest.vmid)
        lock = parse_config(self.ct_config(guest)).lock
        state = "unknown" if running is None else ("running" if running else "stopped")
        return CtStatus(state, False, lock)


class NodePve:
    """Reads from ``/etc/pve`` when on the node; power actions and remote reads through the API.

    ``api`` is a factory: the API client is built (and, for https, the token read) on the first call that
    needs it, so commands that only read on the node never touch it, and ones off the node can use it.
    """

    def __init__(self, local: EtcPve | None, api: Callable[[], Any] | None) -> None:
        self.local = local
        self._factory = api
        self._api: Any = None

    def _need_api(self, what: str) -> Any:
        if self._api is None and self._factory is not None:
            self._api = self._factory()
        if self._api is None:
            raise PveApiError(f"{what} needs the Proxmox API, and none is configured",
                              "on the node run as root (api.backend=local uses pvesh), or set api.host and an API token")
        return self._api

    def local_node(self) -> str | None:
        return self.local.local_node() if self.local else self._need_api("finding the node").local_node()

    def where(self, vmid: int) -> Guest | None:
        return self.local.where(vmid) if self.local else self._need_api("finding a guest").where(vmid)

    def guests(self) -> list[Guest]:
        return self.local.guests() if self.local else self._need_api("listing guests").guests()

    def ct_config(self, guest: Guest) -> Any:
        if self.local:
            return self.local.ct_config(guest)
        return self._need_api("reading the config").ct_config(guest)

    def ct_status(self, guest: Guest) -> CtStatus:
        if self._factory is not None or self.local is None:  # the API knows HA state; /etc/pve does not
            return self._need_api("reading the status").ct_status(guest)  # type: ignore[no-any-return]
        return self.local.ct_status(guest)

    def ct_stop(self, guest: Guest) -> str:
        return str(self._need_api("stopping a container").ct_stop(guest))

    def ct_start(self, guest: Guest) -> str:
        return str(self._need_api("starting a container").ct_start(guest))

    def task_status(self, node: str, upid: str) -> Any:
        return self._need_api("reading a task").task_status(node, upid)

    def task_log(self, node: str, upid: str, limit: int = 50) -> list[str]:
        return list(self._need_api("reading a task log").task_log(node, upid, limit))

    def wait_task(self, node: str, upid: str, *, timeout: float, what: str, progress: Any = None) -> TaskResult:
        """``pvesh get /nodes/<node>/tasks/<upid>/status`` until the task stops, through the API."""
        return self._need_api("waiting for a task").wait_task(node, upid, timeout=timeout, what=what,  # type: ignore[no-any-return]
                                                              progress=progress)


def no_pve(root: str) -> PvegpuError:
    """Why there is no Proxmox VE to read: ``/etc/pve`` empty (pmxcfs down, exit 4), or absent (not a node, exit 3)."""
    try:
        empty = os.path.isdir(root) and not os.listdir(root)
    except OSError:
        empty = False
    return PmxcfsDownError(root) if empty else NotPveNodeError(root)
