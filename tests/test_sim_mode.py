"""The simulated node as a documented mode: `pvegpu sim create DIR [--scenario NAME]`, every command with
`--simulate DIR` (hook install/status/uninstall on the node's own files, never this machine's `pct` or /etc/pve),
`pvegpu sim remove DIR`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pvegpu.sim.state import SimState
from tests import pvelike, schemas
from tests.pvelike import REPO


def _pvegpu(*args, env=None, timeout=90):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    return subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env=clean | (env or {}))


@pytest.fixture
def made(tmp_path):
    """`pvegpu sim create` of a scenario into tmp_path/node; the node is removed (its processes killed) afterwards."""
    made = []

    def create(scenario="demo"):
        root = str(tmp_path / f"node-{len(made)}")
        r = _pvegpu("sim", "create", root, "--scenario", scenario)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        made.append(root)
        return root

    yield create
    for root in made:
        if os.path.exists(os.path.join(root, "scenario.json")):
            from pvegpu.sim.scenario import SimNode

            SimNode(root).teardown()


@pytest.fixture
def no_pct(tmp_path):
    """A PATH whose `pct` and `pvesm` record any call: a simulated node must never run this machine's."""
    bindir, calls = tmp_path / "bin", tmp_path / "pct-calls"
    bindir.mkdir()
    for name in ("pct", "pvesm"):
        (bindir / name).write_text(f"#!/bin/sh\necho {name} \"$@\" >> {calls}\nexit 0\n")
        (bindir / name).chmod(0o755)
    return {"PATH": f"{bindir}:{os.environ.get('PATH', '')}"}, calls


def _live_sessions(root: str) -> list[int]:
    return [int(c["sid"]) for c in SimState(root).cts() if c.get("sid") and _alive(int(c["sid"]))]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_sim_create_then_every_command_with_simulate_then_remove(made):
    """A node from `sim create` answers check, audit, reset, hook VMID PHASE and allow-once with their exit codes;
    `sim remove` stops its containers and deletes the directory."""
    root = made("demo")
    assert _live_sessions(root)
    r = _pvegpu("--simulate", root, "audit", "--json")
    doc = schemas.validate(json.loads(r.stdout), "audit")
    assert doc["nodes"][0]["node"] == "pve-sim" and r.returncode == (8 if doc["attention"] else 0)
    r = _pvegpu("--simulate", root, "check", "131", "--json")  # CT 131 runs: no start to decide
    assert r.returncode == 0 and schemas.validate(json.loads(r.stdout), "check")["running"] is True
    r = _pvegpu("--simulate", root, "reset", "131", "--json", "--grace", "1")
    assert r.returncode == 0, r.stderr
    assert schemas.validate(json.loads(r.stdout), "reset")["outcome"] == "clean"
    r = _pvegpu("hook", "131", "post-stop", env={"PVEGPU_SIMULATE": root})  # PVE's call: the node from the environment
    assert r.returncode == 0, r.stderr
    r = _pvegpu("--simulate", root, "hook", "allow-once", "131")
    assert r.returncode == 0 and os.path.exists(os.path.join(root, "allow-once", "131")), r.stderr
    r = _pvegpu("sim", "remove", root)
    assert r.returncode == 0 and not os.path.exists(root), r.stderr


