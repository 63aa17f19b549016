"""Multi-GPU jobs on the simulated node (``--scenario tp8``): a TP=8 job in CT 129, a neighbour CT 130 on GPU 3,
rank 1's fork child keeping GPU 1; reset, audit and the renderers per GPU, through the command line."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pvegpu.audit.render import node_text
from pvegpu.core.holders import via_on
from pvegpu.core.model import MIB, Holding, Via
from pvegpu.sim import scenario as sc
from pvegpu.sim.nvml import SimNvml
from tests.pvelike import REPO

RANK_MIB = 76000


def pvegpu(*args, sim=None):
    pre = ["--simulate", sim.root] if sim else []
    return subprocess.run([sys.executable, "-m", "pvegpu", *pre, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


def ranks(node):
    """GPU minor -> the pid of the rank whose context is there (the job's own record of itself)."""
    return {int(c["gpu"]): int(c["owner"]) for c in node.state.contexts() if c["bytes"] == RANK_MIB * MIB}


def fork_child(node):
    (child,) = [int(h["pid"]) for h in node.state.holders()]
    return child


def neighbour(node):
    (pid,) = [int(c["owner"]) for c in node.state.contexts() if c["bytes"] != RANK_MIB * MIB]
    return pid


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def tp8_variant(**knobs):
    data = copy.deepcopy(sc.TP8)
    data["containers"][0]["workloads"][0].update(knobs)
    return data


def test_reset_stops_every_rank_and_the_fork_child_and_verifies_all_eight_gpus(sim_node):
    """reset 129: the 8 ranks and rank 1's fork child are signalled, all 8 GPUs verified clean, no restart, exit 0;
    CT 130 on GPU 3 is untouched and only CT 129's ranks are credited with memory there."""
    node = sim_node(sc.TP8)
    rank_of, child, other = ranks(node), fork_child(node), neighbour(node)
    r = pvegpu("reset", "129", "--json", "--grace", "0.5", sim=node)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["outcome_kind"] == "clean" and rep["restarted"] is False
    assert {s["pid"] for s in rep["signalled"]} == set(rank_of.values()) | {child}
    assert [g["minor"] for g in rep["after"]] == list(range(8)) and all(g["clean"] for g in rep["after"])
    for g in rep["before"]:
        owners = {h["pid"]: h["memory_bytes"] for h in g["ct_holders"] if h["memory_bytes"]}
        assert owners == {rank_of[g["minor"]]: RANK_MIB * MIB}, g["minor"]  # an fd on a device is no memory on it
    assert alive(other) and node.state.ct(130)["status"] == "running"
    gpu3 = rep["after"][3]
    assert [h["vmid"] for h in gpu3["other_holders"]] == [130] and gpu3["used_bytes"] >= 4096 * MIB


def test_reset_table_is_one_row_per_gpu_in_80_columns(sim_node):
    """The human report of the 8-GPU reset: one row per GPU, each naming the rank that owned its memory, in 80 columns."""
    node = sim_node(sc.TP8)
    rank_of = ranks(node)
    r = pvegpu("reset", "129", "--grace", "0.5", sim=node)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if re.match(r"\d\s+\d\s", line)]
    assert [int(row[0]) for row in rows] == list(range(8))
    assert [int(row[9]) for row in rows] == [rank_of[m] for m in range(8)]  # the owner column
    assert all(row[-1] == "clean" for row in rows)
    assert max(len(line) for line in r.stdout.splitlines()) <= 80


def test_audit_credits_each_gpus_memory_to_its_own_rank(sim_node):
    """audit before the reset: on GPU i NVML's memory is rank i's; the other ranks are fd holders without memory; the
    fork child maps GPU 1 only; CT 130's memory on GPU 3 is CT 130's."""
    node = sim_node(sc.TP8)
    rank_of, child, other = ranks(node), fork_child(node), neighbour(node)
    r = pvegpu("audit", "--json", sim=node)
    doc = json.loads(r.stdout)["nodes"][0]
    for g in doc["gpus"]:
        mine = [h for h in g["holders"] if h["vmid"] == 129]
        listed = [h for h in mine if "nvml" in h["via"]]
        assert [(h["pid"], h["used_bytes"]) for h in listed] == [(rank_of[g["minor"]], RANK_MIB * MIB)], g["minor"]
        fd_only = [h for h in mine if h not in listed]
        assert {h["pid"] for h in fd_only} == (set(rank_of.values()) | {child}) - {rank_of[g["minor"]]}
        assert all(h["used_bytes"] is None and not h["credited_bytes"] for h in fd_only)
        assert [h["pid"] for h in mine if "maps" in h["via"]] == ([child] if g["minor"] == 1 else [])
    gpu3 = [h for h in doc["gpus"][3]["holders"] if h["vmid"] == 130]
    assert [(h["pid"], h["used_bytes"]) for h in gpu3] == [(other, 4096 * MIB)]


