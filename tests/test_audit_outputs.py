"""Audit outputs: the versioned JSON, the Prometheus textfile (checked with prometheus_client's own parser), the table, exit codes, NVML health reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pvegpu.adapters.textfile import write_textfile
from pvegpu.audit.model import SCHEMA, SCHEMA_VERSION
from pvegpu.audit.prom import render
from pvegpu.audit.run import audit_document, audit_once, run_audit
from pvegpu.cli.render import audit_text
from pvegpu.core.errors import EXIT_AUDIT_ATTENTION, EXIT_FAILURE, GpuQueryError
from pvegpu.core.leftover import LeftoverRule
from pvegpu.core.model import MIB, GpuHealth
from pvegpu.sim.driver import context_gap
from tests.pvelike import REPO
from tests.test_audit import NODES, FakeFiles, node


def samples(text: str) -> dict[str, list]:
    """Metric family name -> [(labels, value)], parsed by prometheus_client's parser (raises on a malformed file)."""
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def busy_node():
    host, probe, pve = node((0, 1))
    pve.add_ct(129)
    pve.add_ct(130)
    pve.add_ct(131, minors=(1,))
    for vmid in (129, 130, 131):
        host.add(vmid, init=True)
    probe.context(0, 1000, host.add(129, minors={0}))
    probe.context(0, 2000, host.add(130, minors={0}))
    probe.context(0, 300, host.add(None, minors={0}, comm="burn"))
    probe.leak[0] = 100 * MIB
    probe.fail.add(1)
    probe.health = lambda minor: GpuHealth(reserved_bytes=615 * MIB, mig_enabled=False, driver_version="570.1")
    return host, probe, pve


def test_textfile_parses_and_carries_nvml_numbers_per_guest(tmp_path):
    """Two containers + a host process on GPU 0: per-guest bytes by id/node/uuid/minor, _info identity, bounded anomaly counts."""
    host, probe, pve = busy_node()
    doc = audit_document([run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))], generated_at=1700000000.0)
    path = tmp_path / "pvegpu.prom"
    write_textfile(str(path), doc)
    m = samples(path.read_text())
    mem = {(lb["id"], lb["minor"]): v for lb, v in m["pvegpu_guest_gpu_memory_used_bytes"]}
    assert mem == {("lxc/129", "0"): 1000 * MIB, ("lxc/130", "0"): 2000 * MIB}
    assert all(lb["node"] == "pve1" and lb["uuid"] == "GPU-fake-0" for lb, _ in m["pvegpu_guest_gpu_memory_used_bytes"])
    (info,) = [lb for lb, _ in m["pvegpu_gpu_info"] if lb["minor"] == "0"]
    assert info == {"node": "pve1", "uuid": "GPU-fake-0", "index": "0", "minor": "0", "bus_id": "0000:00:00.0", "name": "", "driver_version": "570.1"}
    gpu0 = {"node": "pve1", "uuid": "GPU-fake-0", "minor": "0"}
    net = 100 * MIB + context_gap(3) - 3 * LeftoverRule().per_context_bytes  # net of the allowance for 3 contexts
    assert (gpu0, 3400 * MIB + context_gap(3)) in m["pvegpu_gpu_memory_used_bytes"] and (gpu0, net) in m["pvegpu_gpu_memory_unattributed_bytes"]
    assert (gpu0, 3 * LeftoverRule().per_context_bytes) in m["pvegpu_gpu_memory_context_allowance_bytes"]
    assert (gpu0, 1.0) in m["pvegpu_gpu_outside_holders"] and (gpu0, 615 * MIB) in m["pvegpu_gpu_memory_reserved_bytes"]
    assert ({"node": "pve1", "kind": "host-holder"}, 1.0) in m["pvegpu_audit_flags"]
    assert m["pvegpu_audit_last_success_timestamp_seconds"] == [({"node": "pve1"}, 1700000000.0)]
    assert "pvegpu_audit_duration_seconds" in m and m["pvegpu_audit_attention"] == [({"node": "pve1"}, 1.0)]


