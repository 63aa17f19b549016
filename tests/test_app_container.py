"""Application containers (PVE 9.1 OCI: PID 1 is the GPU job): recognised from the config and from the live facts;
their reset is their verified restart, without signal rounds; through the CLI on a simulated node."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pvegpu.core.lxcconf import parse_config
from pvegpu.sim import scenario as sc
from tests import schemas
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0}


def pvegpu(*args, root):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    return subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", root, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=clean)


@pytest.fixture
def app_node(tmp_path):
    """`pvegpu sim create DIR --scenario app`; its processes killed afterwards."""
    root = str(tmp_path / "node")
    r = subprocess.run([sys.executable, "-m", "pvegpu", "sim", "create", root, "--scenario", "app"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    yield root
    sc.SimNode(root).teardown()


def test_app_scenario_resets_through_its_restart_without_signal_rounds(app_node):
    """`--scenario app`: reset 129 exits 0 after its restart, sends no signal, verified clean while stopped, running again."""
    r = pvegpu("reset", "129", "--json", root=app_node)
    assert r.returncode == 0, r.stderr
    doc = schemas.validate(json.loads(r.stdout), "reset")
    assert doc["outcome"] == "clean" and doc["restarted"] is True and doc["guest_state"] == "running"
    assert doc["signalled"] == [] and not [s for s in doc["steps"] if s["name"] in ("round", "signal")]
    assert doc["app_container"] and doc["after"][0]["used_bytes"] == 0


def test_app_dry_run_says_the_reset_is_its_restart(app_node):
    """The dry run names the application container and plans no signal for its PID 1; nothing is stopped."""
    r = pvegpu("reset", "129", "--dry-run", "--json", root=app_node)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["app_container"] and doc["plan"]
    assert all(p["action"].startswith("none: stopped with the container") for p in doc["plan"])
    assert json.loads(pvegpu("check", "129", "--json", root=app_node).stdout)["running"] is True


def test_live_pid1_holder_makes_a_plain_config_an_app_container(sim_node):
    """No entrypoint in the config, but PID 1 of the container holds the GPU: the reset is its restart, exit 0."""
    node = sim_node({"node": "s", "settings": {"reset.timeout": 5}, "gpus": [GPU], "containers": [
        {"vmid": 129, "gpus": [0], "workloads": [{"kind": "init", "gpu": 0, "mib": 512}]}]})
    r = pvegpu("reset", "129", "--json", root=node.root)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["restarted"] is True and doc["signalled"] == []
    assert "PID 1" in doc["app_container"]


def test_unparseable_entrypoint_is_a_plain_container_said_in_the_dry_run(sim_node):
    """An entrypoint with an open quote: a plain container (signal rounds planned), and the dry run says why."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [
        {"vmid": 129, "gpus": [0], "entrypoint": "vllm 'serve", "workloads": [{"kind": "simple", "gpu": 0, "mib": 64}]}]})
    r = pvegpu("reset", "129", "--dry-run", "--json", root=node.root)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["app_container"] is None
    assert any("entrypoint cannot be parsed" in n for n in doc["notes"])
    assert [p["action"] for p in doc["plan"]] == ["SIGTERM, then SIGKILL after grace"]


@pytest.mark.parametrize(("conf", "app"), [
    ("entrypoint: /sbin/init\n", False),
    ("entrypoint: python3 -m vllm.entrypoints.openai.api_server\n", True),
    ("lxc.init.cmd: /usr/bin/sglang-server --port 30000\n", True),
    ("entrypoint: /usr/bin/server\nlxc.init.cmd = /lib/systemd/systemd\n", False),  # the raw key comes last: LXC runs it
    ("", False),
])
def test_config_names_an_application_container(conf, app):
    """entrypoint / lxc.init.cmd other than a system init is an application container; the raw key wins."""
    assert parse_config("arch: amd64\n" + conf).app is app
