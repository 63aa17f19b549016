"""An application container on the real GPU (issue 32): its PID 1 IS the CUDA job, and its reset is its verified restart.

A PVE 9.1 application container runs its OCI image's entrypoint as PID 1 (``entrypoint:`` in the config, written as
``lxc.init.cmd``). The lab builds one as the host sees it (bench/sbs_node.py): the monitor in /lxc.monitor/<vmid>, and
bench/cuda_hold.py as PID 1 of its own PID namespace in /lxc/<vmid>/ns, holding GPU memory, with no reaping init. Its
config names that command as ``entrypoint`` and pvegpu's guard as its hookscript. pvegpu runs as a whole process
(``pvegpu --config FILE reset VMID --json``); the API is the pvesh stand-in (bench/pvesh_shim.py) which, as PVE does,
stops by killing the container's cgroups and starts by running the guard's pre-start, then the config's entrypoint as
PID 1 again. The holder notes every SIGTERM it gets (a handler, so one sent to a namespace's init is not dropped).

Marker ``gpu``: skipped where NVML is missing (CI has no GPU); run on the device machine as root. The lab's own parts
run without a GPU (marker ``root``) with a stand-in device and stand-in hookscripts.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from bench import sbs_node as N
from bench.pvesh_shim import launcher as pvesh_launcher
from pvegpu.core.lxcconf import parse_config
from tests import gpulab as G
from tests import pvelike, schemas
from tests.test_gpu import _minor0, _nvml_ok, _used_mib

NODE = "gpu-app"
GIB = 2.0
GRACE = 30.0  # a signal round would wait this long for the holder before anything else: the reset must not


def app_conf(vmid: int, minor: int, entry: list[str]) -> str:
    """The config of an application container as pve-container writes it (``entrypoint`` shell-quoted, console mode),
    with GPU ``minor`` passed through and pvegpu's guard as its hookscript."""
    return (f"arch: amd64\ncmode: console\ndev0: /dev/nvidia{minor},gid=44\ndev1: /dev/nvidiactl,gid=44\n"
            f"entrypoint: {shlex.join(entry)}\nhookscript: local:snippets/pvegpu-guard\nhostname: app{vmid}\n")


class AppLab(G.PvegpuCalls):
    """One PVE-like node with one application container ``vmid``: its /etc/pve tree and settings, the pvesh stand-in
    (first on PATH) that runs ``hook`` at pre-start and keeps its tasks, and the container's entrypoint (default: a
    CUDA holder of ``GIB`` that notes each SIGTERM in ``term_file``)."""

    def __init__(self, tmp: str, vmid: int, minor: int, entry: list[str] | None = None) -> None:
        self.tmp, self.vmid = tmp, vmid
        self.ready, self.term_file, self.output = (os.path.join(tmp, n) for n in ("ready", "sigterm", "ct-output"))
        self.entry = entry or G.holder_argv(GIB, self.ready, "--term-file", self.term_file)
        self.root = pvelike.etc_pve(os.path.join(tmp, "pve"), NODE, {vmid: app_conf(vmid, minor, self.entry)})
        self.config = os.path.join(tmp, "pvegpu.toml")
        with open(self.config, "w") as f:
            f.write(f'pve_root = "{self.root}"\nnode = "{NODE}"\n[api]\nbackend = "local"\n'
                    f'[reset]\nlock_dir = "{tmp}/locks"\ngrace = {GRACE:g}\n')
        os.chmod(self.config, 0o644)  # a settings file is refused when others may write it: never the umask's choice
        bindir = os.path.join(tmp, "bin")
        os.makedirs(bindir)
        pvesh_launcher(bindir, G.REPO)
        self.pvesh_log, self.tasks = os.path.join(tmp, "pvesh.log"), os.path.join(tmp, "tasks")
        open(self.pvesh_log, "w").close()
        os.makedirs(self.tasks)
        self.hook = pvelike.guard(tmp, pvelike.launcher(tmp))
        self.env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), SBS_PVESH_LOG=self.pvesh_log,
                        SBS_PYTHON=sys.executable, PYTHONPATH=G.REPO, SBS_PVE_ROOT=self.root, SBS_PVESH_TASKS=self.tasks,
                        SBS_PVESH_HOOK=self.hook, PVEGPU_CONFIG=self.config)
        self.started = False

    def start(self) -> int:
        """Start the container with its entrypoint as PID 1 (its output to ``output``); returns PID 1's host pid."""
        self.started = True
        return N.start_ct(self.vmid, python=sys.executable, entry=self.entry, output=self.output)

    def workload(self, init: int) -> G.Workload:
        """PID 1 ``init`` as the workload to wait for: ready once NVML lists that very pid with the memory."""
        return G.Workload(f"CT {self.vmid} PID 1 (pid {init})", GIB, self.ready, lambda: [init],
                          exited=lambda: None if N.find_init(self.vmid) == init else -1)

    def wait_ready(self, init: int, timeout: float = 120) -> float:
        try:
            return G.wait_ready([self.workload(init)], G.nvml_listed, timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the container's output: {_tail(self.output)}") from None

    def pvesh(self, verb: str, path: str) -> subprocess.CompletedProcess[str]:
        """The stand-in as pvegpu's local backend calls it."""
        return subprocess.run(["pvesh", verb, path, "--output-format", "json"], capture_output=True, text=True, env=self.env,
                              timeout=60)

    def kept_tasks(self) -> list[dict]:
        """The stand-in's stop/start tasks, oldest first."""
        out = []
        for name in os.listdir(self.tasks):
            with open(os.path.join(self.tasks, name)) as f:
                out.append(json.load(f))
        return sorted(out, key=lambda t: t["at"])

    def teardown(self) -> bool:
        """Stop the container (and whatever its restart started); False when something survived the bounded stop."""
        gone = N.kill_ct(self.vmid) if self.started else True
        pvelike.release_vmid(self.vmid)
        return gone


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:] or "(none)"
    except OSError:
        return "(none)"


