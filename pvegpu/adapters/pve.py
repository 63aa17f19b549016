"""The Proxmox VE API through proxmoxer: the only module that imports proxmoxer or requests.

Two transports, as proxmoxer offers them: ``https`` with an API token (TLS verified by default, or a
pinned certificate fingerprint), and ``local`` (``pvesh`` as root on the node, bounded: adapters/pvesh.py).
Every answer's shape is checked before use (adapters/answers.py). Foreign errors become PveApiError
naming the call, the cause and a hint; the cause is kept.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import requests
from proxmoxer import AuthenticationError, ProxmoxAPI, ResourceException
from requests.adapters import HTTPAdapter
from requests.exceptions import ChunkedEncodingError, ReadTimeout
from requests.utils import get_environ_proxies
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import ReadTimeoutError

from pvegpu.adapters import answers
from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.pvesh import MAX_DEPTH, PveshError, PveshSession, too_deep
from pvegpu.adapters.tasks import wait_task
from pvegpu.core.errors import ConfigError, NotFoundError, PveApiError, PveNoAnswer
from pvegpu.core.model import CtStatus, Guest, TaskResult
from pvegpu.core.ports import Clock
from pvegpu.core.safetext import escape
from pvegpu.core.settings import ApiSettings


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


def connect(cfg: ApiSettings, backend: str, task_timeout: float | None = None) -> Any:
    """A proxmoxer ProxmoxAPI for the settings (backend already resolved to local or https).

    Local: reads are bounded by ``cfg.timeout``, stop/start (synchronous under pvesh) by ``task_timeout``.
    """
    if backend == "local":
        api = ProxmoxAPI(backend="local", timeout=cfg.timeout)
        api._store["session"] = PveshSession(cfg.timeout, task_timeout)
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
    else:
        api._store["session"].mount("https://", _bounded_adapter()())
    return api


MAX_ANSWER = 32 * 1024 * 1024  # bytes of one API answer (the biggest real one, /cluster/resources, is far smaller)


def _bounded_adapter() -> Any:
    """An HTTPAdapter whose answers are bounded in total time and size, not just per socket read: a server that
    drips its answer a byte at a time, or sends gigabytes, costs at most ``timeout`` (twice) and 32 MiB."""
    class Bounded(HTTPAdapter):
        def send(self, request: Any, stream: bool = False, timeout: Any = None, verify: Any = True, cert: Any = None,
                 proxies: Any = None) -> Any:
            resp = super().send(request, stream=True, timeout=timeout, verify=verify, cert=cert, proxies=proxies)
            limit = sum(t or 0 for t in timeout) if isinstance(timeout, tuple) else float(timeout or 30)
            deadline, size, chunks = time.monotonic() + limit, 0, []
            try:
                while chunk := resp.raw.read1(65536, decode_content=True):  # what has arrived, not a full 64 KiB
                    size += len(chunk)
                    if size > MAX_ANSWER:
                        raise ChunkedEncodingError(f"answer larger than {MAX_ANSWER >> 20} MiB")
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise ReadTimeout(f"Read timed out. (the whole answer took longer than {limit:g} s)")
            except ReadTimeoutError as exc:  # urllib3's own errors mid-body: requests' (OSError) ones, named
                resp.close()
                raise ReadTimeout(f"Read timed out in the middle of the answer ({exc})") from None
            except Urllib3Error as exc:
                resp.close()
                raise ChunkedEncodingError(f"answer cut off: {type(exc).__name__}: {exc}") from None
            except OSError as exc:
                resp.close()
                if isinstance(exc, (ChunkedEncodingError, ReadTimeout, requests.exceptions.ConnectionError)):
                    raise
                raise ChunkedEncodingError(f"answer cut off: {type(exc).__name__}: {exc}") from None
            except BaseException:
                resp.close()
                raise
            content = b"".join(chunks)
            if too_deep(content):
                raise ChunkedEncodingError(f"answer nested deeper than {MAX_DEPTH} levels")
            resp._content, resp._content_consumed = content, True
            return resp

    return Bounded


def _pin(api: Any, fp: str) -> None:
    """Every connection of the session checks the server certificate's SHA-256 against ``fp`` before a byte
    (and so the token header) is sent, whatever URL form proxmoxer built for the host (``[::1]``, ``host:port``).

    A proxy from the environment would get a connection the pin never sees, so pinning refuses one."""
    session = api._store["session"]
    base = api._store["base_url"]
    proxy = get_environ_proxies(base) or session.proxies
    if proxy:
        raise ConfigError(f"api.fingerprint is set but a proxy would carry the connection to {base.split('/api2')[0]} "
                          f"({', '.join(sorted(proxy))}_proxy): the pin cannot be checked through it",
                          "add api.host to no_proxy, unset https_proxy for pvegpu, or use api.verify with the node's CA file")
    session.trust_env = False  # no proxy, netrc or CA bundle from the environment on the pinned session

    class Pinned(_bounded_adapter()):  # type: ignore[misc]
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


_PERMISSION = re.compile(r"Permission check failed \(([^,()]+),\s*([^()]+)\)")
_CA_PATH = re.compile(r"invalid path: (.+)$")
_DNS = ("Name or service not known", "Temporary failure in name resolution", "NameResolutionError", "Failed to resolve",
        "nodename nor servname", "No address associated with hostname")
_TLS_HINT = ("set api.verify to the node's CA file (copy /etc/pve/pve-root-ca.pem from the node) "
             "or pin api.fingerprint (`pvenode cert info` on the node)")


def _transport(exc: Exception, target: str, timeout: float | None) -> tuple[str, str]:
    """(cause, hint) for a requests/urllib3 error, by kind: the hint matches the cause."""
    text = str(exc)
    secs = f"{timeout:g} s" if timeout else "api.timeout"
    if "Fingerprints did not match" in text:
        return (f"TLS certificate of {target} does not match api.fingerprint",
                "the node's certificate changed, or this is not the node: compare `pvenode cert info` on the node, then update api.fingerprint")
    if isinstance(exc, requests.exceptions.SSLError) or "CERTIFICATE_VERIFY_FAILED" in text:
        return f"TLS verification of {target} failed", _TLS_HINT
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return (f"connecting to {target} timed out after {secs}",
                "is api.host right and port 8006 open (firewall)? `curl -k https://HOST:8006/` from here")
    if isinstance(exc, requests.exceptions.ReadTimeout):
        return (f"{target} did not answer within {secs}",
                "raise api.timeout; is pveproxy/pvedaemon healthy on the node? (`systemctl status pveproxy pvedaemon`)")
    if any(s in text for s in _DNS):
        return f"cannot resolve the host name of {target}", "check api.host (a name this machine can resolve, or the node's IP address)"
    if "Connection refused" in text or "Errno 111" in text:
        return f"connection to {target} refused", "check api.host and api.port (8006); is pveproxy running? (`systemctl status pveproxy`)"
    if "nested deeper than" in text:
        return f"{target} sent an answer nested deeper than {MAX_DEPTH} levels", "is this a Proxmox VE API? check api.host and api.port"
    if "answer cut off" in text or "IncompleteRead" in text:
        return (f"{target} closed the connection in the middle of its answer",
                "retry; if it persists, see `journalctl -u pveproxy` on the node, or a proxy in between")
    if "answer larger than" in text:
        return f"{target} sent an answer larger than {MAX_ANSWER >> 20} MiB", "is this a Proxmox VE API? check api.host and api.port"
    if "RemoteDisconnected" in text or "Connection reset" in text or "Connection aborted" in text:
        return f"{target} closed the connection", "retry; if it persists, see `journalctl -u pveproxy` on the node"
    return f"cannot reach {target}: {type(exc).__name__}", "check api.host and api.port, and the network between here and the node"


def _maybe_sent(exc: Exception) -> bool:
    """Could the request have reached PVE? Not when the connection was never made (refused, DNS, connect
    timeout, TLS); yes when the answer did not come (read timeout, connection dropped)."""
    text = str(exc)
    if isinstance(exc, (requests.exceptions.ConnectTimeout, requests.exceptions.SSLError)) or "CERTIFICATE_VERIFY_FAILED" in text:
        return False
    return not (any(s in text for s in _DNS) or "Connection refused" in text or "Errno 111" in text or "Fingerprints did not match" in text)


def _forbidden(content: str) -> tuple[str, str]:
    """A 403: the privilege and path PVE names ("Permission check failed (/vms/129, VM.PowerMgmt)")."""
    m = _PERMISSION.search(content)
    if not m:
        return (f"403 {content}", "the token lacks a privilege: VM.Audit, VM.PowerMgmt, Sys.Audit (README 'API token')")
    path, priv = m.group(1).strip(), m.group(2).strip()
    return (f"403 permission denied: the API token lacks {priv} on {path}",
            f"grant it: `pveum acl modify {path} --tokens USER@REALM!TOKEN --roles ROLE` with a role holding {priv} "
            "(or a token without privilege separation); README 'API token'")


class ProxmoxerPve:
    """PveApi over proxmoxer. ``api`` is a ProxmoxAPI (tests pass one pointing at fakepve)."""

    def __init__(self, api: Any, node: str = "") -> None:
        self.api = api
        self._node = node

    @property
    def target(self) -> str:
        """host:port of the HTTPS API, or "pvesh" for the local backend (for messages)."""
        base = str(getattr(self.api, "_store", {}).get("base_url", ""))
        if not base:
            return "pvesh"
        u = urlsplit(base)
        return f"{u.hostname}:{u.port or 8006}"

    def _call(self, what: str, fn: Callable[[], Any], check: Callable[[Any], Any] | None = None) -> Any:
        """Run one API call and check the answer's shape (``check``, from answers.py); every failure is a
        PveApiError (a missing CA file: ConfigError) naming ``what``."""
        try:
            answer = fn()
        except ResourceException as exc:
            content = escape(str(exc.content).strip() or str(exc.status_message or ""), 500)  # the server's text
            if exc.status_code == 403:
                msg, hint = _forbidden(content)
                raise PveApiError(f"{what}: {msg}", hint) from exc
            hint = {401: "check the API token (api.user, api.token_name, api.token_file)",
                    595: "the node is offline or unreachable (`pvecm status`)"}.get(exc.status_code, "see the Proxmox task log or `journalctl -u pvedaemon`")
            raise PveApiError(f"{what}: {exc.status_code} {content}", hint) from exc
        except AuthenticationError as exc:
            raise PveApiError(f"{what}: authentication failed ({exc})", "check api.user / api.token_name / api.token_file") from exc
        except PveshError as exc:
            raise (PveNoAnswer if exc.unanswered else PveApiError)(f"{what}: {exc.detail}", exc.hint) from exc
        except (KeyError, TypeError, ValueError, RecursionError) as exc:  # proxmoxer's json.loads(...)["data"] on a bad answer
            why = ("has no 'data' member" if isinstance(exc, KeyError) else "is not a JSON object" if isinstance(exc, TypeError)
                   else "is nested too deeply" if isinstance(exc, RecursionError) else "is not JSON")
            raise PveApiError(f"{what}: unexpected answer from {self.target}: the answer {why}",
                              "is this a Proxmox VE API (or a proxy in front of it)? run the call by hand (`pvesh get ...`)") from None
        except OSError as exc:  # requests' ConnectionError/SSLError/Timeout derive from OSError via IOError
            m = _CA_PATH.search(str(exc))
            if m and "CA certificate bundle" in str(exc):
                raise ConfigError(f"api.verify: CA file {m.group(1).strip()} not found",
                                  "copy /etc/pve/pve-root-ca.pem from the node there, or pin api.fingerprint") from exc
            cause, hint = _transport(exc, self.target, _timeout(self.api))
            raise (PveNoAnswer if _maybe_sent(exc) else PveApiError)(f"{what}: {cause}", hint) from exc
        try:
            answers.decoded(answer)
            return answer if check is None else check(answer)
        except answers.BadAnswer as exc:
            raise PveApiError(f"{what}: unexpected answer from {self.target}: {exc}",
                              "is this a Proxmox VE node of a supported version? run the call by hand (`pvesh get ...`)") from exc

    def local_node(self) -> str | None:
        return self._node or None

    def guests(self) -> list[Guest]:
        """``pvesh get /cluster/resources --type vm``: only the guests the token may see (VM.Audit)."""
        rows = self._call("list guests", lambda: self.api.cluster.resources.get(type="vm"), answers.resources)
        return sorted((Guest(vmid, node, kind, name) for vmid, node, kind, name in rows), key=lambda g: g.vmid)

    def where(self, vmid: int) -> Guest | None:
        """The guest's row; absent from the API's answer raises NotFoundError saying it may be a missing VM.Audit."""
        found = next((g for g in self.guests() if g.vmid == vmid), None)
        if found is not None or self.target == "pvesh":  # pvesh runs as root@pam: it sees every guest
            return found
        privs = self._privileges(f"/vms/{vmid}")
        if privs is None:
            raise NotFoundError(f"no guest {vmid} visible to the API token at {self.target}",
                                f"the guest does not exist, or the token lacks VM.Audit on /vms/{vmid} "
                                "(/cluster/resources leaves out guests the token may not see): "
                                "`pveum user token permissions USER@REALM TOKEN` on the node; README 'API token'")
        if "VM.Audit" not in privs:
            raise PveApiError(f"guest {vmid} is not visible: the API token lacks VM.Audit on /vms/{vmid}",
                              f"grant it: `pveum acl modify /vms/{vmid} --tokens USER@REALM!TOKEN --roles PVEAuditor` "
                              "(plus VM.PowerMgmt for restarts); README 'API token'")
        return None

    def _privileges(self, path: str) -> set[str] | None:
        """``pvesh get /access/permissions --path P``: the token's privileges on path (None when unreadable)."""
        try:
            held = self._call("read the token's permissions", lambda: self.api.access.permissions.get(path=path), answers.obj)
        except PveApiError:
            return None
        privs: set[str] = set()
        for p, granted in held.items():
            if (p == "/" or path == p or path.startswith(p.rstrip("/") + "/")) and isinstance(granted, dict):
                privs.update(k for k, v in granted.items() if v)
        return privs

    def _ct(self, guest: Guest) -> Any:
        return self.api.nodes(guest.node).lxc(guest.vmid)

    def ct_config(self, guest: Guest) -> Mapping[str, Any]:
        """``pvesh get /nodes/<node>/lxc/<vmid>/config --current 1``."""
        return self._call(f"read CT {guest.vmid} config", lambda: self._ct(guest).config.get(current=1), answers.ct_config)

    def ct_status(self, guest: Guest) -> CtStatus:
        """``pvesh get /nodes/<node>/lxc/<vmid>/status/current``."""
        status, managed, lock, ha_state = self._call(f"read CT {guest.vmid} status", lambda: self._ct(guest).status.current.get(),
                                                     lambda a: answers.ct_status(a, guest.vmid))
        return CtStatus(status, managed, lock, ha_state)

    def ct_stop(self, guest: Guest) -> str:
        """``pvesh create /nodes/<node>/lxc/<vmid>/status/stop``: the task's UPID."""
        return self._call(f"stop CT {guest.vmid}", lambda: self._ct(guest).status.stop.post(), answers.upid)

    def ct_start(self, guest: Guest) -> str:
        """``pvesh create /nodes/<node>/lxc/<vmid>/status/start``: the task's UPID."""
        return self._call(f"start CT {guest.vmid}", lambda: self._ct(guest).status.start.post(), answers.upid)

    def task_status(self, node: str, upid: str) -> Mapping[str, Any]:
        """``pvesh get /nodes/<node>/tasks/<upid>/status``."""
        return self._call("read task status", lambda: self.api.nodes(node).tasks(upid).status.get(), lambda a: answers.task_status(a, upid))

    def task_log(self, node: str, upid: str, limit: int = 50) -> list[str]:
        """``pvesh get /nodes/<node>/tasks/<upid>/log --start 0 --limit N``."""
        return self._call("read task log", lambda: self.api.nodes(node).tasks(upid).log.get(start=0, limit=limit), answers.task_log)

    def wait_task(self, node: str, upid: str, *, timeout: float, what: str, clock: Clock | None = None, progress: Any = None) -> TaskResult:
        """``pvesh get /nodes/<node>/tasks/<upid>/status`` until it stops (bounded); TaskFailed/TaskTimeout with the log tail."""
        return wait_task(lambda: self.task_status(node, upid), lambda: self.task_log(node, upid), clock or SystemClock(),
                         node=node, upid=upid, timeout=timeout, what=what, progress=progress)

    def snippets(self, node: str, storage: str) -> set[str]:
        """``pvesh get /nodes/<node>/storage/<storage>/content --content snippets``: file names there."""
        volids = self._call(f"list snippets on {node}", lambda: self.api.nodes(node).storage(storage).content.get(content="snippets"),
                            answers.storage_content)
        return {v.split("snippets/", 1)[-1] for v in volids}


def _timeout(api: Any) -> float | None:
    """The configured timeout: on the pvesh session, or on the https session's auth (proxmoxer keeps it there)."""
    session = api._store.get("session")
    t = getattr(session, "timeout", None)
    if t is None:
        t = getattr(getattr(session, "auth", None), "timeout", None)
    if isinstance(t, tuple):
        t = t[-1]
    return float(t) if isinstance(t, (int, float)) else None
