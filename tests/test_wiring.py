"""The composition root builds one node world per run (simulated or real, chosen once), typed against the ports."""

from __future__ import annotations

import ast
import json
import os
import random

from pvegpu import wiring
from pvegpu.__main__ import run
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0}


def test_reset_asks_the_composition_root_for_its_node_once(sim_node, monkeypatch, capsys):
    """`pvegpu reset` builds one NodeWorld: the guest is located and reset through the same ports (one simulated-node open)."""
    vmid = random.randint(800_000, 899_999)
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [
        {"vmid": vmid, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 64}]}]})
    calls = {"world": 0, "sim": 0}
    real_world, real_sim = wiring.world, wiring._sim_ports

    def world(s, **kw):
        calls["world"] += 1
        return real_world(s, **kw)

    def sim(s):
        calls["sim"] += 1
        return real_sim(s)

    monkeypatch.setattr(wiring, "world", world)
    monkeypatch.setattr(wiring, "_sim_ports", sim)
    rc = run(["--simulate", node.root, "reset", str(vmid), "--json", "--no-restart"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["exit_code"] == 0, doc
    assert calls == {"world": 1, "sim": 1}


def test_world_is_simulated_or_real_by_one_choice(sim_node, tmp_path):
    """world(s) under --simulate is the simulated node (its files, its ports); reset and audit ports share its PVE port."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": []})
    s = wiring.settings(wiring.GlobalOptions(simulate=node.root))
    w = wiring.world(s)
    assert w.simulated and w.audit_ports().pve is w.pve
    with w.reset_ports() as ports:
        assert ports.pve is w.pve and ports.host is w.host and ports.clock is w.clock


def test_composition_root_has_no_any():
    """wiring.py annotates nothing as Any: every port it hands out is typed against pvegpu/ports.py."""
    tree = ast.parse(open(os.path.join(REPO, "pvegpu", "wiring.py"), encoding="utf-8").read())
    assert not [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "Any"]
