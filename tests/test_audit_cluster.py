"""audit --cluster: membership parsing, merging, and a real run over SSH: one sshd per fake node on loopback, one node down."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from pvegpu.audit.cluster import Member, audit_cluster, parse_members
from pvegpu.audit.model import NodeAudit
from tests.pvelike import REPO

MEMBERS = {"nodename": "pve1", "version": 7, "cluster": {"name": "lab", "version": 3, "nodes": 3, "quorate": 1},
           "nodelist": {"pve1": {"id": 1, "online": 1, "ip": "127.0.0.1"}, "pve2": {"id": 2, "online": 1, "ip": "127.0.0.2"},
                        "pve3": {"id": 3, "online": 0, "ip": "127.0.0.3"}}}


def test_members_parsed_from_dot_members():
    """/etc/pve/.members → name, ip, online; garbage or a single node without nodelist → []."""
    assert parse_members(json.dumps(MEMBERS)) == [Member("pve1", "127.0.0.1", True), Member("pve2", "127.0.0.2", True),
                                                 Member("pve3", "127.0.0.3", False)]
    assert parse_members("not json") == [] and parse_members('{"nodename": "pve1", "version": 1}') == [] and parse_members(None) == []


def remote_doc(node: str, **over):
    return {"schema": "pvegpu-audit", "version": 1, "generated_at": 1.0, "attention": False,
            "nodes": [{"node": node, "ok": True, "error": None, "attention": False, "gpus": [], "guests": [], "passthrough": [], "flags": []} | over]}


def test_merge_every_member_is_a_row_never_a_gap():
    """Answering node: its own entry; offline / unreachable / wrong node / newer schema: error rows with the node's configured guests."""
    local = NodeAudit("pve1")
    from pvegpu.audit.model import GuestRow

    local.guests = [GuestRow(129, "lxc", "pve1", "a", "running"), GuestRow(140, "lxc", "pve2", "b", "unknown"),
                    GuestRow(150, "lxc", "pve3", "c", "unknown"), GuestRow(160, "lxc", "pve4", "d", "unknown"),
                    GuestRow(170, "lxc", "pve5", "e", "unknown"), GuestRow(180, "lxc", "gone", "f", "unknown")]
    members = [Member("pve1", "127.0.0.1", True), Member("pve2", "h2", True), Member("pve3", "h3", False),
               Member("pve4", "h4", True), Member("pve5", "h5", True)]
    asked = []

    def fetch(ms):
        asked.extend(m.name for m in ms)
        return {"pve2": remote_doc("pve2"), "pve4": "ssh root@h4 failed: Connection refused", "pve5": remote_doc("pve5") | {"version": 2}}

    rows = {n["node"]: n for n in audit_cluster(local, members, fetch)}
    assert asked == ["pve2", "pve4", "pve5"]  # the offline member is not asked
    assert [g["id"] for g in rows["pve1"]["guests"]] == ["lxc/129"] and rows["pve2"]["ok"] and rows["pve2"]["guests"] == []
    assert "offline" in rows["pve3"]["error"] and [g["id"] for g in rows["pve3"]["guests"]] == ["lxc/150"]
    assert "Connection refused" in rows["pve4"]["error"] and rows["pve4"]["flags"][0]["kind"] == "node-unreachable"
    assert "schema version 2" in rows["pve5"]["error"] and "not in the cluster membership" in rows["gone"]["error"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(addr: str, port: int, deadline: float = 10.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            socket.create_connection((addr, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"sshd on {addr}:{port} did not come up")


@pytest.fixture
def sshd_lab(tmp_path):
    """Start sshd instances on loopback addresses (forced commands stand in for each node's pvegpu); killed after the test."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if os.geteuid() != 0 or not os.path.exists(sshd) or not shutil.which("ssh-keygen"):
        pytest.skip("needs root, sshd and ssh-keygen (apt-get install openssh-server)")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    for name in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    os.chmod(tmp_path, 0o700)
    shutil.copy(tmp_path / "client.pub", tmp_path / "authorized_keys")
    port = free_port()
    procs = []

    def start(addr: str, command: str) -> None:
        cfg = tmp_path / f"sshd-{addr}.conf"
        cfg.write_text(f"ListenAddress {addr}:{port}\nHostKey {tmp_path / 'host'}\nAuthorizedKeysFile {tmp_path / 'authorized_keys'}\n"
                       "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                       f"StrictModes no\nPidFile none\nForceCommand {command}\n")
        procs.append(subprocess.Popen([sshd, "-D", "-e", "-f", str(cfg)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        wait_listening(addr, port)

    options = ["-F", "/dev/null", "-p", str(port), "-i", str(tmp_path / "client"), "-o", "UserKnownHostsFile=/dev/null",
               "-o", "StrictHostKeyChecking=no", "-o", "LogLevel=ERROR"]
    yield start, options
    for p in procs:
        p.kill()
        p.wait(timeout=10)


GPU = {"minor": 0, "index": 0}


@pytest.mark.root
def test_cluster_audit_over_real_ssh_with_one_node_down(sim_node, sshd_lab):
    """pve1 (here) + pve2 live over ssh; pve3 online but its sshd down, pve4 without pvegpu, pve5 hanging past the deadline: one row each, exit 8."""
    start, options = sshd_lab
    local = sim_node({"node": "pve1", "gpus": [GPU], "containers": [{"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 100}]}]})
    remote = sim_node({"node": "pve2", "gpus": [GPU | {"uuid": "GPU-pve2-0"}], "containers": [
        {"vmid": 140, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 200}]}]})
    etc = local.state.etc_pve
    members = {"nodename": "pve1", "version": 9, "nodelist": {
        "pve1": {"id": 1, "online": 1, "ip": "127.0.0.1"}, "pve2": {"id": 2, "online": 1, "ip": "127.0.0.2"},
        "pve3": {"id": 3, "online": 1, "ip": "127.0.0.3"}, "pve4": {"id": 4, "online": 1, "ip": "127.0.0.4"},
        "pve5": {"id": 5, "online": 1, "ip": "127.0.0.5"}}}
    with open(os.path.join(etc, ".members"), "w") as f:
        json.dump(members, f)
    vmlist = json.load(open(os.path.join(etc, ".vmlist")))
    vmlist["ids"]["150"] = {"node": "pve3", "type": "lxc", "version": 1}
    os.makedirs(os.path.join(etc, "nodes", "pve3", "lxc"))
    with open(os.path.join(etc, "nodes", "pve3", "lxc", "150.conf"), "w") as f:
        f.write("hostname: on-pve3\ndev0: /dev/nvidia0,gid=44\n")
    with open(os.path.join(etc, ".vmlist"), "w") as f:
        json.dump(vmlist, f)
    start("127.0.0.2", f"cd {REPO} && exec {sys.executable} -m pvegpu --simulate {remote.root} audit --json")
    start("127.0.0.4", "exec /nonexistent/pvegpu audit --json")
    start("127.0.0.5", "exec sleep 15")  # a node stuck in the driver: the deadline ends the wait
    argv = [sys.executable, "-m", "pvegpu", "--simulate", local.root, "audit", "--cluster", "--json", "--ssh-timeout", "8",
            *(f"--ssh-option={o}" for o in options)]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 8 and "Traceback" not in r.stderr, r.stderr
    rows = {n["node"]: n for n in json.loads(r.stdout)["nodes"]}
    assert list(rows) == ["pve1", "pve2", "pve3", "pve4", "pve5"]
    mine = [h for h in rows["pve1"]["gpus"][0]["holders"] if h["place"] == "lxc"]
    theirs = [h for h in rows["pve2"]["gpus"][0]["holders"] if h["place"] == "lxc"]
    assert [(h["id"], h["used_bytes"]) for h in mine] == [("lxc/129", 100 << 20)]
    assert [(h["id"], h["used_bytes"]) for h in theirs] == [("lxc/140", 200 << 20)] and rows["pve2"]["gpus"][0]["uuid"] == "GPU-pve2-0"
    assert rows["pve3"]["ok"] is False and "ssh root@127.0.0.3 failed" in rows["pve3"]["error"]
    assert [g["id"] for g in rows["pve3"]["guests"]] == ["lxc/150"]
    assert rows["pve4"]["ok"] is False and "not installed" in rows["pve4"]["error"]
    assert rows["pve5"]["ok"] is False and "no answer within 8 s" in rows["pve5"]["error"]


HOSTILE = "\x1b[2J\x1b[H nothing needs attention\x1b]0;retitled\x07\x1b]52;c;cm0gLXJmIC8=\x07\u202e"


def _hostile_doc(node: str) -> dict:
    """A well-formed audit whose every text is an escape-sequence attack on the admin's terminal."""
    flag = {"kind": "host-holder", "subject": HOSTILE, "detail": HOSTILE, "advice": HOSTILE, "attention": True}
    guest = {"id": "lxc/140", "type": "lxc", "node": node, "name": HOSTILE, "status": "running", "all_gpus": False, "minors": [0],
             "bus_ids": [], "notes": [HOSTILE]}
    return remote_doc(node, attention=True, flags=[flag], guests=[guest], error=HOSTILE, **{HOSTILE: HOSTILE})


def test_remote_text_is_escaped_and_a_malformed_or_deep_answer_is_one_error_row():
    """Escapes in another node's answer never reach the table, JSON or textfile raw; a malformed entry, a deep one and
    a non-document are each that node's error row while the others' rows (and the textfile) are still made."""
    from pvegpu.audit.prom import render
    from pvegpu.audit.render import audit_table
    from pvegpu.audit.run import audit_document

    deep: object = {}
    for _ in range(100):
        deep = {"x": deep}
    members = [Member("pve1", "h1", True), Member("pve2", "h2", True), Member("pve3", "h3", True), Member("pve4", "h4", True),
               Member("pve5", "h5", True)]
    answers = {"pve2": _hostile_doc("pve2"), "pve3": remote_doc("pve3", gpus=[1]), "pve4": remote_doc("pve4", extra=deep),
               "pve5": HOSTILE}
    rows = {n["node"]: n for n in audit_cluster(NodeAudit("pve1"), members, lambda ms: answers)}
    assert rows["pve2"]["ok"] and not rows["pve3"]["ok"] and not rows["pve4"]["ok"] and not rows["pve5"]["ok"]
    assert rows["pve3"]["flags"][0]["kind"] == rows["pve4"]["flags"][0]["kind"] == "node-unreachable"
    doc = audit_document(list(rows.values()))
    for out in (audit_table(doc), json.dumps(doc, ensure_ascii=False), render(doc).decode()):
        assert not any(c in out for c in "\x1b\x07\u202e")


def test_ssh_answer_parse_is_bounded_in_nesting_and_never_raises():
    """A deeply nested, non-UTF-8 or non-object answer is a reason string, never RecursionError or a crash."""
    from pvegpu.adapters.ssh import parse_answer

    for data in (b"[" * 200_000 + b"]" * 200_000, b'{"a": ' * 50 + b"1" + b"}" * 50, b"\xff\xfe", b"[1]", b"{"):
        assert isinstance(parse_answer(data), str)
    assert parse_answer(b'{"schema": "pvegpu-audit"}') == {"schema": "pvegpu-audit"}


@pytest.mark.root
def test_cluster_audit_with_endless_and_hostile_nodes_still_writes_every_row_and_the_textfile(sim_node, sshd_lab, tmp_path):
    """Over real ssh: one node answers endlessly (/dev/zero), one with terminal escapes, one with deep JSON: each is
    bounded (8 MiB, time), one row each, the table has no raw escape, and the textfile is written (exit 8)."""
    start, options = sshd_lab
    local = sim_node({"node": "pve1", "gpus": [GPU], "containers": []})
    etc = local.state.etc_pve
    nodes = {"pve1": "127.0.0.1", "pve2": "127.0.0.2", "pve3": "127.0.0.3", "pve4": "127.0.0.4"}
    with open(os.path.join(etc, ".members"), "w") as f:
        json.dump({"nodename": "pve1", "version": 9, "nodelist": {n: {"id": i, "online": 1, "ip": ip} for i, (n, ip) in enumerate(nodes.items(), 1)}}, f)
    hostile = tmp_path / "hostile.json"
    hostile.write_text(json.dumps(_hostile_doc("pve3")))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    start("127.0.0.2", "exec cat /dev/zero")
    start("127.0.0.3", f"exec cat {hostile}")
    start("127.0.0.4", f"exec cat {deep}")
    prom = tmp_path / "out" / "pvegpu.prom"
    prom.parent.mkdir()
    prom.parent.chmod(0o755)  # the textfile directory is refused when others may write it: never the umask's choice
    argv = [sys.executable, "-m", "pvegpu", "--simulate", local.root, "audit", "--cluster", "--ssh-timeout", "20",
            *(f"--ssh-option={o}" for o in options)]
    t = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 8 and "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - t < 20
    assert not any(c in r.stdout + r.stderr for c in "\x1b\x07\u202e")
    assert all(f"node {n}" in r.stdout for n in nodes)
    r = subprocess.run([*argv, "--prometheus", str(prom), "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 8, r.stderr
    rows = {n["node"]: n for n in json.loads(r.stdout)["nodes"]}
    assert rows["pve3"]["ok"] and not rows["pve2"]["ok"] and not rows["pve4"]["ok"] and "8 MiB" in rows["pve2"]["error"]
    assert 'pvegpu_audit_up{node="pve3"} 1.0' in prom.read_text()