def test_sim_create_refuses_a_used_directory_and_an_unknown_scenario(tmp_path):
    """A directory with files in it, or a scenario that is neither built in nor a file: exit 2, nothing started."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep").write_text("x")
    r = _pvegpu("sim", "create", str(used))
    assert r.returncode == 2 and r.stderr.startswith("Error: ") and os.listdir(used) == ["keep"]
    r = _pvegpu("sim", "create", str(tmp_path / "new"), "--scenario", "no-such-scenario")
    assert r.returncode == 2 and "Hint:" in r.stderr and not os.path.exists(tmp_path / "new")


def test_sim_remove_refuses_a_directory_that_is_no_simulated_node(tmp_path):
    """`sim remove` of a directory `sim create` did not make: exit 2, the directory and its files stay."""
    (tmp_path / "data").write_text("precious")
    r = _pvegpu("sim", "remove", str(tmp_path))
    assert r.returncode == 2 and (tmp_path / "data").read_text() == "precious"


def test_hook_install_status_uninstall_act_on_the_simulated_node_only(made, no_pct):
    """install guards CT 129 in DIR's own config and snippets (status: guarded, exit 0), uninstall takes it off
    (status: not installed, exit 0); this machine's pct/pvesm are never run and the snippets land under DIR."""
    env, calls = no_pct
    root = made("idle")
    r = _pvegpu("--simulate", root, "hook", "status", "--json", env=env)
    doc = schemas.validate(json.loads(r.stdout), "hook-status")
    assert r.returncode == 0 and doc["containers"][0]["state"] == "unguarded" and doc["installed"] is False, r.stdout
    r = _pvegpu("--simulate", root, "hook", "install", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    conf = open(os.path.join(root, "etc-pve", "nodes", "pve-sim", "lxc", "129.conf")).read()
    assert "hookscript: local:snippets/pvegpu-guard" in conf and os.access(os.path.join(root, "snippets", "pvegpu-guard"), os.X_OK)
    r = _pvegpu("--simulate", root, "hook", "status", "--json", env=env)
    doc = schemas.validate(json.loads(r.stdout), "hook-status")
    assert r.returncode == 0 and doc["containers"][0]["state"] == "guarded" and doc["attention"] is False, r.stdout
    r = _pvegpu("--simulate", root, "hook", "uninstall", env=env)
    assert r.returncode == 0 and not os.path.exists(os.path.join(root, "snippets", "pvegpu-guard")), r.stdout + r.stderr
    assert "hookscript" not in open(os.path.join(root, "etc-pve", "nodes", "pve-sim", "lxc", "129.conf")).read()
    r = _pvegpu("--simulate", root, "hook", "status", env=env)
    assert r.returncode == 0 and "not installed on this node" in r.stdout, r.stdout + r.stderr
    assert not calls.exists()


def test_installed_guard_gates_the_simulated_node(made, no_pct):
    """The guard `--simulate DIR hook install` wrote, run as PVE runs a hookscript, refuses CT 129's start (exit 10)
    once a reset without restart left its leaked memory behind (exit 7)."""
    env, calls = no_pct
    root = made("leak")
    assert _pvegpu("--simulate", root, "hook", "install", "129", env=env).returncode == 0
    guard = os.path.join(root, "snippets", "pvegpu-guard")
    r = _pvegpu("--simulate", root, "reset", "129", "--no-restart", "--grace", "0.5", "--timeout", "1")
    assert r.returncode == 7, r.stdout[-2000:] + r.stderr
    r = pvelike.run_as_pve(guard, 129, "pre-start", {"PVEGPU_SIMULATE": root})
    assert r.returncode == 10 and "refusing to start CT 129" in r.stderr, r.stdout + r.stderr
    assert not calls.exists()


def test_hook_install_refuses_a_storage_outside_the_simulated_node(made, no_pct):
    """A simulated node whose storage.cfg points `local` elsewhere (e.g. /var/lib/vz): exit 2, nothing written there."""
    env, _calls = no_pct
    root = made("idle")
    elsewhere = os.path.join(os.path.dirname(root), "elsewhere")
    os.mkdir(elsewhere)
    with open(os.path.join(root, "etc-pve", "storage.cfg"), "w") as f:
        f.write(f"dir: local\n\tpath {elsewhere}\n\tcontent snippets\n")
    for sub in ("install", "uninstall", "status"):
        r = _pvegpu("--simulate", root, "hook", sub, env=env)
        assert r.returncode == 2 and "outside the simulated node" in r.stderr, r.stderr
    assert os.listdir(elsewhere) == []


def test_teardown_never_kills_a_session_the_state_file_names_but_the_node_did_not_start(made):
    """A container state edited to name another process group (here a sleep in its own session): `sim remove`
    leaves that group alive (it checks pid, start time and the init's command line first)."""
    root = made("idle")
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        state = SimState(root)
        ct = state.ct(129)
        ct.update(status="running", sid=other.pid, init_pid=other.pid)
        state.set_ct(129, ct)
        r = _pvegpu("sim", "remove", root)
        assert r.returncode == 0, r.stderr
        time.sleep(0.1)
        assert other.poll() is None
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()


def test_scenario_that_is_a_json_array_or_a_fifo_is_a_usage_error_with_a_hint(tmp_path):
    """A scenario holding a JSON array, or a FIFO given to `demo --scenario`, ends with exit 2, an Error and a Hint line."""
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for argv in (["sim", "create", str(tmp_path / "n1"), "--scenario", str(arr)], ["demo", "--scenario", str(fifo)]):
        r = _pvegpu(*argv, timeout=30)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("Error: ") and "\nHint: " in r.stderr, r.stderr
    assert not (tmp_path / "n1").exists()


def test_demo_into_a_closed_pipe_exits_quietly(tmp_path):
    """`pvegpu demo | head -1`: the reader is gone; pvegpu exits 141 (as SIGPIPE would) with nothing on stderr, not 1,
    and still removes its simulated node."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    rfd, wfd = os.pipe()
    os.close(rfd)  # the reader went away before the first line: every write fails with EPIPE, deterministically
    try:
        r = subprocess.run([sys.executable, "-m", "pvegpu", "demo"], stdout=wfd, stderr=subprocess.PIPE, cwd=REPO,
                           env=clean | {"TMPDIR": str(tmp_path)}, timeout=120)
    finally:
        os.close(wfd)
    assert r.returncode == 141 and r.stderr == b"", (r.returncode, r.stderr)
    assert not [d for d in os.listdir(tmp_path) if d.startswith("pvegpu-sim-")]  # the demo still removed its node
