"""The pvegpu command on the simulated node: output, JSON report, exit codes, errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0, "stand_in": "/dev/full"}


def pvegpu(*args, sim=None):
    pre = ["--simulate", sim.root] if sim else []
    return subprocess.run([sys.executable, "-m", "pvegpu", *pre, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_reset_json_report_and_exit_zero(sim_node):
    """reset --json on a CT with a fork child and a SIGTERM-ignorer: clean, exit 0, every signal in the report."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "gpus": [0], "workloads": [
        {"kind": "fork", "gpu": 0, "mib": 1024}, {"kind": "ignore-term", "gpu": 0, "mib": 512}]}]})
    r = pvegpu("reset", "129", "--json", "--grace", "0.5", sim=node)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["outcome"] == "clean" and rep["after"][0]["used_mib"] == 0
    assert {s["signal"] for s in rep["signalled"]} == {"SIGTERM", "SIGKILL"}
    assert all("/lxc/129/" in s["cgroup"] for s in rep["signalled"])


def test_dry_run_human_output(sim_node):
    """--dry-run prints the plan and the table, signals nothing, exits 0."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 64}]}]})
    r = pvegpu("reset", "129", "--dry-run", sim=node)
    assert r.returncode == 0 and "would: pid" in r.stdout and "nothing was signalled" in r.stdout
    assert pvegpu("reset", "129", "--dry-run", "--json", sim=node).returncode == 0


def test_errors_are_one_line_with_hint_and_exit_code(sim_node):
    """Bad vmid (2), unknown vmid (3), a VM (3), bad setting (2): Error + Hint, no traceback."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [], "vms": [{"vmid": 200}]})
    for args, code, text in ((["reset", "abc"], 2, "not a container id"), (["reset", "999"], 3, "no guest 999"),
                             (["reset", "200"], 3, "VM, not an LXC"), (["reset", "50"], 2, "not a valid Proxmox guest id")):
        r = pvegpu(*args, sim=node)
        assert r.returncode == code and text in r.stderr and "Hint:" in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "reset", "999", "--grace", "-1"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "reset.grace" in r.stderr


def test_audit_json_places_holders(sim_node):
    """audit --json lists each holder under its container and the configured grants (only this node's
    containers are asserted: another process holding the stand-in device shows as a host holder)."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [
        {"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 100}]},
        {"vmid": 130, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 200}]}]})
    r = pvegpu("audit", "--json", sim=node)
    rep = json.loads(r.stdout)
    owners = sorted(h["owner"] for h in rep["gpus"][0]["holders"] if h["owner"] != "host")
    assert owners == ["CT 129", "CT 130"] and rep["gpus"][0]["configured_for"] == [129, 130]
    assert "shared" in rep["gpus"][0]["flags"]


def test_demo_runs_clean():
    """`pvegpu demo` (the README's first command) resets both demo containers and exits 0."""
    r = subprocess.run([sys.executable, "-m", "pvegpu", "demo"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("GPU memory verified free") == 2 and "(after a restart)" in r.stdout