def test_unknown_readings_are_absent_never_zero():
    """The unreadable GPU has up=0 and no memory series; health NVML could not read (remap) has no series at all."""
    host, probe, pve = busy_node()
    m = samples(render(audit_document([run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))])).decode())
    gpu1 = {"node": "pve1", "uuid": "GPU-fake-1", "minor": "1"}
    assert (gpu1, 0.0) in m["pvegpu_gpu_up"]
    for name in ("pvegpu_gpu_memory_used_bytes", "pvegpu_gpu_memory_unattributed_bytes", "pvegpu_gpu_dead_pids"):
        assert all(lb["minor"] != "1" for lb, _ in m[name]), name
    assert all(lb.get("id") != "lxc/131" for lb, _ in m.get("pvegpu_guest_gpu_memory_used_bytes", []))
    assert m.get("pvegpu_gpu_row_remap_pending", []) == [] and m["pvegpu_gpu_mig_enabled"] == [(
        {"node": "pve1", "uuid": "GPU-fake-0", "minor": "0"}, 0.0)]


def test_running_gpu_container_holding_nothing_is_an_explicit_zero():
    """A running container granted the GPU that holds nothing exports 0 bytes (so a drop to 0 is not a missing series)."""
    host, probe, pve = node()
    pve.add_ct(129)
    host.add(129, init=True)
    m = samples(render(audit_document([run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))])).decode())
    assert m["pvegpu_guest_gpu_memory_used_bytes"] == [({"node": "pve1", "id": "lxc/129", "uuid": "GPU-fake-0", "minor": "0"}, 0.0)]


def test_failed_run_keeps_the_last_success_time_and_replaces_the_file_atomically(tmp_path):
    """When NVML cannot start, up=0 and last_success keeps the previous run's time; the file is replaced by rename, no temp left."""
    host, probe, pve = node()
    path = tmp_path / "pvegpu.prom"
    write_textfile(str(path), audit_document([run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))], generated_at=1700000000.0))
    inode = os.stat(path).st_ino

    def broken():
        raise GpuQueryError("NVML could not start: Driver Not Loaded")

    write_textfile(str(path), audit_document([audit_once(broken, pve=pve, host=host, files=FakeFiles(NODES))], generated_at=1700000060.0))
    m = samples(path.read_text())
    assert m["pvegpu_audit_up"] == [({"node": "pve1"}, 0.0)]
    assert m["pvegpu_audit_last_success_timestamp_seconds"] == [({"node": "pve1"}, 1700000000.0)]
    assert os.stat(path).st_ino != inode and os.listdir(tmp_path) == ["pvegpu.prom"]


def test_json_document_is_versioned_and_unknown_is_null():
    """--json carries schema, version, per-node ok/error, flags with advice; an unreadable GPU's numbers are null."""
    host, probe, pve = busy_node()
    doc = json.loads(json.dumps(audit_document([run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))])))
    assert (doc["schema"], doc["version"], doc["attention"]) == (SCHEMA, SCHEMA_VERSION, True)
    n = doc["nodes"][0]
    assert n["ok"] and n["gpus"][1]["used_bytes"] is None and n["gpus"][1]["readable"] is False
    assert all(f["advice"] and isinstance(f["attention"], bool) for f in n["flags"])
    holder = n["gpus"][0]["holders"][0]
    assert set(holder) >= {"pid", "ns_pid", "comm", "cmdline", "uid", "place", "vmid", "id", "hostname", "used_bytes", "via"}


def test_table_shows_unknown_as_question_mark_and_every_flag_with_advice():
    """The table names holders by guest, writes '?' for unknown memory, lists each flag with its advice line."""
    host, probe, pve = busy_node()
    text = audit_text(audit_document([run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))]))
    assert "CT 129" in text and "host" in text and "UNREADABLE" in text and "attention needed (exit 8)" in text
    assert "? reserved" not in text.split("GPU 0")[1].split("GPU 1")[0]
    assert text.count("\n    -> ") == len(run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES)).flags)


