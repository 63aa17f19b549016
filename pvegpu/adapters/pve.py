"""The Proxmox VE API through proxmoxer: the only module that imports proxmoxer or requests.

Two transports, as proxmoxer offers them: ``https`` with an API token (TLS verified by default, or a
pinned certificate fingerprint), and ``local`` (``pvesh`` as root on the node), whose child is killed
when it outlives its timeout. Foreign errors become PveApiError with a hint, keeping the cause.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..errors import ConfigError, PveApiError
from ..model import CtStatus, Guest
from ..settings import ApiSettings

T = TypeVar("T")


def read_token(path: str) -> str:
    """The token secret from a regular file owned by root (or by the running user) with mode 0600.

    Manual equivalent: ``stat -c '%F %u %a' /etc/pvegpu/token`` says ``regular file 0 600``. The file is
    opened without following a symlink and checked on the open descriptor (no stat-then-open race)."""
    fix = f"`install -m 600 -o root /dev/stdin {path}` and paste the secret"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise ConfigError(f"api.token_file {path}: {why}", fix) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"api.token_file {path} is not a regular file", fix)
        if st.st_uid not in (0, os.geteuid()):
            raise ConfigError(f"api.token_file {path} is owned by uid {st.st_uid}, not root", f"chown root {path}")
        if stat.S_IMODE(st.st_mode) != 0o600:
            raise ConfigError(f"api.token_file {path} has mode {stat.S_IMODE(st.st_mode):o}, not 600 (readable by others or executable)",
                              f"chmod 600 {path}")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        secret = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"api.token_file {path} is not UTF-8 text", "put the token's secret (a UUID) in it") from None
    if not secret:
        raise ConfigError(f"api.token_file {path} is empty", "put the token's secret (a UUID) in it")
    if any(c.isspace() or not c.isprintable() for c in secret):
        raise ConfigError(f"api.token_file {path} holds more than one line or control characters", "put only the token's secret (a UUID) in it")
    return secret


def _killing_local_session(timeout: float) -> Any:
    from proxmoxer.backends.local import LocalSession

    class KillingLocalSession(LocalSession):  # type: ignore[misc]
        """proxmoxer's pvesh session, but a pvesh that outlives the timeout is killed, not orphaned."""

        def _exec(self, cmd: list[str]) -> tuple[str, str, int]:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
            try:
                out, err = proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
            return out.decode(), err.decode(), proc.returncode

    return KillingLocalSession(timeout=timeout)


def connect(cfg: ApiSettings, backend: str) -> Any:
    """A proxmoxer ProxmoxAPI for the settings (backend already resolved to local or https)."""
    from proxmoxer import ProxmoxAPI

    if backend == "local":
        api = ProxmoxAPI(backend="local", timeout=cfg.timeout)
        api._store["session"] = _killing_local_session(cfg.timeout)
        return api
    if not cfg.host or not cfg.token_name or not cfg.token_file:
        raise ConfigError("the https API needs api.host, api.token_name and api.token_file",
                          "create a privilege-separated token with its own ACLs: "
                          "`pveum user token add root@pam pvegpu --privsep 1`; see README 'API token'")
    verify: bool | str = cfg.verify
    if str(cfg.verify).lower() in ("true", "1", "yes"):
        verify = True
    elif str(cfg.verify).lower() in ("false", "0", "no"):
        verify = False
    fp = ""
    if cfg.fingerprint:
        fp = cfg.fingerprint.replace(":", "").strip().lower()
        if len(fp) != 64 or not all(c in "0123456789abcdef" for c in fp):
            raise ConfigError(f"api.fingerprint {cfg.fingerprint!r} is not a SHA-256 fingerprint (64 hex digits)",
                              "on the node: `openssl x509 -in /etc/pve/local/pve-ssl.pem -noout -fingerprint -sha256`")
        verify = False  # the pinned fingerprint replaces CA verification (checked on every connection by _pin)
    api = ProxmoxAPI(cfg.host, port=cfg.port, user=cfg.user, token_name=cfg.token_name,
                     token_value=read_token(cfg.token_file), verify_ssl=verify, timeout=cfg.timeout)
    if fp:
        _pin(api, fp)
    return api


