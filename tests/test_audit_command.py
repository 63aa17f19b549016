"""``pvegpu audit``'s command line: its options reach the audit, bad values and unwritable textfiles are usage errors
(with their JSON document under ``--json``), an unknown option gets typer's answer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pvegpu.cli import audit as auditcmd
from pvegpu.cli import run
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0, "stand_in": "/dev/full"}
DEFAULTS = {"cluster": False, "json_out": False, "prometheus": None, "ssh_timeout": 30.0, "ssh_options": [], "wide": False}


@pytest.mark.parametrize("line,given", [
    ([], {}), (["--json"], {"json_out": True}), (["-v"], {"wide": True}), (["--verbose", "--json"], {"wide": True, "json_out": True}),
    (["--cluster", "--json"], {"cluster": True, "json_out": True}), (["--prometheus", "/tmp/x.prom"], {"prometheus": "/tmp/x.prom"}),
    (["--prometheus=/tmp/y.prom", "--json"], {"prometheus": "/tmp/y.prom", "json_out": True}), (["--ssh-timeout", "5"], {"ssh_timeout": 5.0}),
    (["--ssh-timeout=2.5", "--cluster"], {"ssh_timeout": 2.5, "cluster": True}),
    (["--ssh-option", "Port=2222", "--ssh-option=-i", "--ssh-option", "k"], {"ssh_options": ["Port=2222", "-i", "k"]}),
    (["--ssh-timeout", "3", "--ssh-timeout", "4"], {"ssh_timeout": 4.0}),
])
def test_audit_options_reach_the_audit(monkeypatch, line, given):
    """Each option of `pvegpu audit` arrives at the audit's run as its value; the last of a repeated one wins, and
    --ssh-option collects every one."""
    seen: list[dict] = []
    monkeypatch.setattr(auditcmd, "run", lambda opts, **kw: seen.append(kw) or 0)
    assert run(["audit", *line]) == 0
    assert seen == [DEFAULTS | given]


@pytest.fixture
def busy_node(sim_node):
    return sim_node({"node": "s", "gpus": [GPU], "containers": [
        {"vmid": 129, "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 512}]},
        {"vmid": 130, "status": "stopped", "gpus": [0]}]})


def _audit(root: str, *line: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", root, "audit", *line], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


@pytest.mark.parametrize("line", [("--json", "--ssh-timeout", "0"), ("--ssh-timeout=-2",), ("--json", "--prometheus", "/proc/no/such/dir/x.prom")])
def test_audit_bad_values_are_usage_errors(busy_node, line):
    """A bad value and an unwritable textfile: exit 2, an error on stderr, and with --json the error document."""
    r = _audit(busy_node.root, *line)
    assert r.returncode == 2 and r.stderr.startswith("Error:"), r.stderr
    if "--json" in line:
        doc = json.loads(r.stdout)
        assert doc["schema"] == "pvegpu-error" and doc["command"] == "audit" and doc["exit_code"] == 2


def test_an_unknown_audit_option_gets_typers_answer(busy_node):
    """An unknown option after ``audit``: exit 2 with a usage error naming it, and its JSON error document with --json."""
    r = _audit(busy_node.root, "--json", "--bogus")
    assert r.returncode == 2 and json.loads(r.stdout)["schema"] == "pvegpu-error" and "bogus" in r.stderr
