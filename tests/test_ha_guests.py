"""HA-managed GPU containers: `hook status` / `hook install` name those whose HA policy would move a refused start
to another node or into `error`, with the settings to use; unreadable HA files are "HA state unknown"; a refused
start of an HA-managed guest also goes to the (simulated node's) system log."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pvegpu.core.ha import HaFiles, judge, managed
from pvegpu.sim import scenario as sc
from tests import schemas
from tests.pvelike import REPO

GUARD = "local:snippets/pvegpu-guard"


def pvegpu(*args, root):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    return subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", root, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=clean)


def hook(vmid, root):
    """The hookscript's way in, as a simulated start runs it: `pvegpu hook VMID pre-start`, the node in PVEGPU_SIMULATE."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    return subprocess.run([sys.executable, "-m", "pvegpu", "hook", str(vmid), "pre-start"], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=clean | {"PVEGPU_SIMULATE": root})


def _scenario(ha, leak_mib=0):
    return {"node": "pve-sim", "gpus": [{"minor": 0, "index": 0, "leak_mib": leak_mib}],
            "containers": [{"vmid": 129, "status": "stopped", "gpus": [0], "hookscript": GUARD, "ha_managed": True, "workloads": []},
                           {"vmid": 130, "status": "stopped", "gpus": [0], "hookscript": GUARD, "workloads": []}],
            "ha": ha}


