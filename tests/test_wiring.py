"""The composition root builds one node world per run (simulated or real, chosen once), typed against the ports."""

from __future__ import annotations

import ast
import json
import os
import random

from pvegpu import wiring
from pvegpu.cli import run
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
    """wiring.py annotates nothing as Any: every port it hands out is typed against pvegpu/core/ports.py."""
    tree = ast.parse(open(os.path.join(REPO, "pvegpu", "wiring.py"), encoding="utf-8").read())
    assert not [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "Any"]


def _counting_nvml(monkeypatch, on_shutdown=lambda: None):
    """A stand-in pynvml with one GPU that counts nvmlInit and nvmlShutdown calls (``calls``)."""
    from tests.test_nvml_per_gpu import fake_pynvml, use

    m = use(monkeypatch, fake_pynvml([{"minor": 0, "uuid": "GPU-a"}]))
    m.calls = {"init": 0, "shutdown": 0}

    def init():
        m.calls["init"] += 1

    def shutdown():
        m.calls["shutdown"] += 1
        on_shutdown()

    m.nvmlInit, m.nvmlShutdown = init, shutdown
    return m


def _node_world() -> wiring.NodeWorld:
    from pvegpu.core.settings import Settings

    s = Settings()
    return wiring.NodeWorld(s, False, None, None, None, None, wiring.nvml_reader(s), lambda: None)  # type: ignore[arg-type]


def test_resets_nvml_is_started_once_and_closed_when_the_run_ends(monkeypatch):
    """warm_up() begins NVML's start once (a second call starts nothing more) and the first reading takes it over;
    the ports' ``with`` closes it (one nvmlShutdown per nvmlInit); a later reading opens it afresh."""
    m = _counting_nvml(monkeypatch)
    world = _node_world()
    world.warm_up()
    world.warm_up()
    with world.reset_ports() as ports:
        assert [g.minor for g in ports.probe.gpus()] == [0] and m.calls == {"init": 1, "shutdown": 0}
    assert m.calls == {"init": 1, "shutdown": 1}
    with world.reset_ports() as ports:
        ports.probe.gpus()
    assert m.calls == {"init": 2, "shutdown": 2}


def test_the_command_lines_reset_closes_nvml_behind_without_waiting(monkeypatch):
    """reset_ports(exiting=True) (the command line, which exits right after its report) leaves nvmlShutdown to a
    thread of its own: the ``with`` ends before it returns; without ``exiting`` NVML is closed in this thread."""
    import threading
    import time

    shutdowns: list[int] = []
    release = threading.Event()

    def shutdown():
        shutdowns.append(threading.get_ident())
        release.wait(5)

    _counting_nvml(monkeypatch, shutdown)
    for exiting in (True, False):
        shutdowns.clear()
        release.clear()
        if not exiting:
            release.set()
        with _node_world().reset_ports(exiting=exiting) as ports:
            ports.probe.gpus()
        if exiting:  # out of the with at once; the shutdown runs (and waits) in another thread
            deadline = time.monotonic() + 5
            while not shutdowns and time.monotonic() < deadline:
                time.sleep(0.01)
            assert shutdowns and shutdowns[0] != threading.get_ident()
            release.set()
        else:
            assert shutdowns == [threading.get_ident()]