def test_attention_exit_code_is_documented_and_distinct_from_internal_error():
    """Exit 8 means 'needs attention'; 1 stays 'unexpected internal error'."""
    assert EXIT_AUDIT_ATTENTION == 8 and EXIT_AUDIT_ATTENTION != EXIT_FAILURE
    assert "exit code 8" in open(os.path.join(REPO, "README.md")).read()


class _Err(Exception):
    pass


def fake_pynvml(**over):
    """A stand-in pynvml module: one GPU, health calls answer or raise NotSupported as configured."""
    m = types.SimpleNamespace()
    m.NVMLError = _Err
    m.NVMLError_NotSupported = type("NS", (_Err,), {})
    m.NVMLError_FunctionNotFound = type("FNF", (_Err,), {})
    m.NVMLLibraryMismatchError = type("LM", (_Err,), {})
    m.nvmlMemory_v2 = 2
    m.NVML_DEVICE_MIG_ENABLE = 1
    m.calls = []
    m.nvmlInit = lambda: m.calls.append("init")
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: 1
    m.nvmlDeviceGetHandleByIndex = lambda i: "h0"
    m.nvmlDeviceGetMinorNumber = lambda h: 0
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    m.nvmlDeviceGetUUID = lambda h: "GPU-0"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busIdLegacy=b"0000:41:00.0")
    m.nvmlDeviceGetMemoryInfo = lambda h, version=None: types.SimpleNamespace(total=143771 * MIB, used=0, reserved=615 * MIB)

    def not_supported(*a):
        raise m.NVMLError_NotSupported("Not Supported")

    m.nvmlDeviceGetRemappedRows = lambda h: (0, 0, 1, 0)
    m.nvmlDeviceGetRetiredPagesPendingStatus = not_supported
    m.nvmlDeviceGetMigMode = lambda h: [0, 0]
    m.nvmlSystemGetDriverVersion = lambda: b"570.86.15"
    for k, v in over.items():
        setattr(m, k, v)
    return m


def test_nvml_health_reads_and_not_supported_is_unknown(monkeypatch):
    """NvmlProbe.health: reserved v2, remap pending, MIG off, driver version; NotSupported (retired pages on Hopper) is None."""
    from pvegpu.adapters import nvml
    from pvegpu.adapters.nvml import NvmlProbe

    fake = fake_pynvml()
    monkeypatch.setattr(nvml, "pynvml", fake)

    with NvmlProbe() as p:
        p.gpus()
        h = p.health(0)
    assert h == GpuHealth(reserved_bytes=615 * MIB, retired_pages_pending=None, remap_pending=True, remap_failed=False,
                          mig_enabled=False, driver_version="570.86.15")
    assert fake.calls == ["init", "shutdown"]


def _field(value, ret=0, vtype=1):
    return [types.SimpleNamespace(nvmlReturn=ret, valueType=vtype, value=types.SimpleNamespace(
        dVal=float(value), uiVal=value, ulVal=value, ullVal=value, sllVal=value, siVal=value))]


def test_nvml_health_reads_recovery_action_ecc_and_persistence(monkeypatch):
    """NvmlProbe.health names NVML's recovery action, counts volatile uncorrected ECC errors and reads persistence mode."""
    from pvegpu.adapters import nvml
    from pvegpu.adapters.nvml import NvmlProbe

    fake = fake_pynvml(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION=230, nvmlDeviceGetFieldValues=lambda h, ids: _field(2),
                       nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: 3, nvmlDeviceGetPersistenceMode=lambda h: 1)
    monkeypatch.setattr(nvml, "pynvml", fake)
    with NvmlProbe() as p:
        p.gpus()
        h = p.health(0)
    assert (h.recovery_action, h.ecc_volatile_uncorrected, h.persistence_mode, h.lost) == ("node-reboot", 3, True, None)


