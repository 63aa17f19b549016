"""``pvesh`` as a bounded child: the transport of the local backend (root on a PVE node).

Each call runs ``pvesh <get|create|set|delete> <path> ... --output-format json`` in its own process
group. The deadline covers the whole group: when it passes, or shortly after pvesh itself exited while
a child of it still holds the output pipe, the group is killed and the pipes are abandoned, so no
descendant of pvesh can hold pvegpu. Reads get ``api.timeout``; only the task-creating calls (stop,
start: pvesh runs those tasks synchronously) get ``reset.task_timeout``.

The exit status is checked, stderr beside a valid answer is a logged warning (Perl's "Setting locale
failed" over SSH), and output that is not UTF-8 JSON is an error naming the call. Manual equivalent:
``pvesh get /cluster/resources --type vm --output-format json; echo $?``.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pvegpu.adapters.stdlog import logger
from pvegpu.core.contract import dumps
from pvegpu.core.safetext import escape

PVESH = "pvesh"
EXIT_GRACE = 0.5  # seconds a pipe may stay open after pvesh exited (a lingering child of it)
REAP_WAIT = 1.0  # seconds to reap pvesh after the group kill
MAX_OUTPUT = 32 * 1024 * 1024  # bytes kept per stream; the rest is discarded
UPID_RE = re.compile(r"UPID:[A-Za-z0-9][A-Za-z0-9.-]*:[0-9A-Fa-f]{8}:[0-9A-Fa-f]{8,9}:[0-9A-Fa-f]{8}:[A-Za-z0-9_-]+:[^:\s]*:[^:\s]+:")
TASK_PATHS = re.compile(r"/(lxc|qemu)/\d+/status/(stop|start|shutdown|reboot)$")
_STATUS_LINE = re.compile(r"^(\d{3}) \S")
MAX_DEPTH = 64  # nesting levels of one answer (PVE's deepest is about 5); deeper is refused before parsing
# a string (to its closing quote, or to the end when it never closes: possessive, so nothing is scanned twice) or a
# bracket: one linear pass however the answer is built (an unclosed string full of \" cost quadratic time before)
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.?)*+(?:"|\Z)|[\[\]{}]', re.S)


def too_deep(data: bytes, limit: int = MAX_DEPTH) -> bool:
    """Does this JSON text nest arrays/objects deeper than ``limit``? One linear scan (strings skipped), so a
    hostile answer of 100,000 ``[`` is refused without ``json.loads`` ever recursing into it."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    depth = 0
    for m in _JSON_TOKENS.finditer(data):
        c = m.group()[:1]
        if c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif c in (b"]", b"}"):
            depth -= 1
    return False


class PveshError(Exception):
    """pvesh could not give an answer: ``detail`` says why, ``hint`` what to do. Mapped to PveApiError by the caller."""

    def __init__(self, detail: str, hint: str, unanswered: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.hint = hint
        self.unanswered = unanswered  # pvesh was killed at its deadline: what it asked for may still happen


@dataclass(frozen=True)
class Finished:
    """What a bounded child left: its output, its exit status (None when killed at the deadline); ``stuck``: it did
    not end within REAP_WAIT of the SIGKILL (in the kernel, D state) and was abandoned, not waited for."""

    stdout: bytes
    stderr: bytes
    returncode: int | None
    timed_out: bool
    stuck: bool = False


def _exited(pid: int) -> bool:
    """Has the child exited? Leaves it a zombie (WNOWAIT), so its pid (= its group id) cannot be reused yet."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def run_process_group(cmd: list[str], timeout: float, *, exit_grace: float = EXIT_GRACE, env: Mapping[str, str] | None = None) -> Finished:
    """Run ``cmd`` in a new process group; within ``timeout`` s (plus at most REAP_WAIT to reap it) the whole
    group, its children included, is killed and the pipes are closed, whatever the children do with them.

    Raises FileNotFoundError / PermissionError when the program cannot be started.
    """
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=dict(env) if env is not None else None)
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs: dict[int, bytearray] = {out_fd: bytearray(), err_fd: bytearray()}
    deadline = time.monotonic() + timeout
    exited = False
    sel = selectors.DefaultSelector()
    try:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while True:
            if not exited and _exited(proc.pid):
                exited = True
                deadline = min(deadline, time.monotonic() + exit_grace)
            left = deadline - time.monotonic()
            if left <= 0 or (not sel.get_map() and exited):
                break
            if not sel.get_map():  # pipes closed, process still running: wait for its exit
                time.sleep(min(left, 0.01))
                continue
            for key, _ in sel.select(min(left, 0.05)):
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(key.fd)
                elif len(bufs[key.fd]) < MAX_OUTPUT:
                    bufs[key.fd] += data
        timed_out = not exited
    finally:
        try:  # the leader is alive or an unreaped zombie here: the group id is still ours
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    stuck = False
    try:
        rc: int | None = proc.wait(timeout=REAP_WAIT)
    except subprocess.TimeoutExpired:  # stuck in the kernel (D state): abandoned, not waited for
        rc, stuck = None, True
    return Finished(bytes(bufs[out_fd]), bytes(bufs[err_fd]), None if timed_out else rc, timed_out, stuck)


class Response:
    """The slice of a requests.Response that proxmoxer's core reads."""

    def __init__(self, content: str, status_code: int, exit_code: int | None = None) -> None:
        self.content = content
        self.text = content
        self.status_code = status_code
        self.exit_code = exit_code
        self.headers = {"content-type": "application/json"}


def _options(data: Mapping[str, Any] | None, params: Mapping[str, Any] | None) -> list[str]:
    out: list[str] = []
    for k, v in list((data or {}).items()) + list((params or {}).items()):
        if v is None:
            continue
        if isinstance(v, (list, tuple)):  # an array parameter (agent/exec's command): one option per item, as
            out += [f"-{k}={item}" for item in v]  # -k=VALUE, so an item starting with '-' stays a value
            continue
        out += [f"-{k}", v.decode() if isinstance(v, bytes) else str(v)]
    return out


def _decode(raw: bytes, stream: str, call: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PveshError(f"`{call}` wrote {stream} that is not UTF-8 (byte {exc.start})",
                         f"run `{call}` by hand; is the node's locale or a guest name broken?") from None


def _answer(out: str, call: str, task: bool) -> Any:
    """The JSON answer. A task-creating call may print the task log before the UPID: the UPID is taken then."""
    text = out.strip()
    if too_deep(text.encode("utf-8", "replace")):
        raise PveshError(f"`{call}` answered JSON nested deeper than {MAX_DEPTH} levels", f"run `{call}` by hand; is this PVE's pvesh?")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    if task:
        for line in reversed(text.splitlines()):
            m = UPID_RE.search(line)
            if m:
                return m.group(0)
    shown = text[:120] + ("..." if len(text) > 120 else "")
    raise PveshError(f"`{call}` did not answer JSON: {shown!r}" if text else f"`{call}` answered nothing",
                     f"run `{call}` by hand to see what it prints")


class PveshSession:
    """A proxmoxer session (``api._store["session"]``) that runs pvesh bounded and checks what it says."""

    def __init__(self, read_timeout: float, task_timeout: float | None = None, program: str = PVESH) -> None:
        self.read_timeout = read_timeout
        self.task_timeout = task_timeout if task_timeout is not None else read_timeout
        self.program = program
        self.timeout = read_timeout  # proxmoxer reads this attribute

    def request(self, method: str, url: str, data: Mapping[str, Any] | None = None, params: Mapping[str, Any] | None = None,
                headers: Any = None) -> Response:
        verb = {"get": "get", "post": "create", "put": "set", "delete": "delete"}[method.lower()]
        path = url.strip()
        cmd = [self.program, verb, path, *_options(data, params), "--output-format", "json"]
        call = f"pvesh {verb} {path}"
        task = verb == "create" and bool(TASK_PATHS.search(path.rstrip("/")))
        timeout = self.task_timeout if task else self.read_timeout
        try:
            done = run_process_group(cmd, timeout)
        except FileNotFoundError:
            raise PveshError(f"`{self.program}` not found: the local backend runs pvesh as root on a PVE node",
                             "run pvegpu on the PVE node itself, or use the HTTPS API from elsewhere "
                             "(api.backend = \"https\", api.host and an API token; README 'API token')") from None
        except PermissionError as exc:
            raise PveshError(f"cannot run `{self.program}`: {exc.strerror}", "run pvegpu as root on the PVE node") from None
        if done.timed_out:
            raise PveshError(f"`{call}` did not finish within {timeout:g} s (killed with its process group)",
                             "raise reset.task_timeout; is the container stuck? (`pct status VMID`)" if task
                             else "raise api.timeout; is pvedaemon healthy? (`systemctl status pvedaemon`)", unanswered=True)
        err = done.stderr.decode("utf-8", "replace").strip()
        if done.returncode != 0:
            status = next((int(m.group(1)) for m in map(_STATUS_LINE.match, err.splitlines()) if m), 500)
            text = err or done.stdout.decode("utf-8", "replace").strip() or f"pvesh exited with status {done.returncode}"
            return Response(text, status, done.returncode)
        answer = _answer(_decode(done.stdout, "output", call), call, task)
        if err:
            _warn(call, err)
        return Response(dumps(answer), 200, 0)


def _warn(call: str, err: str) -> None:
    logger().warning("pvesh %s wrote to stderr (its answer is used): %s", call, escape(err.replace("\n", " | "), 500))
