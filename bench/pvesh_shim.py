"""A ``pvesh`` for the side-by-side benchmark's PVE-like node: what pvegpu's local API backend calls.

pvegpu reaches Proxmox through ``pvesh <verb> <path> --output-format json`` (proxmoxer's local backend).
On a GPU host without Proxmox this stands in for the few calls a reset can make: the container's status,
stop (every process of its cgroups SIGKILLed, as ``pct stop`` ends), start (a fresh init) and the task
status of those two, which finish at once. Every call is appended to $SBS_PVESH_LOG.

As PVE's start does, where set: $SBS_PVE_ROOT (a PVE-like /etc/pve) names the container's config, and an application
container's ``entrypoint`` is started as its PID 1 again; $SBS_PVESH_HOOK (a hookscript) runs ``<hook> <vmid>
pre-start`` first as PVE runs it (its environment plus $PVEGPU_CONFIG), and a refusal fails the start task with PVE's
wording and starts nothing. With $SBS_PVESH_TASKS (a directory) each stop/start task is kept there as JSON
(exitstatus, log, the hook's exit status, when it ended), which the task status and log calls answer from.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

from bench import sbs_node
from pvegpu.core.lxcconf import parse_config
from tests.pvelike import run_as_pve

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
    return f"UPID:sbs:{os.getpid():08X}:{time.monotonic_ns() // 10_000_000 % (1 << 32):08X}:{int(time.time()):08X}:{kind}:{vmid}:root@pam:"


def entrypoint(vmid: int) -> tuple[str, ...]:
    """The application container's entrypoint from its config under $SBS_PVE_ROOT (empty: a system init, or no tree)."""
    root = os.environ.get("SBS_PVE_ROOT")
    if not root:
        return ()
    with open(os.path.join(root, "local", "lxc", f"{vmid}.conf")) as f:
        conf = parse_config(f.read())
    return conf.entrypoint if conf.app and conf.entrypoint else ()


def _task_file(task: str) -> str | None:
    where = os.environ.get("SBS_PVESH_TASKS")
    return os.path.join(where, task.replace(":", "_") + ".json") if where else None


def keep_task(task: str, exitstatus: str, log: list[str], hook_exit: int | None = None) -> None:
    """Keep a finished task's result for the task status and log calls (under $SBS_PVESH_TASKS)."""
    path = _task_file(task)
    if path:
        kind, vmid = task.split(":")[5:7]
        with open(path, "w") as f:
            json.dump({"upid": task, "kind": kind, "vmid": int(vmid), "exitstatus": exitstatus, "log": log,
                       "hook_exit": hook_exit, "at": time.monotonic()}, f)


def kept_task(task: str) -> dict | None:
    """A task kept by ``keep_task`` (None: not kept, so it finished OK at once)."""
    path = _task_file(task)
    if path is None:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def start(vmid: int) -> str:
    """PVE's start: the hookscript's pre-start (a refusal fails the task), then a fresh init or the entrypoint as PID 1."""
    task, log, hook_exit = upid("vzstart", vmid), [], None
    hook = os.environ.get("SBS_PVESH_HOOK")
    if hook:
        extra = {k: v for k, v in os.environ.items() if k == "PVEGPU_CONFIG"}
        r = run_as_pve(hook, vmid, "pre-start", extra, timeout=60)
        hook_exit = r.returncode
        log += [f"GUEST HOOK: {vmid} pre-start", *(r.stdout + r.stderr).splitlines()]
        if r.returncode != 0:
            err = f"hookscript error for {vmid} on pre-start: command '{hook} {vmid} pre-start' failed: exit code {r.returncode}"
            keep_task(task, err, [*log, f"TASK ERROR: {err}"], hook_exit)
            return task
    sbs_node.start_ct(vmid, python=os.environ.get("SBS_PYTHON", sys.executable), entry=entrypoint(vmid))
    keep_task(task, "OK", [*log, "TASK OK"], hook_exit)
    return task


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
        keep_task(out, "OK", ["TASK OK"])
    elif action == "start":
        assert isinstance(what, int)
        out = start(what)
    elif action == "task":
        assert isinstance(what, str)
        kept = kept_task(what)
        out = {"status": "stopped", "exitstatus": kept["exitstatus"] if kept else "OK", "upid": what}
    elif action == "log":
        assert isinstance(what, str)
        kept = kept_task(what)
        out = [{"n": i + 1, "t": t} for i, t in enumerate(kept["log"] if kept else ["TASK OK"])]
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
