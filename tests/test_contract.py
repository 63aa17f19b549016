"""One JSON contract: every --json output (audit, reset, check, hook status, errors) is a versioned pvegpu-<kind>
document that validates against the JSON Schema shipped in the package, in one vocabulary, with the old names
kept beside the new ones (deprecated aliases)."""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys

import jsonschema
import pytest

from pvegpu.core import contract
from pvegpu.gate.decide import GateState
from pvegpu.sim import scenario as sc
from tests import schemas
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0, "stand_in": "/dev/full"}


def _pvegpu(*args, env=None, timeout=90):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    r = subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                       env=clean | (env or {}))
    assert "Traceback" not in r.stderr, r.stderr
    return r, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else None)


def _aliases_agree(doc: object) -> None:
    """Wherever a deprecated name stands, its canonical twin stands beside it, with the same meaning."""
    if isinstance(doc, list):
        for v in doc:
            _aliases_agree(v)
    if not isinstance(doc, dict):
        return
    for old, new in contract.DEPRECATED.items():
        if old in doc:
            assert new in doc, (old, sorted(doc))
            if old == "place":
                assert doc[new] == contract.LOCATIONS.get(doc[old], "unknown")
            elif old.endswith("_mib"):
                assert (doc[old] is None) == (doc[new] is None) and (doc[new] is None or abs(doc[new] / 2**20 - doc[old]) <= 0.5)
            else:
                assert doc[new] == doc[old], old
    for v in doc.values():
        _aliases_agree(v)


def test_every_kind_has_a_valid_draft_2020_12_schema_shipped_as_package_data():
    """pvegpu/data/schema/<kind>.json exists for every kind, is a valid draft 2020-12 schema, and pyproject ships it."""
    for kind in contract.KINDS:
        s = schemas.schema(kind)
        assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert s["properties"]["schema"] == {"const": f"pvegpu-{kind}"} and s["properties"]["schema_version"] == {"const": 1}
    assert '"data/schema/*.json"' in open(os.path.join(REPO, "pyproject.toml")).read()


def test_schemas_reject_a_document_that_breaks_the_contract():
    """The schemas are not vacuous: a float where bytes belong, a missing allow, a place word outside the vocabulary fail."""
    v = jsonschema.Draft202012Validator
    check = {"schema": "pvegpu-check", "schema_version": 1, "vmid": 1, "allow": False, "reasons": [], "fix": [], "error": None}
    assert v(schemas.schema("check")).is_valid(check)
    assert not v(schemas.schema("check")).is_valid({k: x for k, x in check.items() if k != "allow"})
    assert not v(schemas.schema("check")).is_valid(check | {"error": "NVML hung", "allow": True, "exit_code": 5})
    assert not v(schemas.schema("check")).is_valid(check | {"gpus": [{"index": 0, "minor": 0, "uuid": "u", "used_bytes": 1.5, "dead_pids": []}]})
    err = {"schema": "pvegpu-error", "schema_version": 1, "error": "x", "hint": None, "exit_code": 2}
    assert v(schemas.schema("error")).is_valid(err) and not v(schemas.schema("error")).is_valid(err | {"schema_version": 2})


@pytest.fixture
def demo(sim_node):
    return sim_node(sc.DEMO | {"containers": [dict(c) for c in sc.DEMO["containers"]]})


def test_audit_document_validates_and_speaks_the_one_vocabulary(demo):
    """`audit --json`: pvegpu-audit with schema_version 1 (and its old `version`, which other nodes read); holders say
    location container/host, with place lxc/host beside it; bytes in bytes."""
    r, doc = _pvegpu("--simulate", demo.root, "audit", "--json")
    schemas.validate(doc, "audit")
    assert doc["schema"] == "pvegpu-audit" and doc["version"] == doc["schema_version"] == 1
    holders = [h for g in doc["nodes"][0]["gpus"] for h in g["holders"]]
    assert {h["location"] for h in holders if h["vmid"] == 129} == {"container"} and {h["place"] for h in holders if h["vmid"] == 129} == {"lxc"}
    assert all(isinstance(h["used_bytes"], int) or h["used_bytes"] is None for h in holders)
    _aliases_agree(doc)


