"""Other nodes' audits over the root SSH trust PVE sets up between cluster nodes.

Manual equivalent: ``ssh -o BatchMode=yes -o HostKeyAlias=<node> root@<ip> pvegpu audit --json``.
All nodes are asked at once; each answer has a deadline and a size bound (the ssh process is killed past
either), is parsed with a bound on nesting, and whatever of it is shown (ssh's last error line) is escaped.
Another node is remote: one that answers garbage, endlessly or with escape sequences is one error row.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pvegpu.audit.cluster import MAX_DEPTH, Member, depth_exceeds
from pvegpu.core.safetext import escape

REMOTE_COMMAND = "pvegpu audit --json"
EXIT_ATTENTION = 8  # the remote audit's "needs attention": a normal answer
EXIT_NOT_FOUND = 127  # the remote shell found no pvegpu
MAX_ANSWER = 8 * 1024 * 1024  # bytes of one node's audit document (a few hundred KiB on a big node)
MAX_STDERR = 64 * 1024  # bytes of ssh's stderr kept (its last line is shown)


class SshAudits:
    """``Fetch`` for ``audit_cluster``: node name -> its audit document, or one line saying why not."""

    def __init__(self, timeout: float = 30.0, connect_timeout: float = 5.0, options: Sequence[str] = (),
                 command: str = REMOTE_COMMAND, user: str = "root", ssh: str = "ssh") -> None:
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.options = list(options)
        self.command = command
        self.user = user
        self.ssh = ssh

    def argv(self, m: Member) -> list[str]:
        return [self.ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(self.connect_timeout))}", "-o", f"HostKeyAlias={m.name}",
                *self.options, f"{self.user}@{m.ip or m.name}", self.command]

    def one(self, m: Member) -> Mapping[str, Any] | str:
        where = f"ssh root@{m.ip or m.name}"
        try:
            p = subprocess.Popen(self.argv(m), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            return f"cannot run ssh: {exc.strerror or exc}"
        try:
            outcome, out, err = _collect(p, self.timeout)
        finally:
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()
        if outcome == "timeout":
            return f"no answer within {self.timeout:g} s ({where})"
        if outcome == "big":
            return f"answer larger than {MAX_ANSWER >> 20} MiB ({where})"
        lines = err.decode("utf-8", "replace").strip().splitlines()
        last = escape(lines[-1] if lines else "", 200)
        if p.returncode == 255:
            return f"{where} failed: {last or 'connection error'}"
        if p.returncode == EXIT_NOT_FOUND:
            return f"pvegpu is not installed there ({last})"
        if p.returncode not in (0, EXIT_ATTENTION):
            return f"pvegpu audit there exited {p.returncode}: {last}"
        return parse_answer(out)

    def __call__(self, members: list[Member]) -> dict[str, Mapping[str, Any] | str]:
        if not members:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(members))) as pool:
            return dict(zip((m.name for m in members), pool.map(self.one, members)))


def parse_answer(data: bytes) -> Mapping[str, Any] | str:
    """A node's answer as a JSON object, or why not (not UTF-8, not JSON, nested deeper than MAX_DEPTH)."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return "answer is not JSON (or nested too deep)"
    if not isinstance(doc, dict):
        return "answer is not a JSON object"
    if depth_exceeds(doc, MAX_DEPTH):
        return f"answer is nested deeper than {MAX_DEPTH} levels"
    return doc


def _collect(p: subprocess.Popen[bytes], timeout: float) -> tuple[str, bytes, bytes]:
    """Read stdout (at most MAX_ANSWER) and stderr (its last MAX_STDERR bytes) until both end: ("ok" | "timeout" | "big", out, err)."""
    assert p.stdout is not None and p.stderr is not None
    end = time.monotonic() + timeout
    out: list[bytes] = []
    size = 0
    err = b""
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        sel.register(p.stderr, selectors.EVENT_READ)
        while sel.get_map():
            left = end - time.monotonic()
            if left <= 0:
                return "timeout", b"", b""
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.fileobj is p.stdout:
                    size += len(chunk)
                    if size > MAX_ANSWER:
                        return "big", b"", b""
                    out.append(chunk)
                else:
                    err = (err + chunk)[-MAX_STDERR:]
    left = end - time.monotonic()
    try:
        p.wait(max(0.0, left))
    except subprocess.TimeoutExpired:
        return "timeout", b"", b""
    return "ok", b"".join(out), err