def _stand_in_hook(tmp: str, name: str, code: int) -> str:
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\necho \"{name} $1 $2 ${{PVEGPU_CONFIG:+with settings}}\"\nexit {code}\n")
    os.chmod(path, 0o755)
    return path


def _wait(pred, what: str, timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"{what} after {timeout:g} s"
        time.sleep(0.02)


# -- the lab's own parts (no GPU) ------------------------------------------------------------------------------------


def test_the_labs_config_names_the_holder_as_an_application_containers_pid1():
    """The config the lab writes is an application container whose entrypoint is the CUDA holder's argv, guarded."""
    entry = G.holder_argv(GIB, "/tmp/a dir/ready", "--term-file", "/tmp/a dir/sigterm")
    conf = parse_config(app_conf(901, 3, entry))
    assert conf.app and conf.entrypoint == tuple(entry)
    assert "pvegpu-guard" in (conf.hookscript or "") and 3 in conf.gpus.minors


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and PID namespaces")
def test_the_stand_in_api_restarts_the_entrypoint_as_pid1_only_when_the_hookscript_allows(tmp_path):
    """Without a GPU: the entrypoint is PID 1 in /lxc/<vmid>/ns holding the (stand-in) device; the pvesh stand-in's stop
    empties the container; a refusing pre-start hookscript fails the start task and starts nothing; an allowing one
    lets the start run the entrypoint as a new PID 1; each task is kept with its hookscript's exit status."""
    master, dev, rdev = pvelike.private_device()
    (vmid,) = pvelike.claim_vmids(1)
    lab = AppLab(str(tmp_path), vmid, 0, ["sh", "-c", f"exec 3<>{dev}; exec sleep 60"])
    gpu = {(os.major(rdev), os.minor(rdev))}
    base = f"/nodes/{NODE}/lxc/{vmid}/status"
    try:
        init = lab.start()
        _wait(lambda: N.device_holders([init], gpu) == [init], "PID 1 does not hold the stand-in device")
        assert N.ns_pid(init) == 1 and N.cgroup_of(init) == f"/lxc/{vmid}/ns" and N.ct_pids(vmid) == [init]
        assert json.loads(lab.pvesh("get", f"{base}/current").stdout)["status"] == "running"
        stop = lab.pvesh("create", f"{base}/stop")
        assert stop.returncode == 0 and N.find_init(vmid) is None and N.ct_pids(vmid) == []
        assert json.loads(lab.pvesh("get", f"{base}/current").stdout)["status"] == "stopped"

        lab.env["SBS_PVESH_HOOK"] = _stand_in_hook(str(tmp_path), "refuse", 10)
        refused = json.loads(lab.pvesh("create", f"{base}/start").stdout)
        task = json.loads(lab.pvesh("get", f"/nodes/{NODE}/tasks/{refused}/status").stdout)
        assert task["exitstatus"].startswith(f"hookscript error for {vmid} on pre-start") and N.find_init(vmid) is None
        log = [e["t"] for e in json.loads(lab.pvesh("get", f"/nodes/{NODE}/tasks/{refused}/log").stdout)]
        assert f"refuse {vmid} pre-start with settings" in log and log[-1].startswith("TASK ERROR")

        lab.env["SBS_PVESH_HOOK"] = _stand_in_hook(str(tmp_path), "allow", 0)
        allowed = json.loads(lab.pvesh("create", f"{base}/start").stdout)
        assert json.loads(lab.pvesh("get", f"/nodes/{NODE}/tasks/{allowed}/status").stdout)["exitstatus"] == "OK"
        again = N.find_init(vmid)
        assert again is not None and again != init
        _wait(lambda: N.device_holders([again], gpu) == [again], "the restarted PID 1 does not hold the stand-in device")
        assert [(t["kind"], t["exitstatus"] == "OK", t["hook_exit"]) for t in lab.kept_tasks()] == [
            ("vzstop", True, None), ("vzstart", False, 10), ("vzstart", True, 0)]
        assert lab.api_calls() == [f"get {base}/current", f"create {base}/stop", f"get {base}/current",
                                   f"create {base}/start", f"get /nodes/{NODE}/tasks/{refused}/status",
                                   f"get /nodes/{NODE}/tasks/{refused}/log", f"create {base}/start",
                                   f"get /nodes/{NODE}/tasks/{allowed}/status"]
    finally:
        assert lab.teardown(), f"CT {vmid} survived its stop"
        os.close(master)


# -- on the GPU ------------------------------------------------------------------------------------------------------


@pytest.fixture
def app_lab(tmp_path):
    """An AppLab with a claimed vmid; the container (and what its restart started) gone afterwards, and the GPU's
    memory back (bounded) before the next test measures."""
    before = _used_mib()
    (vmid,) = pvelike.claim_vmids(1)
    lab = AppLab(str(tmp_path), vmid, _minor0())
    try:
        yield lab
    finally:
        gone = lab.teardown()
        end = time.monotonic() + 30
        while _used_mib() > before + 64 and time.monotonic() < end:
            time.sleep(0.1)
        assert gone, f"CT {vmid} survived its stop"


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_ok(), reason="no NVIDIA GPU/NVML here (runs on the device machine)")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and PID namespaces")
def test_app_container_whose_pid1_is_a_cuda_job_resets_through_its_verified_restart(app_lab):
    """`pvegpu reset` of an application container whose PID 1 holds GPU memory: exit 0, clean, no signal to its PID 1 (no
    round, no grace waited), the memory verified back by NVML while it was stopped, restarted through the API with
    the guard's pre-start allowing it, and its entrypoint running again as the new PID 1."""
    lab = app_lab
    vmid, minor = lab.vmid, _minor0()
    init = lab.start()
    took = lab.wait_ready(init)
    assert N.ns_pid(init) == 1 and N.ct_pids(vmid) == [init], N.ct_pids(vmid)  # PID 1 is the CUDA job, alone
    born = N.start_time(init)
    os.unlink(lab.ready)  # written again only by the entrypoint the restart runs
    r, wall = lab.pvegpu("reset", str(vmid), "--json")
    doc = schemas.validate(json.loads(r.stdout)) if r.stdout.strip().startswith("{") else {}
    steps = [(s["name"], s["outcome"], s.get("upid", "")) for s in doc.get("steps", [])]
    G.record({"scenario": "application container: PID 1 is the CUDA job (2 GiB), reset (CLI)", "outcome": doc.get("outcome"),
              "exit": r.returncode, "restarted": doc.get("restarted"), "wall_s": round(wall, 3), "ready_s": round(took, 1),
              "api_calls": lab.api_calls(), "steps": [s[:2] for s in steps]})
    assert r.returncode == 0 and doc.get("outcome") == "clean", r.stdout[-3000:] + r.stderr[-2000:]
    assert doc["app_container"] and doc["restarted"] is True and not doc["left_stopped"] and doc["guest_state"] == "running"

    # no signal round against the init: none in the report, none seen by the holder's SIGTERM handler, no grace waited
    assert doc["signalled"] == [] and not [s for s in steps if s[0] in ("round", "signal")], steps
    assert not os.path.exists(lab.term_file), _tail(lab.term_file)
    assert wall < GRACE, f"reset took {wall:.1f} s"

    # verified clean while stopped: a clean verify between the stop task and the start task, with the memory back
    stop = next(i for i, s in enumerate(steps) if s[0] == "task" and ":vzstop:" in s[2])
    start = next(i for i, s in enumerate(steps) if s[0] == "task" and ":vzstart:" in s[2])
    assert any(stop < i < start and s[:2] == ("verify", "clean") for i, s in enumerate(steps)), steps
    (before,) = [g for g in doc["before"] if g["minor"] == minor]
    (after,) = [g for g in doc["after"] if g["minor"] == minor]
    assert after["clean"] and after["ct_holders"] == [] and after["error"] is None, after
    assert before["used_bytes"] - after["used_bytes"] >= 0.9 * GIB * (1 << 30), (before["used_bytes"], after["used_bytes"])

    # through the API: one stop, then one start, whose pre-start guard allowed it
    calls = [c for c in lab.api_calls() if c.endswith(("/status/stop", "/status/start"))]
    assert calls == [f"create /nodes/{NODE}/lxc/{vmid}/status/stop", f"create /nodes/{NODE}/lxc/{vmid}/status/start"], calls
    starts = [t for t in lab.kept_tasks() if t["kind"] == "vzstart"]
    assert [(t["exitstatus"], t["hook_exit"]) for t in starts] == [("OK", 0)], starts

    # the old PID 1 is gone and NVML no longer lists it; the entrypoint is PID 1 again and holds its memory again
    assert N.start_time(init) != born and init not in G.nvml_listed()
    again = N.find_init(vmid)
    assert again is not None and again != init
    lab.wait_ready(again)