def _pin(api: Any, fp: str) -> None:
    """Every connection of the session checks the server certificate's SHA-256 against ``fp`` before a byte
    (and so the token header) is sent, whatever URL form proxmoxer built for the host (``[::1]``, ``host:port``).

    A proxy from the environment would get a connection the pin never sees, so pinning refuses one."""
    from requests.adapters import HTTPAdapter
    from requests.utils import get_environ_proxies

    session = api._store["session"]
    base = api._store["base_url"]
    proxy = get_environ_proxies(base) or session.proxies
    if proxy:
        raise ConfigError(f"api.fingerprint is set but a proxy would carry the connection to {base.split('/api2')[0]} "
                          f"({', '.join(sorted(proxy))}_proxy): the pin cannot be checked through it",
                          "add api.host to no_proxy, unset https_proxy for pvegpu, or use api.verify with the node's CA file")
    session.trust_env = False  # no proxy, netrc or CA bundle from the environment on the pinned session

    class Pinned(HTTPAdapter):
        def init_poolmanager(self, *a: Any, **kw: Any) -> Any:
            kw["assert_fingerprint"] = fp
            return super().init_poolmanager(*a, **kw)

        def proxy_manager_for(self, *a: Any, **kw: Any) -> Any:
            raise ConfigError("a proxy was configured on the pinned API session", "remove the proxy")

    class Refused(HTTPAdapter):
        def send(self, request: Any, *a: Any, **kw: Any) -> Any:
            raise ConfigError(f"refusing to send the API token over plain HTTP ({request.url})", "use https")

    session.mount("https://", Pinned())  # every https URL: no host-form prefix the pin could miss
    session.mount("http://", Refused())


class ProxmoxerPve:
    """PveApi over proxmoxer. ``api`` is a ProxmoxAPI (tests pass one pointing at fakepve)."""

    def __init__(self, api: Any, node: str = "") -> None:
        self.api = api
        self._node = node

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        from proxmoxer import AuthenticationError, ResourceException

        try:
            return fn()
        except ResourceException as exc:
            content = str(exc.content).strip()
            hint = {401: "check the API token (api.token_name / api.token_file)",
                    403: "the token lacks a privilege: VM.Audit, VM.PowerMgmt, Sys.Audit (README 'API token')",
                    595: "the node is offline or unreachable (`pvecm status`)"}.get(exc.status_code, "see the Proxmox task log or `journalctl -u pvedaemon`")
            raise PveApiError(f"{what}: {exc.status_code} {content}", hint) from exc
        except AuthenticationError as exc:
            raise PveApiError(f"{what}: authentication failed ({exc})", "check api.user / api.token_name / api.token_file") from exc
        except subprocess.TimeoutExpired as exc:
            raise PveApiError(f"{what}: pvesh did not answer within {exc.timeout} s (killed)", "raise api.timeout; is pvedaemon healthy?") from exc
        except OSError as exc:  # requests' ConnectionError/SSLError derive from OSError via IOError
            hint = "check api.host/api.port and the certificate (api.verify = CA file, or api.fingerprint)"
            if "CERTIFICATE_VERIFY_FAILED" in str(exc) or "fingerprint" in str(exc).lower():
                hint = "TLS verification failed: set api.verify to the node's CA file (/etc/pve/pve-root-ca.pem) or pin api.fingerprint"
            raise PveApiError(f"{what}: cannot reach the API: {type(exc).__name__}", hint) from exc

    def local_node(self) -> str | None:
        return self._node or None

    def guests(self) -> list[Guest]:
        rows = self._call("list guests", lambda: self.api.cluster.resources.get(type="vm"))
        return sorted((Guest(int(r["vmid"]), str(r.get("node", "")), str(r.get("type", "")), str(r.get("name", "")))
                       for r in rows if "vmid" in r), key=lambda g: g.vmid)

    def where(self, vmid: int) -> Guest | None:
        return next((g for g in self.guests() if g.vmid == vmid), None)

    def _ct(self, guest: Guest) -> Any:
        return self.api.nodes(guest.node).lxc(guest.vmid)

    def ct_config(self, guest: Guest) -> Mapping[str, Any]:
        return dict(self._call(f"read CT {guest.vmid} config", lambda: self._ct(guest).config.get(current=1)))

    def ct_status(self, guest: Guest) -> CtStatus:
        st = self._call(f"read CT {guest.vmid} status", lambda: self._ct(guest).status.current.get())
        ha = st.get("ha") or {}
        return CtStatus(str(st.get("status", "unknown")), bool(int(ha.get("managed", 0) or 0)), st.get("lock") or None)

    def ct_stop(self, guest: Guest) -> str:
        return str(self._call(f"stop CT {guest.vmid}", lambda: self._ct(guest).status.stop.post()))

    def ct_start(self, guest: Guest) -> str:
        return str(self._call(f"start CT {guest.vmid}", lambda: self._ct(guest).status.start.post()))

    def task_status(self, node: str, upid: str) -> Mapping[str, Any]:
        return dict(self._call("read task status", lambda: self.api.nodes(node).tasks(upid).status.get()))

    def task_log(self, node: str, upid: str, limit: int = 50) -> list[str]:
        rows = self._call("read task log", lambda: self.api.nodes(node).tasks(upid).log.get(start=0, limit=limit))
        return [str(r.get("t", "")) for r in rows]

    def snippets(self, node: str, storage: str) -> set[str]:
        """``pvesh get /nodes/<node>/storage/<storage>/content --content snippets``: file names there."""
        rows = self._call(f"list snippets on {node}", lambda: self.api.nodes(node).storage(storage).content.get(content="snippets"))
        return {str(r.get("volid", "")).split("snippets/", 1)[-1] for r in rows}
