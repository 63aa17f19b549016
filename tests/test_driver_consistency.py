"""Driver consistency in audit: a running GPU container's NVIDIA libraries against the host's kernel module; a
mismatch is a flag, a JSON field and a Prometheus series; unreadable is unknown; a tenant's links are never followed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pvegpu.adapters.nodefiles import LocalNodeFiles
from pvegpu.core.driver import kernel_version
from tests import schemas
from tests.pvelike import REPO


def pvegpu(*args, root):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    return subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", root, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=clean)


def test_audit_flags_a_container_whose_libraries_are_not_the_hosts_version(sim_node, tmp_path):
    """CT 129 (550.54.14) on a 550.54.15 host: flagged, mismatch in JSON and 1 in Prometheus; CT 130 matches (0);
    CT 131 with no libraries is unknown: no flag, no series."""
    node = sim_node({"node": "s", "kernel_driver": "550.54.15", "gpus": [{"minor": 0, "index": 0}], "containers": [
        {"vmid": 129, "gpus": [0], "user_libs": "550.54.14", "workloads": []},
        {"vmid": 130, "gpus": [0], "user_libs": "550.54.15", "workloads": []},
        {"vmid": 131, "gpus": [0], "workloads": []}]})
    r = pvegpu("audit", "--json", root=node.root)
    doc = schemas.validate(json.loads(r.stdout), "audit")
    n = doc["nodes"][0]
    assert r.returncode == 8 and {g["vmid"]: g["driver"]["state"] for g in n["guests"]} == {129: "mismatch", 130: "match", 131: "unknown"}
    assert [f["subject"] for f in n["flags"] if f["kind"] == "driver-mismatch"] == ["lxc/129"]
    prom = tmp_path / "pvegpu.prom"
    assert pvegpu("audit", "--prometheus", str(prom), root=node.root).returncode == 8
    series = [line for line in prom.read_text().splitlines() if line.startswith("pvegpu_guest_driver_mismatch{")]
    assert sorted(series) == ['pvegpu_guest_driver_mismatch{id="lxc/129",node="s"} 1.0', 'pvegpu_guest_driver_mismatch{id="lxc/130",node="s"} 0.0']


def test_no_host_version_is_unknown_not_a_mismatch(sim_node):
    """No /proc/driver/nvidia/version on the node: every container's check is unknown, nothing flagged."""
    node = sim_node({"node": "s", "gpus": [{"minor": 0, "index": 0}], "containers": [
        {"vmid": 129, "gpus": [0], "user_libs": "550.54.14", "workloads": []}]})
    n = json.loads(pvegpu("audit", "--json", root=node.root).stdout)["nodes"][0]
    assert n["guests"][0]["driver"]["state"] == "unknown" and not [f for f in n["flags"] if f["kind"] == "driver-mismatch"]


def test_lib_directories_reached_through_a_tenants_link_are_not_read(tmp_path):
    """usr/lib inside the root is a link to a directory outside it: not followed, so its libraries do not count."""
    outside = tmp_path / "outside" / "x86_64-linux-gnu"
    outside.mkdir(parents=True)
    (outside / "libcuda.so.999.1").write_text("")
    (tmp_path / "proc" / "7" / "root" / "usr").mkdir(parents=True)
    os.symlink(str(tmp_path / "outside"), tmp_path / "proc" / "7" / "root" / "usr" / "lib")
    files = LocalNodeFiles(proc=str(tmp_path / "proc"))
    assert files.ct_lib_versions(129, 7) == frozenset()
    assert files.ct_lib_versions(129, 8) is None  # no such root: unknown


def test_kernel_version_reads_proprietary_and_open_modules():
    """Both NVRM lines name the version; a file without one names none."""
    assert kernel_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n") == "550.54.15"
    assert kernel_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build\n") == "570.86.15"
    assert kernel_version("garbage\n") is None


def test_a_tenants_thousands_of_library_versions_make_one_short_flag(sim_node):
    """3,000 libcuda.so.1.N files in a tenant's lib directory: still a mismatch, named in a few versions, not thousands."""
    node = sim_node({"node": "s", "kernel_driver": "550.54.15", "gpus": [{"minor": 0, "index": 0}], "containers": [
        {"vmid": 129, "gpus": [0], "user_libs": "550.54.15", "workloads": []}]})
    libs = os.path.join(node.root, "ct-root", "129", "usr", "lib", "x86_64-linux-gnu")
    for i in range(3000):
        open(os.path.join(libs, f"libcuda.so.1.{i}"), "w").close()
    r = pvegpu("audit", "--json", root=node.root)
    n = json.loads(r.stdout)["nodes"][0]
    flag = next(f for f in n["flags"] if f["kind"] == "driver-mismatch")
    assert n["guests"][0]["driver"]["state"] == "mismatch" and "550.54.15" in n["guests"][0]["driver"]["container"]
    assert len(flag["detail"]) < 400 and len(n["guests"][0]["driver"]["container"]) <= 16
    assert len(pvegpu("audit", root=node.root).stdout) < 2000


def test_ct_init_names_each_running_containers_init_and_none_for_a_stopped_one(sim_node):
    """Host.ct_init finds a running container's own init (as its processes' placement says) and None for a stopped one."""
    from pvegpu.sim.host import SessionHost
    from pvegpu.sim.state import SimState

    n = sim_node({"node": "s", "gpus": [{"minor": 0, "index": 0}], "containers": [
        {"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 64}]},
        {"vmid": 130, "status": "stopped", "gpus": [0], "workloads": []}]})
    state = SimState(n.root)
    host = SessionHost(state)
    init = host.ct_init(129)
    info = host.describe(init) if init is not None else None
    assert init == state.ct(129)["init_pid"] and info is not None and info.is_ct_init and host.ct_init(130) is None


def test_a_lib_directory_cut_short_or_unreadable_is_unknown_not_a_match(tmp_path, monkeypatch):
    """The host's version among files read, but the directory has more than are read (or cannot be read): unknown."""
    from pvegpu.adapters import nodefiles

    lib = tmp_path / "proc" / "7" / "root" / "usr" / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True)
    for n in range(5):
        (lib / f"libcuda.so.550.54.{n}").write_text("")
    files = LocalNodeFiles(proc=str(tmp_path / "proc"))
    assert files.ct_lib_versions(129, 7) == frozenset(f"550.54.{n}" for n in range(5))
    monkeypatch.setattr(nodefiles, "MAX_LIB_ENTRIES", 3)
    assert files.ct_lib_versions(129, 7) is None
    monkeypatch.undo()
    real = os.open
    monkeypatch.setattr(nodefiles.os, "open", lambda p, *a, **k: (_ for _ in ()).throw(PermissionError(13, "denied"))
                        if p == "x86_64-linux-gnu" else real(p, *a, **k))
    assert files.ct_lib_versions(129, 7) is None


def test_debians_packaged_driver_libraries_are_read(tmp_path):
    """A Debian container with the packaged driver (libs in <multiarch>/nvidia/current, links elsewhere): its version is read."""
    cur = tmp_path / "proc" / "7" / "root" / "usr" / "lib" / "x86_64-linux-gnu" / "nvidia" / "current"
    cur.mkdir(parents=True)
    (cur / "libcuda.so.535.247.01").write_text("")
    (cur / "libcuda.so.1").write_text("")
    assert LocalNodeFiles(proc=str(tmp_path / "proc")).ct_lib_versions(129, 7) == frozenset({"535.247.01"})