def test_nvml_health_unknown_recovery_action_is_named_unknown_and_a_failed_field_is_none(monkeypatch):
    """A recovery action value NVML did not have when pvegpu was written is "unknown-N"; a field NVML failed is None."""
    from pvegpu.adapters import nvml
    from pvegpu.adapters.nvml import NvmlProbe

    for answer, want in ((_field(42), "unknown-42"), (_field(0, ret=3), None), (_field(0), "none")):
        fake = fake_pynvml(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION=230, nvmlDeviceGetFieldValues=lambda h, ids, a=answer: a)
        monkeypatch.setattr(nvml, "pynvml", fake)
        with NvmlProbe() as p:
            p.gpus()
            assert p.health(0).recovery_action == want


def test_nvml_health_marks_a_gpu_the_driver_calls_lost(monkeypatch):
    """A health read the driver answers with GPU_IS_LOST makes the reading lost=True, never a healthy unknown."""
    from pvegpu.adapters import nvml
    from pvegpu.adapters.nvml import NvmlProbe

    fake = fake_pynvml(NVML_ERROR_GPU_IS_LOST=15)

    def lost(*a):
        e = fake.NVMLError("GPU is lost")
        e.value = 15
        raise e

    fake.nvmlDeviceGetRemappedRows = lost
    monkeypatch.setattr(nvml, "pynvml", fake)
    with NvmlProbe() as p:
        p.gpus()
        assert p.health(0).lost is True


def pvegpu(*args, root):
    return subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", root, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


GPU = {"minor": 0, "index": 0, "reserved_mib": 615}


def test_cli_writes_the_textfile_and_exits_8_on_unattributed_memory(sim_node, tmp_path):
    """On the simulated node: a 300 MiB leak gives exit 8 and a textfile the parser accepts with the guest's bytes."""
    n = sim_node({"node": "s", "gpus": [GPU | {"leak_mib": 300}], "containers": [
        {"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 100}]}]})
    out = tmp_path / "pvegpu.prom"
    r = pvegpu("audit", "--prometheus", str(out), root=n.root)
    assert r.returncode == EXIT_AUDIT_ATTENTION and "Traceback" not in r.stderr, r.stderr
    m = samples(out.read_text())
    assert ({"node": "s", "id": "lxc/129", "uuid": "GPU-sim-0", "minor": "0"}, 100 * MIB) in m["pvegpu_guest_gpu_memory_used_bytes"]
    net = 300 * MIB + context_gap(1) - LeftoverRule().per_context_bytes
    assert ({"node": "s", "uuid": "GPU-sim-0", "minor": "0"}, net) in m["pvegpu_gpu_memory_unattributed_bytes"]


def test_cli_table_exit_0_when_nothing_needs_attention(sim_node):
    """A clean node: the table, 'nothing needs attention', exit 0 (its stand-in is its own: no foreign holder)."""
    n = sim_node({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "gpus": [0], "workloads": []}]})
    r = pvegpu("audit", root=n.root)
    assert r.returncode == 0 and "nothing needs attention" in r.stdout and "lxc/129" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("name", ["no-such-dir/pvegpu.prom", "pvegpu.txt"])
def test_cli_bad_textfile_path_is_one_line_error_exit_2(sim_node, tmp_path, name):
    """An unwritable or non-.prom path: Error + Hint on stderr, exit 2, no traceback, no stray temp file."""
    n = sim_node({"node": "s", "gpus": [GPU], "containers": []})
    r = pvegpu("audit", "--prometheus", str(tmp_path / name), root=n.root)
    assert r.returncode == 2 and r.stderr.startswith("Error: ") and "Hint: " in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(tmp_path) == []


def test_tenant_text_cannot_draw_on_the_terminal():
    """A holder's crafted comm (newline, ANSI escape) is escaped in the table: one line per holder, no raw control bytes."""
    host, probe, pve = node()
    pve.add_ct(129)
    probe.context(0, 100, host.add(129, minors={0}, comm="x\n! fake-flag\x1b[2J"))
    probe.context(0, 100, host.add(None, minors={0}, comm="y\n! fake-flag\x1b[2J"))  # its comm also appears in the host-holder flag
    text = audit_text(audit_document([run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))]))
    assert "\x1b" not in text and "\n! fake-flag" not in text and "x\\x0a! fake-flag\\x1b[2J" in text