def test_ranks_killed_by_hand_leave_gpu_1_to_the_fork_child_and_reset_frees_it(sim_node):
    """The incident: the ranks killed by their NVML pids, GPU 1 keeps its memory (the fork child holds rank 1's
    context); reset 129 stops the child and verifies every GPU without a restart."""
    node = sim_node(sc.TP8)
    rank_of, child = ranks(node), fork_child(node)
    for pid in rank_of.values():
        os.kill(pid, signal.SIGKILL)
    nvml = SimNvml(node.state)
    end = time.monotonic() + 5
    while time.monotonic() < end and any(s.used_bytes for m, s in nvml.sample([0, 2, 4, 5, 6, 7]).items()):
        time.sleep(0.02)
    used = {m: s.used_bytes for m, s in nvml.sample(range(8)).items()}
    assert used[1] >= RANK_MIB * MIB and all(used[m] == 0 for m in (0, 2, 4, 5, 6, 7))
    r = pvegpu("reset", "129", "--json", "--grace", "0.5", sim=node)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["restarted"] is False and {s["pid"] for s in rep["signalled"]} == {child}
    assert rep["before"][1]["heirs"] == {str(rank_of[1]): child} and all(g["clean"] for g in rep["after"])


def test_rank_memory_the_driver_keeps_ends_in_a_restart_then_exit_7_naming_the_gpu_reset(sim_node):
    """driver_keeps_rank 1: after the signals GPU 1 still holds rank 1's memory; the restart does not help either:
    exit 7, GPU 1 alone not clean, diagnosed as a driver leak whose fix is a reset of GPU 1 (or a reboot); the gate
    then refuses CT 129's start for GPU 1 alone (CT 130's memory on GPU 3 is allowed)."""
    node = sim_node(tp8_variant(driver_keeps_rank=1))
    r = pvegpu("reset", "129", "--json", "--grace", "0.5", "--timeout", "1", sim=node)
    assert r.returncode == 7, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["ct_state"] == "stopped" or rep["restarted"]
    assert any(s["name"] == "restart" for s in rep["steps"])
    assert [g["clean"] for g in rep["after"]] == [m != 1 for m in range(8)]
    leaks = [d for d in rep["diagnosis"] if d["kind"] == "driver-leak"]
    assert len(leaks) == 1 and re.search(r"GPU minor 1\b", leaks[0]["problem"])
    assert re.search(r"gpu-reset 1\b", leaks[0]["action"]) and "reboot" in leaks[0]["action"]
    gate = pvegpu("check", "129", "--json", sim=node)  # the gate's verdict per GPU: GPU 1 alone refuses the start
    states = {g["minor"]: g["state"] for g in json.loads(gate.stdout)["gpus"]}
    assert gate.returncode == 10 and states == {m: "refused" if m == 1 else "shared" if m == 3 else "clean" for m in range(8)}


@pytest.mark.parametrize("knobs", [{"gpus": [0, 0]}, {"gpus": [9]}, {"gpus": []}, {"fork_child_of_rank": 8},
                                   {"driver_keeps_rank": "1"}])
def test_bad_tp_workload_is_refused_before_anything_starts(tmp_path, knobs):
    """A tp workload with repeated, undefined or no GPUs, or a variant naming no rank: sim create exits 2, makes nothing."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(tp8_variant(**knobs)))
    r = pvegpu("sim", "create", str(tmp_path / "node"), "--scenario", str(path))
    assert r.returncode == 2 and "tp workload" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "node").exists()


def test_a_mapping_counts_only_on_the_gpu_it_maps():
    """A process with fds on GPUs 0-2 that maps GPU 1 maps GPU 1 only; one that maps only a control node, or whose
    mappings were not read per GPU, keeps the mapping on each of its GPUs."""
    rank = Holding(7, frozenset({0, 1, 2}), frozenset({Via.FD, Via.MAPS}), frozenset({1}))
    assert [Via.MAPS in via_on(rank, m) for m in (0, 1, 2)] == [False, True, False]
    control = Holding(7, frozenset({0, 1, -1}), frozenset({Via.FD, Via.MAPS}), frozenset({-1}))
    unknown = Holding(7, frozenset({0, 1}), frozenset({Via.FD, Via.MAPS}))
    assert all(Via.MAPS in via_on(h, m) for h in (control, unknown) for m in (0, 1))


def test_audit_table_folds_a_guests_fd_only_processes_per_gpu():
    """80 columns: a guest's fd-only processes on a GPU (two or more) are one entry naming every pid; a single one, a
    listed one and one that maps stay rows of their own; --wide keeps one line per process."""
    def holder(pid, via, vmid=129):
        return {"pid": pid, "ns_pid": pid, "comm": "python3", "cmdline": "python3 serve.py", "uid": 0, "user": "root",
                "place": "lxc", "vmid": vmid, "hostname": None, "owner": f"CT {vmid}", "used_bytes": None, "via": via,
                "may_own_context": "nvml" in via}
    holders = [holder(10, ["fd", "nvml"]), holder(11, ["fd"]), holder(12, ["fd"]), holder(13, ["fd", "maps"]), holder(20, ["fd"], 130)]
    node = {"node": "n", "gpus": [{"index": 0, "minor": 0, "bus_id": "0000:41:00.0", "name": "H200", "uuid": "GPU-0",
                                   "holders": holders, "granted_to": []}]}
    text = "\n".join(node_text(node))
    assert len(re.findall(r"pid 1[0-3]\b|pid 20\b", text)) == 3 and re.search(r"2 processes .*pids 11, 12", text.replace("\n", " "))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert len([line for line in node_text(node, wide=True) if " pid " in line]) == 5
