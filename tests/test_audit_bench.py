"""The audit budget's harness (bench/audit.py): the node it builds, the budgets by size, and that ``pvegpu audit`` on its
simulated node names the holders ``fuser`` names (the check the benchmark prints before it times them)."""

from __future__ import annotations

import json

import pytest

from bench import audit as A
from bench import common as C


def test_the_budget_depends_on_the_node_size():
    """2,000 processes: ≤ 1.5× fuser -v; 20,000: ≤ 1×; any other size is measured without a budget."""
    assert A.budget_for(2000) == C.Budget("times_other", 1.5) and A.budget_for(20000) == C.Budget("times_other", 1.0)
    assert A.budget_for(5000) is None


def test_the_node_is_filled_up_to_its_size():
    """Sleepers fill the node up to the size counted in /proc; the holders are started even on a fuller node."""
    assert A.to_spawn(2000, 150, 100) == 1850 and A.to_spawn(2000, 1990, 100) == 100


def test_holders_sit_in_containers_granted_their_gpu():
    """The even containers are granted the GPUs in turn, the odd ones none; the first sleepers are the holders, in the
    granted containers in turn, each holding its container's GPU; the others sit in container i % 100, holding nothing."""
    assert [A.gpu_of(ct, 2) for ct in range(6)] == [0, None, 1, None, 0, None] and A.gpu_of(0, 0) is None
    plan = A.plan(400, 120, ["/dev/nvidia0", "/dev/nvidia1"])
    held = [(ct, dev) for ct, dev in plan if dev]
    assert len(plan) == 400 and plan[:3] == [(0, "/dev/nvidia0"), (2, "/dev/nvidia1"), (4, "/dev/nvidia0")]
    assert len(held) == 120 and held == plan[:120] and plan[100] == (0, "/dev/nvidia0") and plan[120] == (20, None)
    assert all(dev == f"/dev/nvidia{A.gpu_of(ct, 2)}" for ct, dev in held)
    assert A.plan(3, 5, []) == [(0, None), (1, None), (2, None)]


def test_the_simulated_node_has_100_containers_8_running_on_8_gpus():
    """The simulated audit node: 8 GPUs playing the given devices, 100 containers, the first 8 running one 1 GiB workload each."""
    sc = A.sim_scenario([f"/dev/pts/{90 + i}" for i in range(8)])
    running = [c for c in sc["containers"] if c["status"] == "running"]
    assert len(sc["containers"]) == 100 and [g["stand_in"] for g in sc["gpus"]] == [f"/dev/pts/{90 + i}" for i in range(8)]
    assert [c["workloads"] for c in running] == [[{"kind": "simple", "gpu": i, "mib": 1024}] for i in range(8)]


def test_agreement_names_what_only_one_side_saw():
    """The audit's holders against fuser's PIDs: counts, and what only one of them names."""
    doc = json.dumps({"nodes": [{"gpus": [{"holders": [{"pid": 1}, {"pid": 2}]}]}]})
    assert A.agreement(doc, "1 2") == "audit: 2 holders, fuser: 2 PIDs, in both: 2"
    text = A.agreement(doc, "2 3")
    assert text.startswith("audit: 2 holders, fuser: 2 PIDs, in both: 1; only the audit: 1; only fuser: 1")


@pytest.mark.skipif(not C.shutil.which("fuser"), reason="needs fuser (Debian's psmisc)")
def test_the_audit_on_the_simulated_node_names_the_holders_fuser_names():
    """On the bench's simulated node with 16 extra holders, one paired round: `pvegpu audit --json` names every PID fuser
    names, and the row carries both timings and the 2,000-process budget."""
    node = A.SimNode(C.pvegpu_command())
    try:
        row, note = A.measure(node, 0, 1, 16, cgroups=False)
    finally:
        node.close()
    assert len(row.pvegpu) == 1 and len(row.other or []) == 1 and row.failures == []
    assert "16 sleepers started, 16 holding a GPU device" in note
    both = int(note.split("in both: ")[1].split(";")[0].split()[0])
    assert "only" not in note and both >= 24  # 16 sleepers and the 8 running containers' workloads


@pytest.mark.root(reason="needs root: the GPU node's sleepers sit in PVE-like container cgroups")
def test_the_crowd_sits_in_pve_like_containers_and_is_gone_after():
    """On the GPU node the sleepers go into /lxc/<vmid>/ns cgroups, a holder has its GPU's device open as fd 3; closing
    the crowd kills and reaps every sleeper and removes the cgroups."""
    import os

    from tests import pvelike

    with C.PrivateDevices(1) as dev:
        base = 640000 + (os.getpid() % 1000) * 100
        crowd = A.Crowd(A.plan(3, 1, dev.paths), base, cgroups=True)
        try:
            pids = list(crowd.pids)
            cgroups = [open(f"/proc/{p}/cgroup").read().strip().rsplit("::", 1)[-1] for p in pids]
            assert cgroups == [f"/lxc/{base}/ns", f"/lxc/{base + 1}/ns", f"/lxc/{base + 2}/ns"]
            assert os.readlink(f"/proc/{pids[0]}/fd/3") == dev.paths[0] and not os.path.exists(f"/proc/{pids[1]}/fd/3")
        finally:
            crowd.close()
        assert not any(os.path.exists(f"/proc/{p}") for p in pids)
        assert not any(os.path.exists(os.path.dirname(pvelike.cgroup_dir(base + i))) for i in range(A.CTS))
