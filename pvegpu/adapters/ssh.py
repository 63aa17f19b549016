"""Other nodes' audits over the root SSH trust PVE sets up between cluster nodes.

Manual equivalent: ``ssh -o BatchMode=yes -o HostKeyAlias=<node> root@<ip> pvegpu audit --json``.
All nodes are asked at once; each answer has a deadline (the ssh process is killed past it).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..cluster import Member

REMOTE_COMMAND = "pvegpu audit --json"
EXIT_ATTENTION = 8  # the remote audit's "needs attention": a normal answer
EXIT_NOT_FOUND = 127  # the remote shell found no pvegpu


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
        try:
            p = subprocess.run(self.argv(m), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            return f"no answer within {self.timeout:g} s (ssh root@{m.ip or m.name})"
        except OSError as exc:
            return f"cannot run ssh: {exc.strerror or exc}"
        last = (p.stderr.strip().splitlines() or [""])[-1][:200]
        if p.returncode == 255:
            return f"ssh root@{m.ip or m.name} failed: {last or 'connection error'}"
        if p.returncode == EXIT_NOT_FOUND:
            return f"pvegpu is not installed there ({last})"
        if p.returncode not in (0, EXIT_ATTENTION):
            return f"pvegpu audit there exited {p.returncode}: {last}"
        try:
            doc = json.loads(p.stdout)
        except ValueError:
            return "answer is not JSON"
        return doc if isinstance(doc, dict) else "answer is not a JSON object"

    def __call__(self, members: list[Member]) -> dict[str, Mapping[str, Any] | str]:
        if not members:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(members))) as pool:
            return dict(zip((m.name for m in members), pool.map(self.one, members)))
