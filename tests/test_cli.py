"""The pvegpu command on the simulated node: output, JSON report, exit codes, errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0}


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
    """Bad vmid (2), unknown vmid (3), a VM on the simulated node (2: no API, no guest agent), bad setting (2): Error + Hint, no traceback."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [], "vms": [{"vmid": 200}]})
    for args, code, text in ((["reset", "abc"], 2, "not a container id"), (["reset", "999"], 3, "no guest 999"),
                             (["reset", "200"], 2, "guest agent"), (["reset", "50"], 2, "not a valid Proxmox guest id")):
        r = pvegpu(*args, sim=node)
        assert r.returncode == code and text in r.stderr and "Hint:" in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "reset", "999", "--grace", "-1"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "reset.grace" in r.stderr


def test_audit_json_places_holders(sim_node):
    """audit --json lists each holder under its container and the configured grants, and nothing else (the
    node's stand-in is its own file: no other process on the machine holds it)."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [
        {"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 100}]},
        {"vmid": 130, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 200}]}]})
    r = pvegpu("audit", "--json", sim=node)
    rep = json.loads(r.stdout)["nodes"][0]
    owners = sorted(h["owner"] for h in rep["gpus"][0]["holders"])
    assert owners == ["CT 129", "CT 130"] and rep["gpus"][0]["configured_for"] == [129, 130]
    assert "shared" in rep["gpus"][0]["flags"]


def test_demo_runs_clean():
    """`pvegpu demo` (the README's first command) resets both demo containers and exits 0; one needs the restart,
    and its start passes pvegpu's guard (installed as its hookscript, run by the simulated start); then the 8-GPU
    node's CT 129 (a TP=8 job), clean too; then the health node: CT 130's start refused, gpu-reset 0, allowed."""
    r = subprocess.run([sys.executable, "-m", "pvegpu", "demo"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("GPU memory verified free") == 3 and "(after a restart)" in r.stdout
    assert "CT 129 (8 GPUs) clean" in " ".join(r.stdout.split())
    assert "start task OK" in r.stdout and "missing-hookscript" not in r.stdout
    assert "CT 130's start refused, GPU 0 reset, then allowed" in " ".join(r.stdout.split())


def test_health_scenario_refuses_a_start_until_gpu_reset(tmp_path):
    """`sim create --scenario health`: check refuses CT 130 (exit 10, a needs-gpu-reset GPU); `gpu-reset 0 --yes`
    stops and starts CT 129 again (verified); then check allows CT 130 (exit 0)."""
    import json
    import os

    root = str(tmp_path / "node")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}

    def pvegpu(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=120, env=env)

    assert pvegpu("sim", "create", root, "--scenario", "health").returncode == 0
    try:
        refused = pvegpu("--simulate", root, "check", "130", "--json")
        assert refused.returncode == 10 and [g["state"] for g in json.loads(refused.stdout)["gpus"]] == ["refused"], refused.stdout
        r = pvegpu("--simulate", root, "gpu-reset", "0", "--yes", "--json")
        doc = json.loads(r.stdout)
        assert r.returncode == 0 and doc["stopped"] == [129] and doc["restarted"] == [129], r.stdout + r.stderr
        assert pvegpu("--simulate", root, "check", "130").returncode == 0
    finally:
        pvegpu("sim", "remove", root)


def test_second_reset_of_same_container_waits_then_refuses(sim_node, tmp_path):
    """One reset per container: while CT 129's lock is held, another reset gives up after reset.lock_wait (exit 9)."""
    import os

    from pvegpu.adapters.locks import ct_lock

    node = sim_node({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "gpus": [0], "workloads": []}]})
    env = dict(os.environ, PVEGPU_RESET_LOCK_DIR=str(tmp_path), PVEGPU_RESET_LOCK_WAIT="0.3")
    with ct_lock(str(tmp_path), 129, wait=0):
        r = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "reset", "129"], capture_output=True, text=True,
                           cwd=REPO, timeout=60, env=env)
    assert r.returncode == 9 and "another pvegpu reset of CT 129 is running" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "reset", "129"], capture_output=True, text=True,
                       cwd=REPO, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr


def test_unknown_guest_is_reported_before_nvml_is_opened(tmp_path):
    """On a node, reset of an unknown guest says so (exit 3) without first failing on NVML (exit 5); a VM goes to the API (its token)."""
    from tests import pvelike

    root = pvelike.etc_pve(str(tmp_path / "pve"), "n1", {129: "dev0: /dev/nvidia0\n"}, vms=(200,))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'pve_root = "{root}"\n[api]\nbackend = "https"\nhost = "127.0.0.1"\n[reset]\nlock_dir = "{tmp_path}/lock"\n')
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    for vmid, code, text in (("999", 3, "no guest 999"), ("200", 2, "api.token_file")):
        r = subprocess.run([sys.executable, "-m", "pvegpu", "--config", str(cfg), "reset", vmid], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert r.returncode == code and text in r.stderr, r.stderr


def test_demo_killed_with_sigterm_cleans_up():
    """`pvegpu demo` killed with SIGTERM stops its workloads (even SIGTERM-ignoring ones) and removes its node."""
    import os
    import re
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "pvegpu", "demo", "--grace", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=REPO)
    root = None
    deadline = time.monotonic() + 60
    assert p.stdout is not None
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if m := re.search(r"in (/\S+pvegpu-sim-\S+):", line):
            root = m.group(1)
        if line.startswith("$ pvegpu reset"):
            break
    assert root is not None
    sids = [json.load(open(os.path.join(root, "cts", f)))["sid"] for f in os.listdir(os.path.join(root, "cts"))]
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 143
    assert not os.path.exists(root)
    alive = [pid for pid in os.listdir("/proc") if pid.isdigit() and _sid(pid) in sids]
    assert alive == []


def _sid(pid: str) -> int | None:
    try:
        text = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return int(fields[3]) if fields[0] not in ("Z", "X") else None
