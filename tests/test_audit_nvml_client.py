"""NVML clients on the host (an fd on the device, no mapping, not listed: nvidia-persistenced, DCGM, exporters) are
information in audit, its exit code and Prometheus; a host process that may own a context still needs attention.
The alert rules only use series the textfile has."""

from __future__ import annotations

import os
import re

import yaml

from pvegpu.audit.model import FlagKind
from pvegpu.audit.prom import render
from pvegpu.audit.render import audit_table
from pvegpu.audit.run import audit_document, run_audit
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve
from tests.test_audit import NODES, FakeFiles
from tests.test_audit_outputs import busy_node, samples

RULES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contrib", "prometheus", "pvegpu.rules.yml")
GPU0 = {"node": "pve1", "uuid": "GPU-fake-0", "minor": "0"}


def _node(**host_proc):
    host = FakeHost(FakeClock())
    probe, pve = FakeProbe(host, (0,)), FakePve(host)
    pve.add_ct(129)
    host.add(129, init=True)
    proc = host.add(None, minors={0}, comm="nvidia-persiste", **host_proc)
    return host, probe, pve, proc


def _audit(host, probe, pve):
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    return rep, audit_document([rep], generated_at=1700000000.0)


def test_fd_only_host_process_is_information_not_attention():
    """An fd-only host process: flag nvml-client (i), no host-holder, audit exit 0, and the table says so."""
    host, probe, pve, _proc = _node(maps=False)
    rep, doc = _audit(host, probe, pve)
    assert {f.kind for f in rep.flags} == {FlagKind.NVML_CLIENT}
    assert not rep.attention and not doc["attention"]
    (flag,) = doc["nodes"][0]["flags"]
    assert flag["kind"] == "nvml-client" and flag["attention"] is False
    text = audit_table(doc)
    assert "\ni nvml-client: GPU 0" in text and "NVML client: no context" in text and text.endswith("nothing needs attention")


def test_fd_only_host_process_does_not_raise_the_alerting_series():
    """In the textfile an NVML client is counted in pvegpu_gpu_nvml_clients, not in pvegpu_gpu_outside_holders."""
    host, probe, pve, _proc = _node(maps=False)
    m = samples(render(_audit(host, probe, pve)[1]).decode())
    assert m["pvegpu_gpu_outside_holders"] == [(GPU0, 0.0)] and m["pvegpu_gpu_nvml_clients"] == [(GPU0, 1.0)]
    assert ({"node": "pve1", "kind": "host-holder"}, 0.0) in m["pvegpu_audit_flags"]
    assert ({"node": "pve1", "kind": "nvml-client"}, 1.0) in m["pvegpu_audit_flags"]
    assert m["pvegpu_audit_attention"] == [({"node": "pve1"}, 0.0)]


def test_host_mapper_is_attention_only_while_a_dead_listed_pid_is_unexplained():
    """An unlisted host process that maps the device has no context NVML does not show: an NVML client; while NVML
    lists a dead pid no heir explains it may be keeping that context: host-holder, attention."""
    host, probe, pve, _proc = _node(maps=True)  # maps the device, not listed, nothing dead listed
    rep, doc = _audit(host, probe, pve)
    assert {f.kind for f in rep.flags} == {FlagKind.NVML_CLIENT} and not rep.attention
    m = samples(render(doc).decode())
    assert m["pvegpu_gpu_outside_holders"] == [(GPU0, 0.0)] and m["pvegpu_gpu_nvml_clients"] == [(GPU0, 1.0)]
    host, probe, pve, _proc = _node(maps=True)
    dead = host.add(None, minors={0})
    probe.context(0, 2048, dead)
    del host.procs[dead.pid]  # its context lives on, NVML still lists it: nothing explains it
    rep, doc = _audit(host, probe, pve)
    assert FlagKind.HOST_HOLDER in {f.kind for f in rep.flags} and rep.attention
    assert samples(render(doc).decode())["pvegpu_gpu_outside_holders"] == [(GPU0, 1.0)]


def test_listed_host_process_owns_a_context_and_needs_attention():
    """A host process NVML lists with memory owns a context: host-holder, attention."""
    host, probe, pve, proc = _node(maps=False)
    probe.context(0, 300, proc)
    rep, _doc = _audit(host, probe, pve)
    assert {f.kind for f in rep.flags} == {FlagKind.HOST_HOLDER} and rep.attention


def test_alert_rules_use_only_series_the_textfile_has():
    """Every pvegpu_* series an alert rule names is written by the exporter, and no rule alerts on NVML clients."""
    with open(RULES) as f:
        rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    host, probe, pve = busy_node()
    written = set(samples(render(_audit(host, probe, pve)[1]).decode()))
    named = {n for r in rules for n in re.findall(r"\bpvegpu_[a-z_]+", r["expr"])}
    assert named and named <= written, named - written
    assert not any("nvml_clients" in r["expr"] for r in rules)
    (outside,) = [r for r in rules if r["alert"] == "PvegpuOutsideHolder"]
    assert "pvegpu_gpu_outside_holders" in outside["expr"]