def test_dumps_writes_two_space_ascii_json_with_enum_members_as_their_values():
    """The one writer: two-space indent, non-ASCII escaped, a StrEnum member as its value, a value JSON has no type
    for as its str."""
    doc = {"state": GateState.REFUSED, "name": "caf\u00e9", "path": pathlib.PurePosixPath("/x"), "n": [1, None], "e": {}}
    assert contract.dumps(doc) == ('{\n  "state": "refused",\n  "name": "caf\\u00e9",\n  "path": "/x",\n'
                                   '  "n": [\n    1,\n    null\n  ],\n  "e": {}\n}')


def test_the_audit_document_is_printed_by_the_one_writer(demo):
    """The simulated node's audit document as printed is ``contract.dumps`` of itself."""
    r, doc = _pvegpu("--simulate", demo.root, "audit", "--json")
    assert doc is not None and r.stdout.rstrip("\n") == contract.dumps(doc)


def test_reset_documents_validate_clean_and_dry_run(demo):
    """`reset --json` (a dry run, then a real one): pvegpu-reset, type lxc, duration_seconds, guest_state, per GPU exact
    bytes and dead_pids beside the deprecated used_mib/ghost_pids/elapsed_s/ct_state."""
    for args in (["--dry-run"], []):
        r, doc = _pvegpu("--simulate", demo.root, "reset", "131", "--json", "--grace", "1", *args)
        assert r.returncode == 0, r.stderr
        schemas.validate(doc, "reset")
        assert doc["type"] == "lxc" and doc["duration_seconds"] == doc["elapsed_s"] and doc["guest_state"] == doc["ct_state"]
        for facts in doc["before"] + doc["after"]:
            assert isinstance(facts["used_bytes"], int) and facts["dead_pids"] == facts["ghost_pids"]
            assert {h["location"] for h in facts["other_holders"]} <= {"container", "host", "monitor", "unknown", "vm"}
        _aliases_agree(doc)


