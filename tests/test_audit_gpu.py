"""pvegpu audit on a real GPU: two PVE-like containers and a host process on GPU 0, each attributed with NVML's numbers, in the textfile too.

Marker ``gpu``: skipped where NVML or CUDA is missing; run on the device H200 (root: cgroups and PID namespaces).
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from pvegpu.adapters.etcpve import EtcPve
from pvegpu.adapters.nodefiles import LocalNodeFiles
from pvegpu.adapters.procfs import ProcHost
from pvegpu.audit.run import audit_document, audit_once
from pvegpu.core.model import MIB
from tests import gpulab as G
from tests import pvelike
from tests.test_gpu import _minor0, _nvml_ok, _used_mib

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _nvml_ok(), reason="no NVIDIA GPU/NVML here (runs on the device machine)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and PID namespaces"),
]


@pytest.fixture
def gpu_node(tmp_path):
    minor = _minor0()
    conf = f"arch: amd64\ndev0: /dev/nvidia{minor},gid=44\ndev1: /dev/nvidiactl,gid=44\nhostname: ct{{v}}\n"
    root = pvelike.etc_pve(str(tmp_path / "pve"), "dev-h200", {v: conf.replace("{v}", str(v)) for v in (311, 312)})
    started: list[int] = []
    host_procs: list[subprocess.Popen] = []
    before = _used_mib()
    yield root, tmp_path, started, host_procs
    for p in host_procs:
        p.kill()
        p.wait()
    for v in started:
        pvelike.destroy_ct(v)
    end = time.monotonic() + 30
    while _used_mib() > before + 64 and time.monotonic() < end:
        time.sleep(0.1)


def test_two_containers_and_a_host_process_attributed_and_exported(gpu_node):
    """CT 311 (2 GiB), CT 312 (3 GiB) and a host process (1 GiB): each holder row has its place, inside pid and NVML's bytes; the textfile carries them.

    Each workload is waited for until it is READY (allocated, and listed by NVML under one of its own pids with its
    memory), failing at once if one died. The old wait (the GPU's total used memory above 5.7 GiB) let the audit run
    before the host process had its context: the CUDA contexts' own memory (about 0.5 GiB each with torch) brought
    the two containers alone over that total, so the host holder was sometimes not listed yet."""
    from prometheus_client.parser import text_string_to_metric_families

    from pvegpu.adapters.nvml import NvmlProbe

    root, tmp, started, host_procs = gpu_node
    workloads = []
    for vmid, gib in ((311, 2), (312, 3)):
        ready, gone = str(tmp / f"ready-{vmid}"), str(tmp / f"exit-{vmid}")
        started.append(vmid)
        pvelike.start_ct(vmid, G.watched_argv(G.holder_argv(gib, ready), gone))
        workloads.append(G.Workload(f"CT {vmid}", gib, ready, lambda v=vmid: pvelike.ct_procs(v), exit_file=gone))
    ready = str(tmp / "ready-host")
    host = subprocess.Popen(G.holder_argv(1, ready), stdin=subprocess.DEVNULL)
    host_procs.append(host)
    workloads.append(G.Workload("host", 1, ready, lambda: [host.pid], exited=host.poll))
    G.wait_ready(workloads, G.nvml_listed, timeout=120)
    rep = audit_once(NvmlProbe, pve=EtcPve(root), host=ProcHost(), files=LocalNodeFiles(root))
    (gpu,) = [g for g in rep.gpus if g.minor == _minor0()]
    by = {}
    for h in gpu.holders:
        if "nvml" in h.via:
            by.setdefault(h.guest_id or h.place, []).append(h)
    for key, gib in (("lxc/311", 2), ("lxc/312", 3), ("host", 1)):
        assert len(by.get(key, [])) >= 1, (key, gpu.holders)
        used = sum(h.used_bytes or 0 for h in by[key])
        assert gib * 1024 * MIB <= used <= (gib + 1) * 1024 * MIB, (key, used)
    ct = by["lxc/311"][0]
    assert ct.ns_pid is not None and ct.ns_pid != ct.pid and ct.hostname == "ct311"
    assert gpu.health.reserved_bytes is not None and gpu.error is None
    out = tmp / "pvegpu.prom"
    from pvegpu.adapters.textfile import write_textfile

    write_textfile(str(out), audit_document([rep]))
    fams = {f.name: f.samples for f in text_string_to_metric_families(out.read_text())}
    mem = {s.labels["id"]: s.value for s in fams["pvegpu_guest_gpu_memory_used_bytes"] if s.labels["uuid"] == gpu.uuid}
    assert mem["lxc/311"] >= 2 * 1024 * MIB and mem["lxc/312"] >= 3 * 1024 * MIB
    outside = [s.value for s in fams["pvegpu_gpu_outside_holders"] if s.labels["uuid"] == gpu.uuid]
    assert outside and outside[0] >= 1
    print("AUDIT-GPU", {k: [(h.pid, h.ns_pid, h.used_bytes) for h in v] for k, v in by.items()}, "reserved", gpu.health.reserved_bytes,
          "remap_pending", gpu.health.remap_pending, "retired", gpu.health.retired_pages_pending, "mig", gpu.health.mig_enabled,
          "driver", gpu.health.driver_version, "audit_s", rep.duration_seconds)