@pytest.fixture
def node(tmp_path):
    """`pvegpu sim create` of a scenario file; its processes killed afterwards."""
    made = []

    def make(scenario):
        path, root = tmp_path / f"sc{len(made)}.json", str(tmp_path / f"node{len(made)}")
        path.write_text(json.dumps(scenario))
        r = subprocess.run([sys.executable, "-m", "pvegpu", "sim", "create", root, "--scenario", str(path)],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
        assert r.returncode == 0, r.stderr
        made.append(root)
        return root

    yield make
    for root in made:
        sc.SimNode(root).teardown()


def test_hook_status_flags_an_ha_guest_with_max_relocate_1(node):
    """CT 129 under HA with max_relocate 1, no strict rule: flagged (exit 8) with the set command; CT 130 is not HA's."""
    root = node(_scenario({"resources.cfg": "ct: 129\n\tmax_relocate 1\n\tstate started\n"}))
    r = pvegpu("hook", "status", "--json", root=root)
    doc = schemas.validate(json.loads(r.stdout), "hook-status")
    assert r.returncode == 8 and doc["attention"] is True
    assert [(h["vmid"], h["managed"], h["max_relocate"], h["pinned"]) for h in doc["ha"]] == [(129, True, 1, False)]
    assert "ha-manager set ct:129 --max_relocate 0" in doc["ha"][0]["fix"]
    assert any("ct:129" in p for p in doc["problems"]) and not any("CT 130" in p for p in doc["problems"])


def test_hook_status_passes_an_ha_guest_pinned_by_a_strict_rule_with_max_relocate_0(node):
    """max_relocate 0 and a strict node-affinity rule to this node only (PVE 9): nothing to flag, exit 0."""
    root = node(_scenario({"resources.cfg": "ct: 129\n\tmax_relocate 0\n\tstate started\n",
                           "rules.cfg": "node-affinity: gpu-ct129\n\tresources ct:129\n\tnodes pve-sim\n\tstrict 1\n"}))
    r = pvegpu("hook", "status", "--json", root=root)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["ha"][0]["pinned"] is True and doc["ha"][0]["problems"] == []


def test_unparseable_ha_file_is_ha_state_unknown(node):
    """A resources.cfg pvegpu cannot parse: HA state unknown (managed null), flagged, never a guess."""
    root = node(_scenario({"resources.cfg": "this is not a section config\n"}))
    r = pvegpu("hook", "status", "--json", root=root)
    doc = json.loads(r.stdout)
    assert r.returncode == 8 and {h["vmid"] for h in doc["ha"]} == {129, 130}
    assert all(h["managed"] is None and h["unknown"] for h in doc["ha"])


def test_refused_start_of_an_ha_guest_goes_to_the_system_log(node):
    """The gate refuses both starts (leftover memory); only HA-managed CT 129's refusal is logged, with guest and reason."""
    root = node(_scenario({"resources.cfg": "ct: 129\n\tstate started\n"}, leak_mib=4096))
    assert hook(130, root).returncode == 10
    assert not os.path.exists(os.path.join(root, "journal.log"))
    assert hook(129, root).returncode == 10
    log = open(os.path.join(root, "journal.log")).read().splitlines()
    assert len(log) == 1 and "ct:129" in log[0] and "HA-managed" in log[0] and "MiB" in log[0]


@pytest.mark.parametrize(("ha", "flagged"), [
    ({"resources.cfg": "ct: 129\n\tgroup gpu\n\tmax_relocate 0\n", "groups.cfg": "group: gpu\n\tnodes n1\n\trestricted 1\n"}, False),
    ({"resources.cfg": "ct: 129\n\tgroup gpu\n\tmax_relocate 0\n", "groups.cfg": "group: gpu\n\tnodes n1,n2\n\trestricted 1\n"}, True),
    ({"resources.cfg": "ct: 129\n\tmax_relocate 0\n",
      "rules.cfg": "node-affinity: r\n\tresources ct:129\n\tnodes n1\n\tstrict 1\n\tdisable\n"}, True),
    ({"resources.cfg": "ct: 129\n\tmax_relocate 0\n", "rules.cfg": "node-affinity: r\n\tresources ct:129\n\tnodes n1:2\n"}, True),
])
def test_pinning_needs_a_restricted_group_or_an_enabled_strict_rule_to_this_node_alone(ha, flagged):
    """PVE 8 restricted group / PVE 9 strict enabled rule naming only this node pins; anything else does not."""
    files = HaFiles({n: ha.get(n) for n in ("resources.cfg", "groups.cfg", "rules.cfg")})
    assert judge(129, "n1", files).flagged is flagged


def test_a_named_group_whose_file_cannot_be_read_is_unknown():
    """The resource names a group and groups.cfg is unreadable: unknown, not 'unpinned'."""
    files = HaFiles({"resources.cfg": "ct: 129\n\tgroup gpu\n\tmax_relocate 0\n", "rules.cfg": None},
                    {"groups.cfg": "Permission denied"})
    v = judge(129, "n1", files)
    assert v.managed is None and "groups.cfg" in (v.unknown or "")


def test_a_property_after_a_blank_line_is_not_read_as_the_section_s():
    """PVE ends a section at an empty line and ignores a property after it: such a max_relocate 0 is no fix (unknown)."""
    files = HaFiles({"resources.cfg": "ct: 129\n\tstate started\n\n\tmax_relocate 0\n", "groups.cfg": None,
                     "rules.cfg": "node-affinity: r\n\tresources ct:129\n\tnodes n1\n\tstrict 1\n"})
    v = judge(129, "n1", files)
    assert v.flagged and v.max_relocate != 0


def test_refused_start_with_a_hung_ha_file_ends_within_the_gate_deadline(node):
    """/etc/pve/ha/resources.cfg that never answers (a FIFO, as a hung pmxcfs): the refused start still ends, exit 10."""
    root = node(_scenario({"resources.cfg": "ct: 129\n\tstate started\n"}, leak_mib=4096))
    cfg = os.path.join(sc.SimState(root).etc_pve, "ha", "resources.cfg")
    os.unlink(cfg)
    os.mkfifo(cfg)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    try:
        r = subprocess.run([sys.executable, "-m", "pvegpu", "hook", "129", "pre-start"], capture_output=True, text=True,
                           cwd=REPO, timeout=40, env=clean | {"PVEGPU_SIMULATE": root})
    finally:
        os.unlink(cfg)
    assert r.returncode == 10
    log = open(os.path.join(root, "journal.log")).read()
    assert "HA state unknown" in log and "MiB" in log


def test_an_ignored_ha_resource_is_not_flagged_or_logged_as_ha_managed():
    """state ignored: HA neither starts, retries nor relocates it (the admin's start is a plain start): no HA flag."""
    files = HaFiles({"resources.cfg": "ct: 129\n\tstate ignored\n\tmax_relocate 1\n", "groups.cfg": None, "rules.cfg": None})
    assert not judge(129, "n1", files).flagged
    assert managed("ct:129", files) is False


def test_the_ha_read_of_a_refused_start_gets_only_what_is_left_of_the_gate_deadline(monkeypatch):
    """An HA state read that hangs (pmxcfs) is given what remains of the hook's one gate.deadline, not a second one: with
    nothing left it ends at once, and the refusal is still logged as possibly HA-managed."""
    import time

    from pvegpu import wiring
    from pvegpu.cli import hook as hookmod
    from pvegpu.core.settings import Settings

    lines: list[str] = []
    monkeypatch.setattr(wiring, "ha_files", lambda s: time.sleep(30))
    monkeypatch.setattr(wiring, "system_log", lambda s: lines.append)
    t0 = time.monotonic()
    hookmod._tell_system_log(129, "CT", Settings(), "leftover memory", 0.0)
    assert time.monotonic() - t0 < 2.0 and len(lines) == 1 and "possibly HA-managed" in lines[0]