def test_check_documents_validate_refused_allowed_and_failed(sim_node):
    """`check --json`: a running CT (no start to decide: exit 0, allow false, running true), refused (a stopped one on
    a GPU with leftover), allowed (an idle stopped one), and an error (unknown guest): each a pvegpu-check document
    with allow; the error one says allow false beside error, hint and exit code."""
    vmid = random.randint(100_000, 899_999)
    node = sim_node({"node": "s", "gpus": [GPU, {"minor": 1, "index": 1, "leak_mib": 2048}], "containers": [
        {"vmid": vmid, "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 64}]},
        {"vmid": vmid + 1, "status": "stopped", "gpus": [0]}, {"vmid": vmid + 3, "status": "stopped", "gpus": [1]}]})
    r, doc = _pvegpu("--simulate", node.root, "check", str(vmid), "--json")
    assert r.returncode == 0 and schemas.validate(doc, "check")["allow"] is False and doc["running"] is True and doc["error"] is None
    _aliases_agree(doc)
    r, doc = _pvegpu("--simulate", node.root, "check", str(vmid + 3), "--json")
    assert r.returncode == 10 and schemas.validate(doc, "check")["allow"] is False and doc["running"] is False and doc["error"] is None
    _aliases_agree(doc)
    r, doc = _pvegpu("--simulate", node.root, "check", str(vmid + 1), "--json")
    assert r.returncode == 0 and schemas.validate(doc, "check")["allow"] is True and doc["type"] == "lxc"
    r, doc = _pvegpu("--simulate", node.root, "check", str(vmid + 2), "--json")
    assert r.returncode == 3 and schemas.validate(doc, "check")["allow"] is False and doc["exit_code"] == 3 and doc["error"]


def test_check_json_on_a_hung_nvml_says_allow_false(sim_node):
    """NVML hangs past gate.deadline: `check --json` exits 5 with a check document that refuses (allow false: the
    gate fails closed) and carries the error; not a bare {"error": ...}."""
    vmid = random.randint(100_000, 899_999)
    node = sim_node({"node": "s", "gpus": [GPU | {"hang": 30}], "containers": [{"vmid": vmid, "status": "stopped", "gpus": [0]}]})
    r, doc = _pvegpu("--simulate", node.root, "check", str(vmid), "--json", env={"PVEGPU_GATE_DEADLINE": "1"})
    assert r.returncode == 5 and schemas.validate(doc, "check")["allow"] is False and doc["exit_code"] == 5
    assert doc["error"] and doc["reasons"] == [doc["error"]]


def test_vm_check_document_validates(sim_node):
    """`check VMID --json` of a VM (type qemu, devices): the same pvegpu-check document."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [],
                     "vms": [{"vmid": 200, "config": "name: v\nhostpci0: 0000:41:00,pcie=1\n"}], "pci": {"0000:41:00.0": "vfio-pci"}})
    r, doc = _pvegpu("--simulate", node.root, "check", "200", "--json", env={"PVEGPU_GATE_DEADLINE": "25"})
    assert r.returncode == 0 and schemas.validate(doc, "check")["type"] == "qemu" and doc["devices"]


def test_error_document_validates(sim_node):
    """Any other command's error with --json is a pvegpu-error document naming the command, its hint and exit code."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": []})
    r, doc = _pvegpu("--simulate", node.root, "reset", "999999", "--json")
    assert r.returncode == 3 and schemas.validate(doc, "error")["command"] == "reset" and doc["exit_code"] == 3 and doc["hint"]
    assert r.stderr.startswith("Error: ")


def test_vm_reset_document_validates():
    """A VM's reset report (from the guest's nvidia-smi, whole MiB) as pvegpu-reset: type qemu, bytes, dead_pids."""
    from pvegpu.vm.guest import GuestHolder, GuestView
    from pvegpu.vm.reset import VmReport

    view = GuestView([GuestHolder(42, 7, frozenset({"nvml", "fd"}), "python", 1024)],
                     [{"index": 0, "bus_id": "00000000:01:00.0", "used_mib": 1030}], [43])
    rep = VmReport(200, "pve1", ["hostpci0"], before=view, after=GuestView(), vm_state="running", elapsed=1.5)
    doc = schemas.validate(contract.document("reset", rep.to_json()), "reset")
    assert doc["type"] == "qemu" and doc["guest_state"] == "running" and doc["duration_seconds"] == 1.5
    assert doc["before"]["gpus"][0]["used_bytes"] == 1030 * 2**20 and doc["before"]["dead_pids"] == [43]
    assert doc["before"]["holders"][0]["used_bytes"] == 1024 * 2**20
    _aliases_agree(doc)


def test_cluster_audit_with_an_error_row_validates():
    """An audit of a cluster where another node answered garbage: its error row is still a valid node entry."""
    from pvegpu.audit.cluster import Member, audit_cluster
    from pvegpu.audit.model import NodeAudit
    from pvegpu.audit.run import audit_document

    nodes = audit_cluster(NodeAudit("pve1", duration_seconds=0.1), [Member("pve1", "10.0.0.1", True), Member("pve2", "10.0.0.2", True)],
                          lambda ms: {"pve2": {"schema": "pvegpu-audit", "version": 1, "nodes": "\x1b[2J"}})
    doc = schemas.validate(contract.document("audit", audit_document(nodes)), "audit")
    assert [n["ok"] for n in doc["nodes"]] == [True, False]


def test_contract_never_raises_on_what_another_node_sends():
    """Junk inside a document (non-string keys and places, deep nesting) passes through unchanged, never an exception."""
    deep: dict = {"place": 7}
    for _ in range(200):
        deep = {"x": [deep], "ghost_pids": "not a list", 3: None}
    out = contract.document("audit", {"version": 1, "nodes": [deep]})
    assert out["schema_version"] == 1 and out["nodes"][0]["dead_pids"] == "not a list"
    assert contract.document("audit", {"place": ["lxc"]})["location"] == "unknown"


def test_cluster_reads_schema_version_first():
    """Another node's audit is judged by schema_version (its old `version` only when absent): a node writing
    schema_version 2 is an error row saying so, one writing only schema_version 1 is read."""
    from pvegpu.audit.cluster import Member, audit_cluster
    from pvegpu.audit.model import NodeAudit

    entry = {"node": "pve2", "ok": True, "error": None, "duration_seconds": 0.1, "attention": False, "gpus": [], "guests": [],
             "passthrough": [], "flags": []}
    members = [Member("pve1", "10.0.0.1", True), Member("pve2", "10.0.0.2", True)]
    newer = {"schema": "pvegpu-audit", "version": 1, "schema_version": 2, "nodes": [entry]}
    nodes = audit_cluster(NodeAudit("pve1"), members, lambda ms: {"pve2": newer})
    assert nodes[1]["ok"] is False and "schema version 2" in nodes[1]["error"]
    only = {"schema": "pvegpu-audit", "schema_version": 1, "nodes": [entry]}
    assert audit_cluster(NodeAudit("pve1"), members, lambda ms: {"pve2": only})[1]["ok"] is True
