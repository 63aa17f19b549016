"""A ``pvesh`` for the side-by-side benchmark's PVE-like node: what pvegpu's local API backend calls.

pvegpu reaches Proxmox through ``pvesh <verb> <path> --output-format json`` (proxmoxer's local backend).
On a GPU host without Proxmox this stands in for the few calls a reset can make: the container's status,
stop (every process of its cgroups SIGKILLed, as ``pct stop`` ends), start (a fresh init) and the task
status of those two, which finish at once. Every call is appended to $SBS_PVESH_LOG.
"""

from __future__ import annotations

import json
import os
import re
import sys

from bench import sbs_node

_CT = re.compile(r"^/nodes/([^/]+)/lxc/(\d+)/status/(current|stop|start)$")
_TASK = re.compile(r"^/nodes/([^/]+)/tasks/([^/]+)/(status|log)$")


def route(argv: list[str]) -> tuple[str, int | str]:
    """(action, vmid or upid) for a pvesh command line; action is status|stop|start|task|log|unsupported."""
    if len(argv) < 2:
        return "unsupported", ""
    verb, path = argv[0], argv[1]
    m = _CT.match(path)
    if m:
        want = {"current": "get", "stop": "create", "start": "create"}[m.group(3)]
        if verb == want:
            return ("status" if m.group(3) == "current" else m.group(3)), int(m.group(2))
    m = _TASK.match(path)
    if m and verb == "get":
        return ("task" if m.group(3) == "status" else "log"), m.group(2)
    return "unsupported", path


def upid(kind: str, vmid: int) -> str:
    return f"UPID:sbs:{os.getpid():08X}:00000000:00000000:{kind}:{vmid}:root@pam:"


def main(argv: list[str]) -> int:
    action, what = route(argv)
    log = os.environ.get("SBS_PVESH_LOG")
    if log:
        with open(log, "a") as f:
            f.write(" ".join(argv[:2]) + "\n")
    if action == "status":
        assert isinstance(what, int)
        out: object = {"vmid": what, "status": "running" if sbs_node.find_init(what) else "stopped"}
    elif action == "stop":
        assert isinstance(what, int)
        if not sbs_node.kill_ct(what):
            print(f"500 CT {what}: processes survived the stop", file=sys.stderr)
            return 1
        out = upid("vzstop", what)
    elif action == "start":
        assert isinstance(what, int)
        sbs_node.start_ct(what, python=os.environ.get("SBS_PYTHON", sys.executable))
        out = upid("vzstart", what)
    elif action == "task":
        out = {"status": "stopped", "exitstatus": "OK", "upid": what}
    elif action == "log":
        out = [{"n": 1, "t": "TASK OK"}]
    else:
        print(f"501 not implemented in the benchmark's pvesh: {' '.join(argv)}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


def launcher(dirpath: str, repo: str, python: str = sys.executable) -> str:
    """Write an executable ``pvesh`` into dirpath (put dirpath first on pvegpu's PATH)."""
    path = os.path.join(dirpath, "pvesh")
    with open(path, "w") as f:
        f.write(f"#!{python} -I\nimport sys\nsys.path.insert(0, {repo!r})\nfrom bench.pvesh_shim import main\nsys.exit(main(sys.argv[1:]))\n")
    os.chmod(path, 0o755)
    return path
