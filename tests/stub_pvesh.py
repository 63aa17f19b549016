"""A stand-in ``pvesh`` for the local backend's tests: answers like PVE's for CT 129 on node pve1, misbehaves on request.

``install(dirpath, rules)`` writes an executable ``pvesh`` into dirpath (put it first on PATH) and the rules
next to it. A rule is keyed by "<verb> <path>" (or "*" for every call) and may set:
``json`` (the answer), ``raw`` (stdout text), ``raw_hex`` (stdout bytes), ``stderr``, ``exit``,
``sleep`` (seconds before answering), ``child`` (seconds a forked child lives holding stdout and stderr),
``setsid_child`` (the same child, in its own session, out of pvesh's process group), ``pidfile`` (where the
child writes its pid, in the stub's directory), ``write`` ([path, text]: a file written before answering).
``fail_calls`` ([n, ...]: the n-th call of this key, counting from 1, fails with a 500), ``ha`` (status/current
only: the live state, HA-managed with this HA state), ``keeps_state`` (a stop/start that answers but changes nothing,
as when HA only records the request), ``when_stopped`` (a rule used instead while the CT's live state is stopped).
Every call is appended to ``calls.log`` as one line: "<verb> <path>". The CT's state is kept like PVE keeps it:
a stop or start that answers (exit 0) changes what ``status/current`` says, unless a rule answers that itself.
"""

from __future__ import annotations

import json
import os
import sys
import time

UPID = "UPID:pve1:0006A1F2:0B2C3D4E:66F0A1B2:{kind}:129:root@pam:"
DEFAULTS = {
    "get /cluster/resources": {"json": [{"id": "lxc/129", "type": "lxc", "vmid": 129, "node": "pve1", "name": "llm129", "status": "running"}]},
    "get /nodes/pve1/lxc/129/config": {"json": {"hostname": "llm129", "dev0": "/dev/nvidia0,gid=44"}},
    "get /nodes/pve1/lxc/129/status/current": {"json": {"status": "running", "vmid": 129}},
    "create /nodes/pve1/lxc/129/status/stop": {"json": UPID.format(kind="vzstop")},
    "create /nodes/pve1/lxc/129/status/start": {"json": UPID.format(kind="vzstart")},
}


def install(dirpath: str, rules: dict | None = None) -> str:
    """Write ``pvesh`` (a shell wrapper running this file with this interpreter) and rules.json into dirpath."""
    os.makedirs(dirpath, exist_ok=True)
    with open(os.path.join(dirpath, "rules.json"), "w") as f:
        json.dump(rules or {}, f)
    exe = os.path.join(dirpath, "pvesh")
    with open(exe, "w") as f:
        f.write(f"#!/bin/sh\nPVESH_STUB_DIR='{dirpath}' exec {sys.executable} {os.path.abspath(__file__)} \"$@\"\n")
    os.chmod(exe, 0o755)
    return exe


def _rule(here: str, key: str) -> dict:
    with open(os.path.join(here, "rules.json")) as f:
        rules = json.load(f)
    if key in rules:
        return rules[key]
    if "*" in rules:
        return rules["*"]
    if key.startswith("get /nodes/pve1/tasks/"):
        kind = "log" if key.endswith("/log") else "status"
        return {"json": [{"n": 1, "t": "TASK OK"}] if kind == "log" else {"status": "stopped", "exitstatus": "OK"}}
    return DEFAULTS.get(key, {"stderr": f"no such path '{key}'", "exit": 2})


def _state(here: str) -> str:
    try:
        with open(os.path.join(here, "state")) as f:
            return f.read().strip() or "running"
    except OSError:
        return "running"


def main(argv: list[str]) -> int:
    here = os.environ["PVESH_STUB_DIR"]
    verb, path = argv[0], argv[1]
    with open(os.path.join(here, "calls.log"), "a") as f:
        f.write(f"{verb} {path}\n")
    rule = _rule(here, f"{verb} {path}")
    if "when_stopped" in rule and _state(here) == "stopped":
        rule = rule["when_stopped"]
    if rule.get("fail_calls"):
        with open(os.path.join(here, "calls.log")) as f:
            n = sum(1 for line in f if line.strip() == f"{verb} {path}")
        if n in rule["fail_calls"]:
            sys.stderr.write("500 pvedaemon busy\n")
            return 2
    for kind in ("child", "setsid_child"):
        if rule.get(kind) and os.fork() == 0:
            if kind == "setsid_child":
                os.setsid()
            if rule.get("pidfile"):
                with open(os.path.join(here, rule["pidfile"]), "w") as f:
                    f.write(str(os.getpid()))
            time.sleep(float(rule[kind]))
            os._exit(0)
    if rule.get("write"):
        with open(rule["write"][0], "w") as f:
            f.write(rule["write"][1])
    status_key = "get /nodes/pve1/lxc/129/status/current"
    if f"{verb} {path}" == status_key and (rule.get("json") == DEFAULTS[status_key]["json"] or "ha" in rule
                                           or ("fail_calls" in rule and "json" not in rule)):  # the live state
        ha = {"ha": {"managed": 1, "state": rule["ha"]}} if "ha" in rule else {}
        rule = rule | {"json": {"status": _state(here), "vmid": 129} | ha}
    done = {"create /nodes/pve1/lxc/129/status/stop": "stopped", "create /nodes/pve1/lxc/129/status/start": "running"}
    if f"{verb} {path}" in done and not rule.get("exit") and not rule.get("keeps_state") and "json" in rule and str(rule["json"]).startswith("UPID:"):
        with open(os.path.join(here, "state"), "w") as f:
            f.write(done[f"{verb} {path}"])
    time.sleep(float(rule.get("sleep", 0)))
    out = sys.stdout.buffer
    if "raw_hex" in rule:
        out.write(bytes.fromhex(rule["raw_hex"]))
    elif "raw" in rule:
        out.write(rule["raw"].encode())
    elif "json" in rule:
        out.write(json.dumps(rule["json"]).encode() + b"\n")
    out.flush()
    if rule.get("stderr"):
        sys.stderr.write(rule["stderr"] + "\n")
    return int(rule.get("exit", 0))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
